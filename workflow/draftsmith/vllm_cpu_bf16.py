"""A vLLM plugin that computes bfloat16 linear layers in float32 on CPUs without bfloat16 units.

vLLM's CPU build serves a bfloat16 model's linear layers through oneDNN or its own packed
kernels where the CPU has bfloat16 instructions (AVX-512 BF16 or AMX). Elsewhere (AVX2 hosts:
"Failed to create oneDNN linear, fallback to torch linear" in the server log) it falls back
to torch's bfloat16 matmul, which converts every element on the fly: measured on a 2-core AVX2
host, 4-9x slower than the same matmul in float32 on the demo targets' shapes
(bench/cpu_bf16_linear.py).

``register`` keeps vLLM's choice on every other host and dtype. On a CPU without bfloat16
units, each 2-D bfloat16 weight is copied to float32 once, at load, and its layer computes
``linear(x.float(), weight32, bias32)`` rounded back to bfloat16. torch's bfloat16 matmul also
accumulates in float32 and rounds once, so the two differ by the order of the float32 sums
only: outputs agree to one bfloat16 rounding step. The float32 copy sits beside the bfloat16
weights (three times their memory in all), which only the small models served on a CPU can
afford and need.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# How vLLM finds this plugin (pyproject.toml's entry point); the preflight checks it.
PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "draftsmith_cpu_bf16"
PLUGIN_VALUE = f"{__name__}:register"
# Third-party names this module uses; the preflight checks each exists (preflight.declared).
THIRD_PARTY = [
    ("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm"),
    ("torch.cpu", "_is_avx512_bf16_supported"),
    ("torch.cpu", "_is_amx_tile_supported"),
]
UPCASTING = "this CPU has no bfloat16 units: computing bfloat16 linear layers in float32 (4-9x faster)"


def cpu_has_bf16_units() -> bool:
    """AVX-512 BF16 or AMX: where vLLM's own bfloat16 kernels apply."""
    import torch

    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def float32_linear(weight, bias):  # noqa: ANN001, ANN201 (torch tensors; torch is imported lazily)
    """A layer's linear in float32 from copies made once, rounded back to the input's dtype."""
    import torch

    weight32 = weight.detach().float()
    bias32 = None if bias is None else bias.detach().float()

    def linear(x, _weight, _bias):  # noqa: ANN001, ANN202 (vLLM's cpu_linear signature)
        return torch.nn.functional.linear(x.float(), weight32, bias32).to(x.dtype)

    return linear


def register() -> None:
    """vLLM's plugin hook: on a CPU without bfloat16 units, bfloat16 linears run in float32."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or cpu_has_bf16_units():
        return
    import torch
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "draftsmith_upcasts_bf16", False):  # vLLM may load plugins twice
        return

    def upcasting_dispatch(layer, remove_weight: bool) -> None:  # noqa: ANN001 (a torch module)
        weight = layer.weight
        dispatch(layer, remove_weight)
        if weight.is_meta or weight.ndim != 2 or weight.dtype != torch.bfloat16:
            return
        if not getattr(upcasting_dispatch, "said", False):
            log.warning("draftsmith: %s", UPCASTING)
            upcasting_dispatch.said = True  # type: ignore[attr-defined]
        layer.cpu_linear = float32_linear(weight, getattr(layer, "bias", None))

    upcasting_dispatch.draftsmith_upcasts_bf16 = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = upcasting_dispatch
