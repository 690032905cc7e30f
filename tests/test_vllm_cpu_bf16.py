"""The vLLM plugin that computes bfloat16 linear layers in float32 on CPUs without bfloat16
units (draftsmith.vllm_cpu_bf16), on vLLM's own dispatch. A real server with it is
test_server.py's first test; its speed is bench/cpu_bf16_linear.py's."""

from importlib.metadata import entry_points

import pytest
import torch

from draftsmith import vllm_cpu_bf16


def test_vllm_finds_the_plugin_through_the_installed_entry_point():
    plugins = {entry.name: entry.value for entry in entry_points(group="vllm.general_plugins")}
    assert plugins.get("draftsmith_cpu_bf16") == "draftsmith.vllm_cpu_bf16:register"


def test_the_float32_linear_is_torchs_bfloat16_linear_to_one_rounding_step():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(576, 256, generator=generator).to(torch.bfloat16)
    bias = torch.randn(576, generator=generator).to(torch.bfloat16)
    x = torch.randn(8, 256, generator=generator).to(torch.bfloat16)
    ours = vllm_cpu_bf16.float32_linear(weight, bias)(x, weight, bias)
    torchs = torch.nn.functional.linear(x, weight, bias)
    assert ours.dtype == torch.bfloat16 and ours.shape == torchs.shape
    # One bfloat16 step (8 bits of mantissa) of the larger magnitude, at most.
    step = torchs.abs().float().clamp(min=1e-3) * 2**-7
    assert ((ours.float() - torchs.float()).abs() <= step).all()
    assert (ours == torchs).float().mean() > 0.9  # mostly bit-identical


class Linear(torch.nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 32).to(dtype), requires_grad=False)
        self.bias = None


@pytest.mark.skipif(vllm_cpu_bf16.cpu_has_bf16_units(), reason="this CPU has bfloat16 units: vLLM's kernels stay")
def test_on_this_cpu_only_bfloat16_weights_are_computed_in_float32():
    vllm_cpu_bf16.register()
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    assert getattr(dispatch, "draftsmith_upcasts_bf16", False)
    vllm_cpu_bf16.register()
    assert utils.dispatch_cpu_unquantized_gemm is dispatch  # patched once
    bf16, fp32 = Linear(torch.bfloat16), Linear(torch.float32)
    dispatch(bf16, remove_weight=True)
    dispatch(fp32, remove_weight=True)
    assert bf16.cpu_linear.__qualname__.startswith("float32_linear")
    assert not fp32.cpu_linear.__qualname__.startswith("float32_linear")
    x = torch.randn(4, 32).to(torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), bf16.weight.float()).to(torch.bfloat16)
    assert torch.equal(bf16.cpu_linear(x, bf16.weight, None), expected)
