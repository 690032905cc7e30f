"""The capture server and the trainer share each GPU under a disk budget: the estimate that
refuses a split that cannot fit, with the setting to move (Kimi on 8 x H200)."""

import re

import pytest
import yaml

from draftsmith.gpu_memory import GIB, kv_bytes_per_token, split_problems, trainer_bytes
from draftsmith.preflight import check_capture_memory
from draftsmith.run_config import RunConfig
from draftsmith.target import TargetShape

KIMI_TEXT = {
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "num_attention_heads": 64,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "vocab_size": 163840,
}
H200 = int(139.8 * GIB)
KIMI_INT4_WEIGHTS = 595 * 10**9  # the checkpoint's safetensors files


def kimi(fraction: float, total_seq_len: int) -> dict:
    config = yaml.safe_load(open("config/kimi-k2.5-int4.yaml"))
    config["hidden_states"] = {"disk_budget": 0, "stored_dtype": "served", "capture_memory_fraction": fraction}
    config["training"]["total_seq_len"] = total_seq_len
    return config


def test_the_trainer_estimate_is_the_h200_measurement_at_kimi_width():
    # Measured peak reserved: 45.2 GiB at 8192, 67.3 at 16384, 116.0 at 32768 tokens per step.
    for tokens, measured in ((8192, 45.2), (16384, 67.3), (32768, 116.0)):
        assert trainer_bytes(7168, tokens) / GIB == pytest.approx(measured, rel=0.05)


def test_mla_keeps_its_latent_on_every_rank_other_attention_splits():
    assert kv_bytes_per_token(TargetShape.from_dict(KIMI_TEXT), 8) == (512 + 64) * 61 * 2
    llama = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}
    assert kv_bytes_per_token(TargetShape.from_dict(llama), 8) == 2 * 8 * 128 * 32 * 2 / 8


def test_kimi_fits_with_a_larger_server_share_and_8k_tokens_per_step():
    assert (
        split_problems(RunConfig.from_dict(kimi(0.65, 8192)), TargetShape.from_dict(KIMI_TEXT), H200, KIMI_INT4_WEIGHTS)
        == []
    )


def test_a_server_share_below_the_weights_names_the_fraction_that_holds_them():
    [problem] = split_problems(
        RunConfig.from_dict(kimi(0.5, 8192)), TargetShape.from_dict(KIMI_TEXT), H200, KIMI_INT4_WEIGHTS
    )
    fraction = float(re.search(r"capture_memory_fraction 0.5 gives it 70 GiB; set it to ([0-9.]+)", problem)[1])
    assert (
        split_problems(
            RunConfig.from_dict(kimi(fraction, 8192)), TargetShape.from_dict(KIMI_TEXT), H200, KIMI_INT4_WEIGHTS
        )
        == []
    )


def test_the_shipped_32k_tokens_per_step_do_not_fit_beside_the_server_and_the_line_says_what_does():
    [problem] = split_problems(
        RunConfig.from_dict(kimi(0.65, 32768)), TargetShape.from_dict(KIMI_TEXT), H200, KIMI_INT4_WEIGHTS
    )
    assert "do not fit one 140 GiB GPU together" in problem and "\n" not in problem
    fix = re.search(
        r"lower training.total_seq_len to (\d+) and set hidden_states.capture_memory_fraction to ([0-9.]+)", problem
    )
    tokens, fraction = int(fix[1]), float(fix[2])
    assert 0 < tokens < 32768
    assert (
        split_problems(
            RunConfig.from_dict(kimi(fraction, tokens)), TargetShape.from_dict(KIMI_TEXT), H200, KIMI_INT4_WEIGHTS
        )
        == []
    )


def test_offline_runs_and_cpu_runs_are_not_checked():
    offline = kimi(0.1, 32768) | {
        "hidden_states": {"disk_budget": "all", "stored_dtype": "served", "capture_memory_fraction": 0.1}
    }
    assert check_capture_memory(RunConfig.from_dict(offline)) == []
    assert check_capture_memory(RunConfig.from_dict(kimi(0.1, 32768) | {"device": "cpu"})) == []
