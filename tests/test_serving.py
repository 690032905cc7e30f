"""Serving an MLA target with an EAGLE-3 drafter: decided from the installed vLLM's backends."""

import json
import time
from dataclasses import dataclass

import pytest
import yaml
from snakemake.utils import validate

from draftsmith import preflight, serving
from draftsmith.run_config import RunConfig
from draftsmith.serving import ServingError, evaluation_attention, mla_latent_problem
from draftsmith.target import TargetShape

# DeepSeek's real latent geometry (the only one vLLM's CPU MLA kernel takes) on a tiny model.
TINY_MLA = {
    "num_hidden_layers": 6,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "vocab_size": 230,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
}


def test_on_cpu_the_evaluation_disables_mla_because_the_backends_share_no_block_size():
    attention = evaluation_attention(TargetShape.from_dict(TINY_MLA), "cpu")
    assert attention.mla_disabled
    assert "CPU_MLA [16] and CPU_ATTN [MultipleOf(32)] share no KV block size" in attention.reason
    assert attention.server_env() == {"VLLM_MLA_DISABLE": "1"}


def test_a_target_without_mla_is_served_as_it_is():
    attention = evaluation_attention(TargetShape.from_dict({"num_hidden_layers": 6, "hidden_size": 128}), "cpu")
    assert not attention.mla_disabled and attention.server_env() == {}


def test_an_unservable_head_size_is_refused_with_the_reason():
    with pytest.raises(
        ServingError,
        match=r"on cpu: .* share no KV block size, and with MLA disabled "
        r"its attention head 104 .* is not one CPU_ATTN supports",
    ):
        evaluation_attention(TargetShape.from_dict({**TINY_MLA, "qk_nope_head_dim": 40}), "cpu")


def test_a_latent_geometry_the_mla_kernel_lacks_is_named():
    assert mla_latent_problem(TargetShape.from_dict(TINY_MLA), "cpu") is None
    problem = mla_latent_problem(TargetShape.from_dict({**TINY_MLA, "kv_lora_rank": 256}), "cpu")
    assert "CPU_MLA serves latent heads [576]" in problem and "= 320" in problem


@dataclass
class FakeBackend:
    """Stands in for a CUDA backend class, which this CPU build cannot import."""

    name: str
    block_sizes: list

    def get_name(self):
        return self.name

    def get_supported_kernel_block_sizes(self):
        return self.block_sizes


def test_on_cuda_backends_without_a_common_size_are_refused(monkeypatch):
    from vllm.v1.attention.backend import MultipleOf

    compatible = (FakeBackend("FLASHMLA", [64]), FakeBackend("FLASH_ATTN", [MultipleOf(16)]))
    monkeypatch.setattr(serving, "_backends", lambda device: compatible)
    assert not evaluation_attention(TargetShape.from_dict(TINY_MLA), "cuda").mla_disabled
    conflicting = (FakeBackend("FLASHMLA", [64]), FakeBackend("FLASH_ATTN", [MultipleOf(128)]))
    monkeypatch.setattr(serving, "_backends", lambda device: conflicting)
    with pytest.raises(ServingError, match="install the pinned vLLM"):
        evaluation_attention(TargetShape.from_dict(TINY_MLA), "cuda")


def test_preflight_refuses_an_unservable_target_in_seconds(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    # A Kimi-style wrapper: the language model's config nested under text_config.
    (model / "config.json").write_text(json.dumps({"text_config": {**TINY_MLA, "qk_nope_head_dim": 40}}))
    config = yaml.safe_load(open("config/config.yaml"))
    validate(config, "workflow/schemas/config.schema.yaml")
    config["target"]["model"] = str(model)
    started = time.monotonic()
    problems = preflight.check_target(RunConfig.from_dict(config))
    assert any(p.startswith("the evaluation cannot serve this MLA target") for p in problems), problems
    print(f"refused in {time.monotonic() - started:.1f}s")
