"""A vLLM plugin that makes the CPU build rotate DeepSeek/Kimi queries correctly.

vLLM's CPU ``rotary_embedding`` kernel reads a query laid out as ``[tokens, heads, dim]``
as if it were ``heads`` times as many tokens of one head each, so every head but the
first is rotated by another token's position. Llama-style models pass ``[tokens,
heads * dim]`` and are unaffected; DeepSeek-V3's attention (with or without MLA) passes
the three-dimensional slice ``q_pe`` and gets positions wrong everywhere but position 0.
Measured on the DeepSeek-V3 demo target: greedy continuations 0/10 equal to HF's before
this plugin, and hidden states off by 0.06-0.6 (relative) at every position after the
first.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (API
server, engine core, workers). ``register`` asks the installed kernel, on two tokens of
two heads, whether the flat and the three-dimensional layout agree; only if they do not
does it wrap ``RotaryEmbedding.forward_cpu`` to hand the kernel the flat layout it reads
correctly. A vLLM whose kernel is fixed is left untouched, and CUDA is never patched.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# How vLLM finds this plugin (pyproject.toml's entry point); the preflight checks it.
PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "draftsmith_cpu_rope"
PLUGIN_VALUE = f"{__name__}:register"
# Third-party names this module uses; the preflight checks each exists (preflight.declared).
THIRD_PARTY = [
    ("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding"),
    ("vllm._custom_ops", "rotary_embedding"),
]


def register() -> None:
    """vLLM's plugin hook: patch the CPU rotary embedding if, and only if, it is wrong."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not cpu_kernel_mishandles_heads():
        return
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if getattr(RotaryEmbedding.forward_cpu, "draftsmith_flattens_heads", False):
        return
    RotaryEmbedding.forward_cpu = flatten_heads(RotaryEmbedding.forward_cpu)  # type: ignore[method-assign]
    log.warning(
        "draftsmith: vLLM's CPU rotary kernel misreads [tokens, heads, dim] queries; "
        "passing it [tokens, heads * dim] instead (DeepSeek-V3/Kimi attention)"
    )


def cpu_kernel_mishandles_heads() -> bool:
    """Rotate two tokens of two heads in both layouts; a correct kernel agrees with itself."""
    import torch  # here, not at the top: the preflight reads this module's constants only
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    head_dim, tokens, heads = 4, 2, 2
    angles = torch.arange(4, dtype=torch.float32)[:, None] * torch.tensor([1.0, 0.5])
    cos_sin_cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    # A buggy kernel reads tokens * heads positions; the buffer holds that many so the
    # probe never reads past it, and the extra entries differ from the real ones.
    positions = torch.tensor([3, 2, 0, 0])[:tokens]
    query = torch.randn(tokens, heads, head_dim, generator=torch.Generator().manual_seed(0))
    key = torch.randn(tokens, 1, head_dim, generator=torch.Generator().manual_seed(1))
    flat_query, flat_key = query.reshape(tokens, -1).clone(), key.reshape(tokens, -1).clone()
    torch.ops._C.rotary_embedding(positions, query, key, head_dim, cos_sin_cache, False)
    torch.ops._C.rotary_embedding(positions, flat_query, flat_key, head_dim, cos_sin_cache, False)
    return not torch.allclose(query.reshape(tokens, -1), flat_query)


def flatten_heads(forward_cpu):
    """``forward_cpu`` that passes ``[tokens, heads * dim]`` views and keeps its in-place contract."""

    def forward(self, positions, query, key=None):
        flat_query = query.reshape(query.shape[0], -1)
        flat_key = None if key is None else key.reshape(key.shape[0], -1)
        forward_cpu(self, positions, flat_query, flat_key)
        # reshape copies a strided slice such as DeepSeek's q_pe: write the result back.
        if flat_query.data_ptr() != query.data_ptr():
            query.copy_(flat_query.view(query.shape))
        if flat_key is not None and flat_key.data_ptr() != key.data_ptr():
            key.copy_(flat_key.view(key.shape))
        return query, key

    forward.draftsmith_flattens_heads = True  # type: ignore[attr-defined]  # how register() knows it
    return forward
