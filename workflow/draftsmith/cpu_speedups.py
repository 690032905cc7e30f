"""The EAGLE-3 trainer's attention and loss, computed without the wasted work, on CPU only.

speculators 0.9.0 trains a drafter on a packed row of ``total_seq_len`` tokens (several
documents, then padding) unrolled over ``ttt_steps`` test-time-training steps. With
``--draft-attn-impl sdpa`` (the CPU flag: flex attention needs a compiler) it builds a dense
boolean mask over the whole row (document-causal, within the sliding window) and, at each
TTT step, appends a diagonal block for the keys of the previous steps; SDPA then runs over
``total_seq_len x (step + 1) * total_seq_len`` scores, almost all of them masked: at 4,096
tokens and the SmolLM2-135M width the attention was half of a training step
(bench/train_cpu_width.py). Nothing else is exact-equivalent and cheaper in speculators.

Here, on CPU:
- ``PackedMask`` stands for that mask: the documents' spans (from the document ids the
  trainer passes), the sliding window and the number of TTT steps it was extended by, so
  no dense mask is built (``Eagle3DraftModel._build_attn_mask`` and
  ``extend_dense_mask_for_draft_tokens`` in speculators' eagle3 core are wrapped);
- the ``sdpa`` attention function, given a ``PackedMask``, computes the same attention as
  one softmax per query over its allowed keys, in pieces: each document's causal attention
  with torch's CPU flash kernel (which skips the blocks above the diagonal), then the
  query's own keys of the previous TTT steps (the diagonal), merged by log-sum-exp; its
  backward is the flash kernel's backward given the merged output and log-sum-exp, which
  is the exact gradient of the merged softmax. Any other mask, dtype or option goes to
  transformers' own sdpa with the dense mask the ``PackedMask`` expands to;
- the eager KL loss (``--loss-implementation eager``) is computed as
  ``sum(p log p) - sum(p log q)`` with fused log-softmaxes and row dot products, the same
  quantity as ``kl_div(log_softmax(z), softmax(t))`` without its per-entry ``xlogy``;
  ``p = softmax(t)`` and ``sum(p log p)`` are computed once per forward instead of once per
  TTT step (each step gets a slice of the same verifier logits), and the gradient
  ``softmax(z) - p`` is written out.
- the drafter's head and the verifier's head (``lm_head``, ``verifier_lm_head``: a matmul
  into the draft vocabulary at every position, about half of a step's arithmetic at
  SmolLM2's width) are computed only at the positions whose logits the loss or the accuracy
  metrics read (``HeadRows``); the others hold zeros, which no loss term, gradient or metric
  reads. A row of chat is mostly prompt: answers are 30-70% of its tokens;
- optionally (off: within noise in the trainer, and the resident size stays at its peak),
  glibc keeps freed memory for reuse (``keep_freed_memory``) instead of unmapping every
  tensor above 32 MiB, which page-faulted each step's logits in anew.
All of it is the same mathematics as speculators' code, in fp32; results differ by
rounding only (checked in tests/test_cpu_speedups.py; bench/train_cpu_width.py's per-step
losses agree to 1e-4).
"""

from __future__ import annotations

import dataclasses
import typing
import weakref

import torch

# Third-party names this module uses or replaces; the preflight checks each exists (preflight.declared).
THIRD_PARTY = [
    ("speculators.models.eagle3.core", "Eagle3DraftModel._build_attn_mask"),
    ("speculators.models.eagle3.core", "extend_dense_mask_for_draft_tokens"),
    ("speculators.models.eagle3.core", "create_combined_mask_mod"),
    ("speculators.models.eagle3.attention", "extend_dense_mask_for_draft_tokens"),
    ("speculators.losses.eager", "kl_div_loss"),
    ("torch.nn.attention.flex_attention", "create_mask"),
    ("speculators.losses.utils", "_EAGER_LOSS_FN_MAP"),
    ("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS"),
    ("speculators.model", "DraftVocabMixin.lm_head"),
    ("speculators.model", "DraftVocabMixin.verifier_lm_head"),
    ("speculators.models.eagle3.metrics", "align_for_step"),
]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclasses.dataclass(frozen=True)
class PackedMask:
    """speculators' EAGLE-3 training mask, not materialized: query i (of ``seq_len``) sees
    the keys j <= i of its own document (and j > i - ``sliding_window`` when set) among the
    first ``seq_len`` keys, and key i of each of the ``extensions`` later blocks of
    ``seq_len`` keys; a padding query (document id -1) sees only key i of every block."""

    document_ids: torch.Tensor  # [seq_len], -1 for padding
    spans: tuple[tuple[int, int], ...]  # (start, length) of each document, in order
    seq_len: int
    sliding_window: int | None
    extensions: int = 0
    mask_mod: object = None  # speculators' own, for the dense fallback

    @classmethod
    def build(cls, document_ids: torch.Tensor, seq_len: int, sliding_window: int | None, mask_mod) -> PackedMask:
        ids = document_ids.reshape(-1).cpu()
        spans = []
        if ids.numel():
            change = torch.nonzero(ids[1:] != ids[:-1]).reshape(-1) + 1
            starts = [0, *change.tolist()]
            ends = [*change.tolist(), ids.numel()]
            spans = [(s, e - s) for s, e in zip(starts, ends, strict=True) if ids[s] != -1]
        return cls(ids, tuple(spans), seq_len, sliding_window, 0, mask_mod)

    def extended(self) -> PackedMask:
        return dataclasses.replace(self, extensions=self.extensions + 1)

    @property
    def kv_len(self) -> int:
        return self.seq_len * (self.extensions + 1)

    def dense(self, device) -> torch.Tensor:
        """The mask speculators would have built (``create_mask`` then the extensions)."""
        from speculators.models.eagle3.attention import extend_dense_mask_for_draft_tokens
        from torch.nn.attention.flex_attention import create_mask

        mask = create_mask(self.mask_mod, None, None, self.seq_len, self.seq_len, device=device)
        for _ in range(self.extensions):
            mask = extend_dense_mask_for_draft_tokens(mask, self.seq_len)
        return mask


def _window_mask(length: int, window: int, dtype) -> torch.Tensor:
    """Additive [1, 1, length, length] mask: causal, and within the sliding window."""
    i = torch.arange(length)
    allowed = (i[:, None] >= i[None, :]) & (i[None, :] > i[:, None] - window)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))[None, None]


def _doc_attention(q, k, v, length, window, scale):
    """Flash attention of one document's queries over its keys: (output, log-sum-exp)."""
    if window is None or length <= window:
        return _flash(q, k, v, 0.0, True, scale=scale)
    return _flash(q, k, v, 0.0, False, attn_mask=_window_mask(length, window, q.dtype), scale=scale)


def _doc_attention_backward(dout, q, k, v, out, lse, length, window, scale):
    if window is None or length <= window:
        return _flash_backward(dout, q, k, v, out, lse, 0.0, True, scale=scale)
    return _flash_backward(
        dout, q, k, v, out, lse, 0.0, False, attn_mask=_window_mask(length, window, q.dtype), scale=scale
    )


class PackedAttention(torch.autograd.Function):
    """Attention of q [1, H, S, D] over k, v [1, H, (n + 1) S, D] under a PackedMask
    with n extensions. Returns [1, H, S, D]."""

    @staticmethod
    def forward(ctx, q, k, v, mask: PackedMask, scale: float):
        seq = mask.seq_len
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32)
        covered = torch.zeros(seq, dtype=torch.bool)
        for start, length in mask.spans:
            sl = slice(start, start + length)
            part, part_lse = _doc_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], length, mask.sliding_window, scale)
            out[:, :, sl] = part
            lse[:, :, sl] = part_lse
            covered[sl] = True
        # Padding queries (and nothing else) see only their own key of every block, block 0 included.
        blocks = [(0, ~covered)] if not bool(covered.all()) else []
        blocks += [(b, None) for b in range(1, mask.extensions + 1)]
        for block, rows in blocks:
            kb = k[:, :, block * seq : (block + 1) * seq]
            vb = v[:, :, block * seq : (block + 1) * seq]
            score = (q * kb).sum(-1, dtype=torch.float32) * scale  # [1, H, S]
            if rows is not None:
                score = score.masked_fill(~rows, float("-inf"))
            merged = torch.logaddexp(lse, score)
            merged_safe = merged.masked_fill(merged == float("-inf"), 0.0)
            keep = torch.exp(lse - merged_safe).unsqueeze(-1)
            add = torch.exp(score - merged_safe).unsqueeze(-1)
            out = (out * keep + vb * add).to(q.dtype)
            lse = merged
        ctx.save_for_backward(q, k, v, out, lse, covered)
        ctx.mask, ctx.scale = mask, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, covered = ctx.saved_tensors
        mask, scale = ctx.mask, ctx.scale
        seq = mask.seq_len
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        # The merged log-sum-exp and output make the flash backward compute each key's share
        # of the one softmax: P = exp(s - lse), dS = P * (dO . v - dO . O).
        for start, length in mask.spans:
            sl = slice(start, start + length)
            gq, gk, gv = _doc_attention_backward(
                dout[:, :, sl],
                q[:, :, sl],
                k[:, :, sl],
                v[:, :, sl],
                out[:, :, sl],
                lse[:, :, sl],
                length,
                mask.sliding_window,
                scale,
            )
            dq[:, :, sl] += gq
            dk[:, :, sl] += gk
            dv[:, :, sl] += gv
        delta = (dout * out).sum(-1, dtype=torch.float32)  # [1, H, S]
        blocks = [(0, ~covered)] if not bool(covered.all()) else []
        blocks += [(b, None) for b in range(1, mask.extensions + 1)]
        for block, rows in blocks:
            sl = slice(block * seq, (block + 1) * seq)
            kb, vb = k[:, :, sl], v[:, :, sl]
            score = (q * kb).sum(-1, dtype=torch.float32) * scale
            prob = torch.exp(score - lse)
            if rows is not None:
                prob = prob.masked_fill(~rows, 0.0)
            dscore = prob * ((dout * vb).sum(-1, dtype=torch.float32) - delta)
            dq += (dscore * scale).unsqueeze(-1).to(q.dtype) * kb
            dk[:, :, sl] += (dscore * scale).unsqueeze(-1).to(q.dtype) * q
            dv[:, :, sl] += prob.unsqueeze(-1).to(q.dtype) * dout
        return dq, dk, dv, None, None


def packed_attention(module, query, key, value, mask: PackedMask, scaling=None):
    """transformers' attention interface: [1, H, S, D] inputs -> ([1, S, H, D], None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = PackedAttention.apply(query, key, value, mask, scale)
    return out.transpose(1, 2).contiguous(), None


def usable(query, key, mask, kwargs) -> bool:
    """The packed path handles what the EAGLE-3 trainer passes; anything else goes dense."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and key.dtype == torch.float32
        and query.shape[0] == 1
        and query.shape[2] == mask.seq_len
        and key.shape[2] == mask.kv_len
        and not kwargs.get("output_attentions", False)
        and not kwargs.get("dropout", 0.0)
    )


def wrap_sdpa():
    """transformers' sdpa, which computes a PackedMask's attention in pieces."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(sdpa, "draftsmith_packed", False):
        return

    def sdpa_packed(module, query, key, value, attention_mask, *args, **kwargs):
        if isinstance(attention_mask, PackedMask):
            if usable(query, key, attention_mask, kwargs) and not args:
                return packed_attention(module, query, key, value, attention_mask, kwargs.get("scaling"))
            attention_mask = attention_mask.dense(query.device)
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)

    sdpa_packed.draftsmith_packed = True  # type: ignore[attr-defined]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_packed


def install_packed_masks():
    """The EAGLE-3 drafter builds a PackedMask instead of a dense one when it uses sdpa."""
    from speculators.models.eagle3 import core

    model = core.Eagle3DraftModel
    if getattr(model._build_attn_mask, "draftsmith_packed", False):
        return
    build = model._build_attn_mask
    extend = core.extend_dense_mask_for_draft_tokens

    def build_attn_mask(self, doc_ids_1d, seq_len, device, sliding_window=None):
        if self._attn_impl != "sdpa" or torch.device(device).type != "cpu":
            return build(self, doc_ids_1d, seq_len, device, sliding_window)
        mask_mod = core.create_combined_mask_mod(doc_ids_1d, seq_len, sliding_window=sliding_window)
        return PackedMask.build(doc_ids_1d, seq_len, sliding_window, mask_mod)

    def extend_mask(mask, total_seq_len):
        if isinstance(mask, PackedMask):
            return mask.extended()
        return extend(mask, total_seq_len)

    build_attn_mask.draftsmith_packed = True  # type: ignore[attr-defined]
    model._build_attn_mask = build_attn_mask
    core.extend_dense_mask_for_draft_tokens = extend_mask


class _TargetCache:
    """softmax(t) and sum(p * log p) per position for the verifier's logits ``t``, computed
    once per forward: speculators passes each TTT step a slice ``t[:, step:]`` of the same
    tensor. Keyed by that tensor (weakly) and its version counter."""

    def __init__(self) -> None:
        self.base: weakref.ref[torch.Tensor] | None = None  # the verifier logits
        self.version = -1
        self.p = self.negentropy = torch.empty(0)

    def stats(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(p, sum(p log p)) for ``targets`` [1, S, V], from the cache when it is a run of
        rows of the tensor it was last computed for."""
        base = typing.cast(torch.Tensor, targets if targets._base is None else targets._base)
        vocab = targets.shape[-1]
        rows = (
            targets.dim() == 3
            and targets.shape[0] == 1
            and targets.stride(-1) == 1
            and targets.stride(1) == vocab
            and base.is_contiguous()
            and base.numel() % vocab == 0
            and (targets.storage_offset() - base.storage_offset()) % vocab == 0
        )
        if not rows:
            return self.compute(targets)
        version = base._version  # type: ignore[union-attr]  # torch's stubs: Any | None
        if self.base is None or self.base() is not base or self.version != version:
            self.p, self.negentropy = self.compute(base.reshape(1, -1, vocab))
            self.base, self.version = weakref.ref(base), version
        start = (targets.storage_offset() - base.storage_offset()) // vocab
        end = start + targets.shape[1]
        return self.p[:, start:end], self.negentropy[:, start:end]

    @staticmethod
    def compute(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_p = torch.log_softmax(targets, dim=-1, dtype=torch.float32)
        p = torch.exp(log_p)
        return p, torch.einsum("bsv,bsv->bs", p, log_p)


_targets = _TargetCache()


class KlDiv(torch.autograd.Function):
    """Per-position KL(softmax(t) || softmax(z)) over the last dimension, in fp32:
    sum(p log p) - sum(p log q), its gradient in z ``(softmax(z) - p) * grad``."""

    @staticmethod
    def forward(ctx, logits, targets):
        p, negentropy = _targets.stats(targets)
        log_q = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        kl = negentropy - torch.einsum("bsv,bsv->bs", p, log_q)
        ctx.save_for_backward(log_q, p)
        ctx.logits_dtype = logits.dtype
        return kl

    @staticmethod
    def backward(ctx, grad):
        log_q, p = ctx.saved_tensors
        grad_z = torch.exp(log_q).sub_(p).mul_(grad.unsqueeze(-1))
        return grad_z.to(ctx.logits_dtype), None


def kl_div_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """speculators.losses.eager.kl_div_loss, without a logarithm per entry: [1, seq_len]."""
    if targets.requires_grad:  # speculators computes them without gradient; keep its loss then
        from speculators.losses import eager

        return eager.kl_div_loss(logits, targets)
    return KlDiv.apply(logits, targets)


def install_kl_loss():
    from speculators.losses import utils

    utils._EAGER_LOSS_FN_MAP["kl_div"] = kl_div_loss


@dataclasses.dataclass
class HeadRows:
    """The positions whose head outputs one EAGLE-3 forward reads, from its loss mask.

    In speculators' eagle3 ``forward`` and ``align_for_step``, TTT step ``s`` compares the
    drafter's logits at position ``i`` with the verifier's at ``i + s``; the loss reads the
    pairs with ``loss_mask[i + s]``, and the accuracy metrics also those with
    ``loss_mask[i]`` (``prev_correct`` starts as the mask and is ANDed with every step's
    correctness). So step ``s`` needs the drafter's head at ``i < seq_len - s`` where either
    is set, and the verifier's head at ``j`` where ``loss_mask[j - s]`` is set for some step
    (``s = 0`` included). The heads are called in that order: the verifier's once, then the
    drafter's once per step."""

    loss_mask: torch.Tensor  # [seq_len] bool
    ttt_steps: int
    step: int = 0

    def _shifted(self, s: int) -> torch.Tensor:
        """loss_mask[i + s] at position i (False past the end)."""
        return torch.cat([self.loss_mask[s:], self.loss_mask.new_zeros(s)])

    def verifier(self) -> torch.Tensor:
        needed = self.loss_mask.clone()
        for s in range(1, self.ttt_steps):
            needed[s:] |= self.loss_mask[:-s]
        return needed.nonzero().squeeze(1)

    def drafter(self) -> torch.Tensor:
        needed = self.loss_mask | self._shifted(self.step)
        needed[len(needed) - self.step :] = False  # no verifier position to compare with
        self.step += 1
        return needed.nonzero().squeeze(1)


_head_rows: HeadRows | None = None


def _rows_head(head: str):
    """A ``Linear.forward`` that computes [1, seq_len, out] only at the rows the forward
    under way reads; everywhere else (and outside such a forward) it is the plain one."""

    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = _head_rows
        if rows is None or x.dim() != 3 or x.shape[0] != 1 or x.shape[1] != rows.loss_mask.shape[0]:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        index = getattr(rows, head)()
        computed = torch.nn.functional.linear(x[:, index], self.weight, self.bias)
        return computed.new_zeros(1, x.shape[1], computed.shape[-1]).index_copy(1, index, computed)

    return forward


# The arguments of speculators' Eagle3DraftModel.forward that HeadRows is built from.
READ_ARGUMENTS = {"hidden_states", "loss_mask", "verifier_last_hidden_states", "ttt_steps"}
_drafter_head = _rows_head("drafter")
_verifier_head = _rows_head("verifier")


def install_masked_heads():
    """The EAGLE-3 drafter computes its two heads only where they are read (HeadRows)."""
    import inspect
    import types

    from speculators.models.eagle3 import core

    model = core.Eagle3DraftModel
    if getattr(model.forward, "draftsmith_heads", False):
        return
    forward = model.forward
    signature = inspect.signature(forward)
    if not READ_ARGUMENTS <= signature.parameters.keys():
        return  # a speculators whose forward reads other arguments: its heads stay whole

    def forward_reading_rows(self, *args, **kwargs):
        global _head_rows
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        mask = bound.arguments["loss_mask"]
        on_cpu = bound.arguments["hidden_states"].device.type == "cpu"
        if mask is None or mask.shape[0] != 1 or not on_cpu or bound.arguments["verifier_last_hidden_states"] is None:
            return forward(self, *args, **kwargs)
        self.lm_head.forward = types.MethodType(_drafter_head, self.lm_head)
        self.verifier_lm_head.forward = types.MethodType(_verifier_head, self.verifier_lm_head)
        _head_rows = HeadRows(mask[0].to(torch.bool), int(bound.arguments["ttt_steps"]))
        try:
            return forward(self, *args, **kwargs)
        finally:
            _head_rows = None

    forward_reading_rows.draftsmith_heads = True  # type: ignore[attr-defined]
    model.forward = forward_reading_rows


# glibc's mallopt parameters. By default glibc serves every allocation above 32 MiB with a
# fresh mmap and unmaps it when freed, so each step's large tensors (a [4096, 8192] fp32 of
# logits is 128 MiB) are page-faulted in anew: 2.5 M minor faults and 4 s of system time in
# 8 KL passes at that size, against 0.85 M and 1.6 s with these (bench/train_cpu_width.py).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 1 << 30  # tensors up to 1 GiB come from (and return to) the heap
TRIM_THRESHOLD = (1 << 31) - 1  # and the heap's free top is kept for the next step


def keep_freed_memory() -> bool:
    """Large tensors reuse the process's freed memory instead of new pages; the resident
    size then stays at its peak between steps. False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def install(attention: bool = True, kl_loss: bool = True, heads: bool = True, memory: bool = False) -> None:
    if heads:
        install_masked_heads()
    if attention:
        install_packed_masks()
        wrap_sdpa()
    if kl_loss:
        install_kl_loss()
    if memory:
        keep_freed_memory()
