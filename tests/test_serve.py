"""The serve command: the target with the trained drafter, served as the evaluation served it."""

import dataclasses
import json

import pytest
import test_evaluation
import yaml
from snakemake.utils import validate
from test_serving import TINY_MLA

from draftsmith import serve
from draftsmith.evaluation_summary import summarize
from draftsmith.layout import Layout
from draftsmith.run_config import RunConfig
from draftsmith.server import VLLM_SERVER_MODULE
from draftsmith.serving import MLA_DISABLE_ENV


def finished_run(tmp_path, target_config: dict) -> Layout:
    """A results_dir as a finished run leaves it: the run config record and the serving config."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(target_config))
    config = yaml.safe_load(open("config/config.yaml"))
    validate(config, "workflow/schemas/config.schema.yaml")
    config["target"]["model"] = str(model)
    results = Layout(tmp_path / "results")
    results.run_config.parent.mkdir(parents=True)
    results.run_config.write_text(json.dumps(config))
    drafter = {"model": str(published_drafter(tmp_path)), "method": "eagle3", "num_speculative_tokens": 3}
    results.speculative_config.write_text(json.dumps(drafter))
    return results


def write_summary(results: Layout, drafter: dict) -> None:
    """An evaluation summary as the stage writes it, whose drafter at the default concurrency,
    greedy, is ``drafter`` (sampled at T=0.7, another)."""
    baseline, drafter_job = test_evaluation.job(None, {8: 1.0}), test_evaluation.job(1, {8: 0.8})
    summary = summarize(test_evaluation.settings(1, 8), baseline, {1: drafter_job}, None)
    (greedy,) = summary.recommendation
    sampled = dataclasses.replace(greedy, temperature=0.7, drafter_speculative_config={"model": "elsewhere"})
    rows = [sampled, dataclasses.replace(greedy, drafter_speculative_config=drafter)]
    results.acceptance.parent.mkdir(parents=True)
    dataclasses.replace(summary, recommendation=rows).write(results.acceptance)


def published_drafter(tmp_path):
    """What serve checks of a drafter before it starts vLLM: its config and weights."""
    drafter = tmp_path / "drafter"
    drafter.mkdir(exist_ok=True)
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"")
    return drafter


def test_an_mla_target_is_served_on_cpu_with_mla_disabled_through_the_module_entry_point(tmp_path):
    results = finished_run(tmp_path, TINY_MLA)
    run_config = json.loads(results.run_config.read_text())
    spec = serve.speculative_config(results, num_speculative_tokens=1)
    argv, env = serve.server_command(RunConfig.from_dict(run_config), spec, "0.0.0.0", 8123, ["--max-num-seqs", "4"])
    assert argv[1:3] == ["-m", VLLM_SERVER_MODULE]
    assert argv[argv.index("--host") + 1] == "0.0.0.0" and argv[argv.index("--port") + 1] == "8123"
    served = json.loads(argv[argv.index("--speculative-config") + 1])
    assert served == {**json.loads(results.speculative_config.read_text()), "num_speculative_tokens": 1}
    assert argv[-2:] == ["--max-num-seqs", "4"]
    assert env[MLA_DISABLE_ENV] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # the config's server.env


def test_a_target_without_mla_keeps_its_attention(tmp_path):
    results = finished_run(tmp_path, {"num_hidden_layers": 6, "hidden_size": 128, "vocab_size": 230})
    run_config = json.loads(results.run_config.read_text())
    spec = serve.speculative_config(results, None)
    argv, env = serve.server_command(RunConfig.from_dict(run_config), spec, "127.0.0.1", 8000, [])
    assert MLA_DISABLE_ENV not in env
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 3


def test_an_unfinished_run_is_named_with_the_fix(tmp_path):
    results = finished_run(tmp_path, TINY_MLA)
    results.speculative_config.unlink()
    with pytest.raises(serve.ServeError, match="drafter_speculative_config.json not found: run the workflow"):
        serve.main(["--results-dir", str(results.results)])


def test_a_missing_drafter_is_named_with_the_fix_before_vllm_starts(tmp_path, monkeypatch):
    """A forced training stopped half way removes the drafter the evaluation recommended."""
    results = finished_run(tmp_path, TINY_MLA)
    (tmp_path / "drafter" / "model.safetensors").unlink()
    monkeypatch.setattr(serve.subprocess, "Popen", lambda *a, **k: pytest.fail("vLLM started"))
    with pytest.raises(serve.ServeError, match=r"drafter .*drafter is missing or incomplete.*rerun the workflow"):
        serve.main(["--results-dir", str(results.results)])


def test_the_target_alone_is_served_when_it_measured_fastest_and_the_drafter_on_request(tmp_path):
    """A recommendation of no speculation (null) starts vLLM without a speculative config;
    --drafter serves the trained drafter at its best draft length from the evaluation."""
    results = finished_run(tmp_path, {"num_hidden_layers": 6, "hidden_size": 128, "vocab_size": 230})
    results.speculative_config.write_text("null\n")
    drafter = {"model": str(published_drafter(tmp_path)), "method": "eagle3", "num_speculative_tokens": 1}
    write_summary(results, drafter)
    run_config = RunConfig.from_dict(json.loads(results.run_config.read_text()))
    assert serve.speculative_config(results, None) is None
    argv, _ = serve.server_command(run_config, None, "127.0.0.1", 8000, [])
    assert "--speculative-config" not in argv
    assert "alone" in serve.speculation_text(None)
    with pytest.raises(serve.ServeError, match="target alone fastest.*add --drafter"):
        serve.speculative_config(results, 3)
    assert serve.speculative_config(results, None, drafter=True) == drafter
    assert serve.speculative_config(results, 3, drafter=True) == {**drafter, "num_speculative_tokens": 3}
