"""cpu_speedups computes what speculators computes: the EAGLE-3 training attention over
packed documents (with padding, a sliding window and up to two TTT extensions) and the
eager KL loss, forward and backward, to float rounding."""

import itertools
from pathlib import Path

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


def tiny_drafter(verifier: Path):
    """speculators' one-layer EAGLE-3 drafter over a random 4-layer Llama, draft vocabulary
    48 of 96 (its head is the verifier's, frozen)."""
    from speculators.models.eagle3.core import Eagle3DraftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(verifier)
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[::2] = True
    d2t = torch.arange(0, 96, 2) - torch.arange(48)
    return Eagle3DraftModel.from_training_args(
        config, t2d, d2t, verifier_name_or_path=str(verifier), draft_vocab_size=48, norm_before_residual=True,
        num_layers=1, ttt_steps=3, target_layer_ids=[0, 1, 2], draft_attn_impl="sdpa",
    )  # fmt: skip


def test_heads_computed_only_where_read_give_the_same_loss_metrics_and_gradients(tmp_path, monkeypatch):
    """Two documents (prompt then answer) and padding: the answers' ends and the prompt
    positions before them are where a step's pairs cross the mask's edges."""
    from speculators.losses import eager
    from speculators.models.eagle3 import core

    monkeypatch.setattr(core.Eagle3DraftModel, "forward", core.Eagle3DraftModel.forward)
    model = tiny_drafter(tmp_path / "verifier")
    generator = torch.Generator().manual_seed(1)
    seq = 60
    document_ids = torch.tensor([0] * 25 + [1] * 30 + [-1] * 5).unsqueeze(0)
    loss_mask = torch.zeros(1, seq, dtype=torch.long)
    loss_mask[0, 10:25] = loss_mask[0, 40:55] = 1
    batch = {
        "hidden_states": torch.randn(1, seq, 3 * 32, generator=generator),
        "input_ids": torch.randint(0, 96, (1, seq), generator=generator),
        "document_ids": document_ids,
        "loss_mask": loss_mask,
        "position_ids": torch.cat([torch.arange(25), torch.arange(30), torch.arange(5)]).unsqueeze(0),
        "verifier_last_hidden_states": torch.randn(1, seq, 32, generator=generator),
        "loss_config": {"kl_div": (eager.kl_div_loss, 1.0)},
    }

    def step():
        model.zero_grad()
        _, loss, metrics = model(**batch)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), {k: v.detach() for k, v in metrics.items()}, grads

    loss, metrics, grads = step()
    cpu_speedups.install_masked_heads()
    rows = []
    original = cpu_speedups.HeadRows.drafter
    monkeypatch.setattr(cpu_speedups.HeadRows, "drafter", lambda self: rows.append(original(self)) or rows[-1])
    ours, our_metrics, our_grads = step()
    assert [len(r) for r in rows] == [30, 32, 34]  # not the 60 positions of the row
    torch.testing.assert_close(ours, loss, atol=1e-6, rtol=1e-5)
    assert our_metrics.keys() == metrics.keys()
    for key in metrics:
        torch.testing.assert_close(our_metrics[key], metrics[key], atol=1e-6, rtol=1e-5, msg=key)
    assert our_grads.keys() == grads.keys() and "norm.weight" in grads  # the head's input
    for name in grads:
        torch.testing.assert_close(our_grads[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_the_rows_computed_are_every_pair_speculators_aligns_for_the_loss_or_the_metrics():
    """The positions that speculators' own align_for_step pairs at each TTT step, where the
    loss mask (the loss, the full accuracy) or the initial prev_correct (the conditional
    accuracy) is set: the drafter's logits at i and the verifier's at i + step."""
    from speculators.models.eagle3.metrics import align_for_step

    seq, steps = 40, 3
    mask = torch.zeros(1, seq, dtype=torch.bool)
    mask[0, 3:12] = mask[0, 20:24] = mask[0, 37:] = True
    positions = torch.arange(seq, dtype=torch.float).reshape(1, seq, 1)
    rows = cpu_speedups.HeadRows(mask[0], steps)
    verifier_read: set[int] = set()
    assert set(rows.verifier().tolist()) >= set(mask[0].nonzero().squeeze(1).tolist())
    verifier = set(rows.verifier().tolist())
    for step in range(steps):
        logits, targets, loss_mask, prev_correct = align_for_step(positions, positions, mask, mask.clone(), step)
        read = (loss_mask | prev_correct)[0]
        verifier_read |= set(targets[0, read, 0].long().tolist())
        assert set(rows.drafter().tolist()) == set(logits[0, read, 0].long().tolist()), step
    assert verifier == verifier_read


def test_a_forward_without_the_arguments_read_keeps_its_heads_whole(monkeypatch):
    """A speculators whose forward no longer takes a loss mask is left as it is."""
    from speculators.models.eagle3 import core

    def forward(self, hidden_states, input_ids, document_ids, mask=None, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setattr(core.Eagle3DraftModel, "forward", forward)
    cpu_speedups.install_masked_heads()
    assert core.Eagle3DraftModel.forward is forward
