"""The disk budget's arithmetic: which rows are stored, which are captured while training."""

import pytest

from draftsmith.disk_budget import (
    DiskBudgetError,
    RowSplit,
    StoredRowFormat,
    parse_budget,
    served_dtype,
    stored_rows,
)
from draftsmith.target import TargetShape

KIMI = StoredRowFormat(4, 7168, "bfloat16")  # 4 stored layers of Kimi's width, served in bf16
KIMI_FP8 = StoredRowFormat(4, 7168, "bfloat16", fp8=True)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("all", None),
        (" All ", None),
        (0, 0),
        ("0", 0),
        (1234, 1234),
        ("500 GB", 500 * 10**9),
        ("2TiB", 2 * 2**40),
        ("1.5 tb", 1_500_000_000_000),
        ("5 G", 5 * 10**9),
        ("3Gi", 3 * 2**30),
    ],
)
def test_budgets_in_bytes_or_units(value, expected):
    assert parse_budget(value) == expected


@pytest.mark.parametrize("value", ["lots", "5 GX", -1, True])
def test_a_budget_that_is_not_a_size_is_one_line_naming_the_key(value):
    with pytest.raises(DiskBudgetError, match=r"hidden_states.disk_budget .* (not a size|negative)") as error:
        parse_budget(value)
    assert "\n" not in str(error.value)


def test_a_row_costs_its_states_its_token_ids_and_a_header():
    # Kimi: 4 layers x 7168 x 2 B = 56 KiB of states per token.
    assert KIMI.row_bytes(1) - KIMI.row_bytes(0) == 56 * 1024 + 8


def test_an_fp8_row_costs_a_byte_per_value_and_a_scale_per_token():
    assert KIMI_FP8.row_bytes(1) - KIMI_FP8.row_bytes(0) == 28 * 1024 + 4 + 8
    assert (KIMI_FP8.value_bytes, KIMI_FP8.stored_dtype) == (1, "float8_e4m3fn")
    tokens = [500] * 100
    budget = sum(KIMI.row_bytes(t) for t in tokens[:40])
    assert stored_rows(tokens, budget, KIMI) == 40
    assert stored_rows(tokens, budget, KIMI_FP8) == 79  # about twice the rows
    assert stored_rows(tokens, budget, StoredRowFormat(4, 7168, "float32")) == 20  # served in fp32: half


def test_leading_rows_are_stored_while_they_fit():
    tokens = [10, 20, 30, 40]
    row = StoredRowFormat(4, 16, "bfloat16")
    each = [row.row_bytes(t) for t in tokens]
    assert stored_rows(tokens, None, row) == 4
    assert stored_rows(tokens, 0, row) == 0
    assert stored_rows(tokens, each[0] - 1, row) == 0
    assert stored_rows(tokens, each[0] + each[1], row) == 2
    assert stored_rows(tokens, sum(each) - 1, row) == 3
    assert stored_rows(tokens, 10**12, row) == 4


def test_values_are_stored_in_the_served_dtype():
    assert served_dtype("bfloat16", None) == "bfloat16"
    assert served_dtype("float32", None) == "bfloat16"  # as vLLM's auto
    assert served_dtype(None, None) == "bfloat16"
    assert served_dtype("bfloat16", "float16") == "float16"
    assert served_dtype("float16", "auto") == "float16"
    assert served_dtype("bfloat16", "float") == "float32"  # vLLM's spelling
    target = TargetShape(num_hidden_layers=6, hidden_size=64, vocab_size=100, dtype="float32")
    assert StoredRowFormat.of(target, 3, "float32", fp8=False).value_bytes == 4
    assert StoredRowFormat.of(target, 3, None, fp8=False) == StoredRowFormat(3, 64, "bfloat16")


def test_a_dtype_rows_are_not_stored_in_is_one_line_naming_the_fix():
    with pytest.raises(DiskBudgetError, match=r"served in float64, .* \(--dtype in server.extra_args\)$") as error:
        StoredRowFormat(4, 16, served_dtype(None, "float64"))
    assert "\n" not in str(error.value)


def test_the_split_names_its_mode():
    assert RowSplit(10, 10).mode == "offline"
    assert RowSplit(10, 0).mode == "online"
    assert (RowSplit(10, 4).mode, RowSplit(10, 4).captured) == ("budget", 6)
