"""How many hidden states go to disk, and which rows training captures on demand.

``hidden_states.disk_budget`` caps the bytes of hidden states a run stores. Rows are
stored in dataset order while they fit (``stored_rows``): the extraction stage covers
rows ``0..N-1`` and the training job asks a capture server for every later row when
the trainer reaches it (speculators' own online path), in every epoch. So:

- ``"all"`` (the default): every row stored, nothing captured (offline);
- ``0``: nothing stored, no extraction stage, every row captured in every epoch (online);
- anything between: the first rows that fit stored, the rest captured (budget).

A stored row costs its tokens x (stored layers x hidden size x 2 B of bf16 states, 4 B
where the target is served in fp32, + 8 B of token id) plus the safetensors header:
``StoredRowFormat.row_bytes``, within a few hundred bytes of the file vLLM writes. With
``hidden_states.stored_dtype: fp8`` a value takes 1 B and each token adds its 4 B float32
scale (hs_connectors' per-token fp8 format).

``StoredRowFormat`` is the one place that decides what a value is stored in: the budget,
the plan and the shard gate (``capture_server.SampleShape``) all read it, and it imports no
torch, so planning and budgeting stay light.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.records import CapturedRows
from draftsmith.target import TargetShape

ALL = "all"
# Bytes of a value in each dtype vLLM serves (and writes the hidden states in), by torch's name.
VALUE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's --dtype spellings
FP8_DTYPE = "float8_e4m3fn"  # hidden_states.stored_dtype: fp8
FP8_BYTES_PER_VALUE = 1
FP8_SCALE_BYTES = 4  # one float32 scale per token
TOKEN_ID_BYTES = 8  # int64 token ids beside the states
HEADER_BYTES = 256  # safetensors' JSON header of a two-tensor file, rounded up
FP8_HEADER_BYTES = 384  # ... and of the three-tensor fp8 file
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15}
UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50}
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


class DiskBudgetError(DraftsmithError):
    pass


def parse_budget(value: int | str) -> int | None:
    """Bytes, or None for "all". Accepts 0, 500000000000, "500 GB", "2TiB", "all"."""
    if isinstance(value, bool):
        raise DiskBudgetError(f'hidden_states.disk_budget {value!r} is not a size; use bytes, e.g. "500 GB", or all')
    if isinstance(value, int):
        if value < 0:
            raise DiskBudgetError(f"hidden_states.disk_budget {value} is negative; use 0 (fully online) or more")
        return value
    if value.strip().lower() == ALL:
        return None
    match = SIZE.match(value)
    unit = match.group(2).upper() if match else ""
    unit = unit if unit.endswith("B") or not unit else unit + "B"  # "500 G" is "500 GB"
    if not match or unit not in UNITS:
        raise DiskBudgetError(
            f'hidden_states.disk_budget {value!r} is not a size; write bytes with a unit, e.g. "500 GB" or '
            '"2 TiB", 0 for fully online, or "all"'
        )
    return int(float(match.group(1)) * UNITS[unit])


def served_dtype(checkpoint_dtype: str | None, requested: str | None) -> str:
    """The dtype vLLM serves the target in, and so writes its hidden states in: a ``--dtype``
    in ``server.extra_args`` (``requested``) wins; otherwise the checkpoint's, with float32
    served as bfloat16 like vLLM's own ``auto`` does."""
    if requested and requested != "auto":
        return DTYPE_ALIASES.get(requested, requested)
    if checkpoint_dtype in (None, "float32"):
        return "bfloat16"
    return checkpoint_dtype


@dataclass(frozen=True)
class StoredRowFormat:
    """What a stored (or captured) row holds per token: the states of ``num_layers`` layers of
    ``hidden_size`` values each, in the served dtype or in fp8 with a scale per token."""

    num_layers: int
    hidden_size: int
    value_dtype: str  # the served dtype, by torch's name ("bfloat16"): served_dtype
    fp8: bool = False

    def __post_init__(self) -> None:
        if self.value_dtype not in VALUE_BYTES:
            raise DiskBudgetError(
                f"the target would be served in {self.value_dtype}, which hidden states are not stored in; "
                f"serve it in one of {', '.join(VALUE_BYTES)} (--dtype in server.extra_args)"
            )

    @classmethod
    def of(cls, target: TargetShape, num_layers: int, requested_dtype: str | None, fp8: bool) -> StoredRowFormat:
        """The rows of ``target`` served as ``server.extra_args`` ask (``requested_dtype``)."""
        return cls(num_layers, target.hidden_size, served_dtype(target.dtype, requested_dtype), fp8)

    @property
    def stored_dtype(self) -> str:
        return FP8_DTYPE if self.fp8 else self.value_dtype

    @property
    def value_bytes(self) -> int:
        return FP8_BYTES_PER_VALUE if self.fp8 else VALUE_BYTES[self.value_dtype]

    @property
    def state_bytes_per_token(self) -> int:
        """The hidden states of one token as stored: its values, and with fp8 their scale."""
        scale = FP8_SCALE_BYTES if self.fp8 else 0
        return self.num_layers * self.hidden_size * self.value_bytes + scale

    def row_bytes(self, tokens: int) -> int:
        header = FP8_HEADER_BYTES if self.fp8 else HEADER_BYTES
        return tokens * (self.state_bytes_per_token + TOKEN_ID_BYTES) + header


def stored_rows(row_tokens: Sequence[int], budget: int | None, row: StoredRowFormat) -> int:
    """How many leading rows fit the budget (all of them for None)."""
    if budget is None:
        return len(row_tokens)
    used = 0
    for index, tokens in enumerate(row_tokens):
        used += row.row_bytes(tokens)
        if used > budget:
            return index
    return len(row_tokens)


def dataset_row_tokens(dataset: Path) -> list[int]:
    """Tokens per row of a prepared dataset (its ``input_ids`` lengths)."""
    import pyarrow.compute as pc
    from datasets import load_from_disk

    table = load_from_disk(str(dataset)).data.table
    return pc.list_value_length(table.column("input_ids")).to_pylist()


@dataclass(frozen=True)
class RowSplit:
    """Rows ``0..stored-1`` are on disk; ``stored..rows-1`` are captured on demand."""

    rows: int
    stored: int

    @property
    def captured(self) -> int:
        return self.rows - self.stored

    @property
    def mode(self) -> str:
        if self.captured == 0:
            return "offline"
        return "online" if self.stored == 0 else "budget"

    def describe(self) -> str:
        return f"{self.stored} of {self.rows} rows stored, {self.captured} captured on demand ({self.mode})"


def row_split(dataset: Path, budget: int | None, row: StoredRowFormat) -> RowSplit:
    tokens = dataset_row_tokens(dataset)
    stored = stored_rows(tokens, budget, row)
    captured = CapturedRows.read(dataset)
    if budget is not None and captured is not None:
        # One pass: the budget stores what generation captured (rows past it stay online),
        # so no stored row needs a server of its own.
        stored = min(stored, captured.captured)
    return RowSplit(len(tokens), stored)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
