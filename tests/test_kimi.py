"""Kimi-K2.5 specifics that need no weights: the nested text_config through every reader, and
target.trust_remote_code reaching every consumer of the tokenizer or config."""

import json
import shutil
from pathlib import Path

import pytest
import transformers
import yaml
from snakemake.utils import validate

from draftsmith import dataset, generate, layout, preflight, prompt_length, train
from draftsmith.layers import resolve_layers
from draftsmith.run_config import RunConfig
from draftsmith.run_costs import plan_for
from draftsmith.server import ServerSpec
from draftsmith.settings import stage_view
from draftsmith.target import read_target_config

ROOT = Path(__file__).resolve().parents[1]
KIMI_CONFIG = ROOT / "tests/data/kimi-k2.5-config.json"


@pytest.fixture
def kimi(tmp_path) -> dict:
    """The production config with its target replaced by a folder holding only config.json."""
    config = yaml.safe_load((ROOT / "config/kimi-k2.5-int4.yaml").read_text())
    validate(config, str(ROOT / "workflow/schemas/config.schema.yaml"))
    model = tmp_path / "Kimi-K2.5-INT4"
    model.mkdir()
    shutil.copy(KIMI_CONFIG, model / "config.json")
    config["target"]["model"] = str(model)
    return config


def test_the_nested_text_config_is_what_every_reader_sees(kimi, tmp_path):
    text = read_target_config(kimi["target"]["model"])
    assert (text["num_hidden_layers"], text["hidden_size"], text["vocab_size"]) == (61, 7168, 163840)
    assert resolve_layers(kimi["layers"], text["num_hidden_layers"]).vllm_ids == [3, 31, 59, 61]
    plan = plan_for(RunConfig.from_dict(kimi), tmp_path / "results")
    assert plan["hidden_size"] == 7168 and plan["stored_layers"] == 4
    assert preflight.check_target(RunConfig.from_dict(kimi)) == []  # layers, TP 8 | 64 heads, vocab, MLA geometry


def test_a_draft_vocabulary_above_kimis_is_refused(kimi):
    kimi["training"]["draft_vocab_size"] = 200_000
    assert any(
        "exceeds the target's vocabulary of 163840" in p for p in preflight.check_target(RunConfig.from_dict(kimi))
    )


def test_trust_remote_code_reaches_every_consumer(kimi, tmp_path, monkeypatch):
    kimi["target"]["trust_remote_code"] = True
    seen = {}

    def loader(name):
        def load(model, **kwargs):
            seen[name] = kwargs.get("trust_remote_code")
            raise RuntimeError("stop here: nothing to load without weights")

        return load

    # Every stage that measures prompts loads the tokenizer: questions, the evaluation sets, generation.
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", loader("tokenizer"))
    for stage, answer in (("questions", "generation.max_tokens"), ("evaluation_sets", "evaluation.max_tokens")):
        with pytest.raises(RuntimeError, match="stop here"):
            prompt_length.prompt_limit(RunConfig.from_dict(stage_view(kimi, stage)), answer)
        assert seen.pop("tokenizer") is True
    with pytest.raises(RuntimeError, match="stop here"):
        generate.prompt_meter(
            RunConfig.from_dict(stage_view(kimi, "generate")), [{"id": "q", "messages": [{"role": "user"}]}]
        )
    assert seen == {"tokenizer": True}
    # prepare-data, speculators train and every vLLM server get the flag.
    prepare = dataset.prepare_data_command(
        RunConfig.from_dict(stage_view(kimi, "dataset")), tmp_path / "m.jsonl", tmp_path / "o"
    )
    assert "--trust-remote-code" in prepare
    layers = resolve_layers(kimi["layers"], 61)
    paths = layout.TrainPaths(tmp_path / "d", tmp_path / "h", tmp_path / "s", tmp_path / "o")
    for stage in ("train", "untrained_drafter"):
        assert "--trust-remote-code" in train.speculators_args(
            RunConfig.from_dict(stage_view(kimi, stage)), layers, paths
        )
    for stage in ("generate", "extract", "evaluate_baseline", "evaluate_drafter"):
        assert "--trust-remote-code" in ServerSpec.from_config(RunConfig.from_dict(stage_view(kimi, stage))).command(
            8000
        )


def test_the_kimi_fixture_is_the_shape_of_the_real_config():
    config = json.loads(KIMI_CONFIG.read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    text = config["text_config"]
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"], text["num_attention_heads"]) == (512, 64, 64)
