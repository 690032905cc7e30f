"""The disk budget's arithmetic: which rows are stored, which are captured while training."""

import pytest

from draftsmith.disk_budget import DiskBudgetError, RowSplit, parse_budget, row_bytes, stored_rows


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
    assert row_bytes(1, 4, 7168) - row_bytes(0, 4, 7168) == 56 * 1024 + 8


def test_an_fp8_row_costs_a_byte_per_value_and_a_scale_per_token():
    assert row_bytes(1, 4, 7168, fp8=True) - row_bytes(0, 4, 7168, fp8=True) == 28 * 1024 + 4 + 8
    tokens = [500] * 100
    budget = sum(row_bytes(t, 4, 7168) for t in tokens[:40])
    assert stored_rows(tokens, budget, 4, 7168) == 40
    assert stored_rows(tokens, budget, 4, 7168, fp8=True) == 79  # about twice the rows
    assert stored_rows(tokens, budget, 4, 7168, value_bytes=4) == 20  # served in fp32: half


def test_leading_rows_are_stored_while_they_fit():
    tokens = [10, 20, 30, 40]
    each = [row_bytes(t, 4, 16) for t in tokens]
    assert stored_rows(tokens, None, 4, 16) == 4
    assert stored_rows(tokens, 0, 4, 16) == 0
    assert stored_rows(tokens, each[0] - 1, 4, 16) == 0
    assert stored_rows(tokens, each[0] + each[1], 4, 16) == 2
    assert stored_rows(tokens, sum(each) - 1, 4, 16) == 3
    assert stored_rows(tokens, 10**12, 4, 16) == 4


def test_the_split_names_its_mode():
    assert RowSplit(10, 10).mode == "offline"
    assert RowSplit(10, 0).mode == "online"
    assert (RowSplit(10, 4).mode, RowSplit(10, 4).captured) == ("budget", 6)
