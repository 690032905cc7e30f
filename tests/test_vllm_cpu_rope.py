"""The vLLM plugin that corrects the CPU build's rotary embedding for DeepSeek/Kimi attention.

End to end, tests/test_extract.py's DeepSeek parity shows the effect on served hidden
states (and fails without the plugin); these tests pin the mechanism in seconds."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch

from draftsmith import vllm_cpu_rope

pytestmark = pytest.mark.vllm
T, HEADS = 12, 4


@pytest.fixture
def deepseek_rope():
    """The rotary embedding DeepSeek-V3 builds: 64 rope dims, GPT-J (interleaved) style."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        vllm_cpu_rope.register()
        yield get_rope(
            64,
            max_position=512,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            is_neox_style=False,
            dtype=torch.float32,
        )


def test_vllm_finds_the_plugin_through_the_installed_entry_point():
    plugins = {entry.name: entry.value for entry in entry_points(group="vllm.general_plugins")}
    assert plugins.get("draftsmith_cpu_rope") == "draftsmith.vllm_cpu_rope:register"


def test_deepseek_query_slices_rotate_by_their_own_positions(deepseek_rope):
    """The slices DeepSeek passes: q_pe of [tokens, heads, 128] and k_pe of the latent
    [tokens, 1, 576], both strided views, rotated in place like the kernel does."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(T, HEADS, 128, generator=generator)
    latent = torch.randn(T, 1, 576, generator=generator)
    positions = torch.arange(T)
    want_q, want_k = deepseek_rope.forward_native(positions, query[..., 64:].clone(), latent[..., 512:].clone())
    got_q, got_k = deepseek_rope.forward_cpu(positions, query[..., 64:], latent[..., 512:])
    torch.testing.assert_close(query[..., 64:], want_q)  # in place, as vLLM's callers rely on
    torch.testing.assert_close(latent[..., 512:], want_k)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)


def test_registering_twice_wraps_once(deepseek_rope):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    before = RotaryEmbedding.forward_cpu
    vllm_cpu_rope.register()
    assert RotaryEmbedding.forward_cpu is before
    # On this CPU build the kernel is wrong, so the wrapper must be in place.
    assert vllm_cpu_rope.cpu_kernel_mishandles_heads() == getattr(before, "draftsmith_flattens_heads", False)
