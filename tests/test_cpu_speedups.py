"""cpu_speedups computes what speculators computes: the EAGLE-3 training attention over
packed documents (with padding, a sliding window and up to two TTT extensions) and the
eager KL loss, forward and backward, to float rounding."""

import itertools

import pytest
import torch

from draftsmith import cpu_speedups


def packed(lengths: list[int], pad: int, window: int | None, extensions: int) -> cpu_speedups.PackedMask:
    from speculators.models.eagle3.attention import create_combined_mask_mod

    seq = sum(lengths) + pad
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])
    mask = cpu_speedups.PackedMask.build(ids, seq, window, create_combined_mask_mod(ids, seq, sliding_window=window))
    for _ in range(extensions):
        mask = mask.extended()
    return mask


@pytest.mark.parametrize(
    ("lengths", "pad", "window", "extensions"),
    list(itertools.product([[20, 30], [7, 1, 40]], [0, 9], [None, 16], [0, 2])),
)
def test_packed_attention_is_sdpa_over_the_dense_mask(lengths, pad, window, extensions):
    generator = torch.Generator().manual_seed(0)
    mask = packed(lengths, pad, window, extensions)
    heads, kv_heads, dim = 6, 2, 16

    def tensor(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_()

    q = tensor(1, heads, mask.seq_len, dim)
    k, v = tensor(1, kv_heads, mask.kv_len, dim), tensor(1, kv_heads, mask.kv_len, dim)

    class Module:
        num_key_value_groups = heads // kv_heads

    ours, _ = cpu_speedups.packed_attention(Module, q, k, v, mask)
    expanded = [x.repeat_interleave(Module.num_key_value_groups, dim=1) for x in (k, v)]
    dense = torch.nn.functional.scaled_dot_product_attention(q, *expanded, attn_mask=mask.dense("cpu"))
    reference = dense.transpose(1, 2)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    grad = torch.randn(ours.shape, generator=generator)
    for a, b in zip(
        torch.autograd.grad(ours, (q, k, v), grad), torch.autograd.grad(reference, (q, k, v), grad), strict=True
    ):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_packed_mask_finds_the_documents():
    mask = packed([3, 5], 2, None, 0)
    assert mask.spans == ((0, 3), (3, 5)) and mask.kv_len == 10
    assert mask.extended().extended().kv_len == 30


@pytest.mark.parametrize("scale", [1.0, 20.0])
def test_kl_loss_is_speculators_eager_kl(scale):
    """Each TTT step passes a row slice of the same verifier logits (the cached softmax);
    an in-place change to them is seen."""
    from speculators.losses import eager

    generator = torch.Generator().manual_seed(0)
    targets = torch.randn(1, 40, 64, generator=generator) * scale
    for step in range(3):
        logits = (torch.randn(1, 40 - step, 64, generator=generator) * scale).requires_grad_()
        ours, theirs = cpu_speedups.kl_div_loss(logits, targets[:, step:]), eager.kl_div_loss(logits, targets[:, step:])
        torch.testing.assert_close(ours, theirs, atol=1e-4 * scale, rtol=1e-5)
        grad = torch.randn(ours.shape, generator=generator)
        (a,), (b,) = torch.autograd.grad(ours, logits, grad), torch.autograd.grad(theirs, logits, grad)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    targets.mul_(0.5)
    logits = torch.randn(1, 39, 64, generator=generator)
    torch.testing.assert_close(
        cpu_speedups.kl_div_loss(logits, targets[:, 1:]),
        eager.kl_div_loss(logits, targets[:, 1:]),
        atol=1e-4 * scale,
        rtol=1e-5,
    )


def test_other_masks_reach_transformers_sdpa(monkeypatch):
    """The wrapped sdpa leaves dense masks alone and expands a PackedMask it cannot take (bf16)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"])
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    cpu_speedups.wrap_sdpa()
    wrapped = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert wrapped is not original

    class Module(torch.nn.Module):
        num_key_value_groups = 1
        is_causal = True

    mask = packed([6, 4], 2, None, 1)
    q = torch.randn(1, 2, mask.seq_len, 8, dtype=torch.bfloat16)
    k = v = torch.randn(1, 2, mask.kv_len, 8, dtype=torch.bfloat16)
    ours, _ = wrapped(Module(), q, k, v, mask)
    theirs, _ = original(Module(), q, k, v, mask.dense("cpu"))
    torch.testing.assert_close(ours, theirs)
