"""Whether vLLM can serve an MLA target with an EAGLE-3 drafter on this device, and how.

DeepSeek-V3 and Kimi use multi-head latent attention (MLA). A Llama-style EAGLE-3 drafter
uses ordinary attention, and vLLM needs one KV-cache block size that both attention
backends accept. vLLM 0.32's CPU build has none in common (CPU_MLA: [16]; CPU_ATTN:
[MultipleOf(32)]) and refuses at engine start, after the whole model load. The same
target with MLA disabled (``VLLM_MLA_DISABLE=1``: vLLM runs the decompressed weights as
ordinary attention) serves with the drafter. So on a CPU the evaluation servers run that
way, and say so; where neither works, the preflight refuses before any work.

The answers come from the installed vLLM's own backends (their block and head sizes),
not from a list of versions: an upgrade that adds a common size turns this off by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from draftsmith.errors import DraftsmithError
from draftsmith.target import TargetShape

MLA_DISABLE_ENV = "VLLM_MLA_DISABLE"
# Third-party names this module uses; the preflight checks each exists (preflight.declared).
THIRD_PARTY = [("vllm.v1.attention.backends.registry", "AttentionBackendEnum")]
# (MLA backend, the drafter's backend) vLLM picks on each device. On CUDA the MLA backend
# depends on the GPU; FlashMLA (Hopper, the production case) is checked.
BACKENDS = {"cpu": ("CPU_MLA", "CPU_ATTN"), "cuda": ("FLASHMLA", "FLASH_ATTN")}


class ServingError(DraftsmithError):
    pass


@dataclass(frozen=True)
class EvaluationAttention:
    """How the evaluation servers run the target: ``mla_disabled`` and why."""

    mla_disabled: bool = False
    reason: str = ""

    def server_env(self) -> dict[str, str]:
        return {MLA_DISABLE_ENV: "1"} if self.mla_disabled else {}


def _accepts(constraints: list[Any], size: int) -> bool:
    return any(size == c if isinstance(c, int) else size % c.base == 0 for c in constraints)


def common_block_size(mla_backend, drafter_backend) -> int | None:
    """The largest block size the MLA backend offers that the drafter's backend accepts."""
    offered = sorted((s for s in mla_backend.get_supported_kernel_block_sizes() if isinstance(s, int)), reverse=True)
    accepted = drafter_backend.get_supported_kernel_block_sizes()
    return next((size for size in offered if _accepts(accepted, size)), None)


def _backends(device: str):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return tuple(AttentionBackendEnum[name].get_class() for name in BACKENDS[device])


def _describe(backend) -> str:
    return f"{backend.get_name()} {backend.get_supported_kernel_block_sizes()}"


def evaluation_attention(target: TargetShape, device: str) -> EvaluationAttention:
    """How to serve this target with an EAGLE-3 drafter on ``device``; a ServingError
    with the fix when the installed vLLM cannot."""
    if not target.mla:
        return EvaluationAttention()
    mla, attention = _backends(device)
    if common_block_size(mla, attention) is not None:
        return EvaluationAttention()
    conflict = f"vLLM's {_describe(mla)} and {_describe(attention)} share no KV block size"
    qk_head = target.mla_query_head
    if device == "cpu" and attention.supports_head_size(qk_head):
        return EvaluationAttention(
            True,
            f"{conflict}; the evaluation servers run the target with "
            f"{MLA_DISABLE_ENV}=1 (ordinary attention, same weights)",
        )
    if device == "cpu":
        fix = (
            f"with MLA disabled its attention head {qk_head} (qk_nope_head_dim + qk_rope_head_dim) "
            f"is not one {attention.get_name()} supports {attention.get_supported_head_sizes()}; "
            "use a target with a supported head size"
        )
    else:
        fix = "install the pinned vLLM (pip install -e '.[gpu]'), whose CUDA backends share one"
    raise ServingError(
        f"the evaluation cannot serve this MLA target with an EAGLE-3 drafter on {device}: {conflict}, and {fix}"
    )


def mla_latent_problem(target: TargetShape, device: str) -> str | None:
    """Every server stage needs the MLA backend to take the target's latent head
    (kv_lora_rank + qk_rope_head_dim); vLLM's CPU kernel compiles only DeepSeek's 576."""
    if not target.mla:
        return None
    mla, _ = _backends(device)
    latent = target.mla_latent
    if mla.supports_head_size(latent):
        return None
    return (
        f"vLLM's {mla.get_name()} serves latent heads {mla.get_supported_head_sizes()}, but this "
        f"target's kv_lora_rank + qk_rope_head_dim = {latent}; use such a target, or set "
        f"{MLA_DISABLE_ENV}: 1 in server.env"
    )
