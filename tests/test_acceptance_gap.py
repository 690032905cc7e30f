"""Served acceptance against what validation predicts, on the finished demo: the comparison is
in acceptance.json and the report, the clean demo names no cause, and each planted fault is
named by its own check and no other (the diagnosis reads files; seconds each)."""

import json

import pytest
from planted_faults import PLANTED, clean

from draftsmith.acceptance_gap import CONFIGURATION_CHECKS, beyond_noise, conditional
from draftsmith.layout import Layout
from draftsmith.records import AcceptanceGap, EvaluationSummary

pytestmark = pytest.mark.e2e


def test_acceptance_json_carries_what_validation_predicts_with_the_noise_of_both(demo_run):
    layout = Layout(demo_run / "results")
    summary = EvaluationSummary.from_json(layout.acceptance.read_text())
    k = summary.num_speculative_tokens
    assert len(summary.expected_acceptance_per_position) == k
    assert summary.expected_acceptance_length == pytest.approx(1 + sum(summary.expected_acceptance_per_position))
    assert len(summary.acceptance_per_position_standard_error) == k
    assert summary.validation_positions > 100
    greedy_drafter_rows = [r for r in summary.results if r.method == "eagle3" and r.temperature == 0.0]
    assert greedy_drafter_rows and all(r.expected_acceptance_per_position for r in greedy_drafter_rows)
    assert all(r.expected_acceptance_per_position is None for r in summary.results if r.temperature > 0)
    assert "validation predicts" in layout.evaluation_tables.read_text()


def test_the_clean_demo_names_no_fault(demo_run):
    """The clean demo names no configuration fault. Its answers are a few verify steps long and
    it runs in one pass, whose rows never train the end of an answer: where that shortens the
    first position beyond noise (some trainings, not all), the gap is named by its cause,
    ``endings``, with its count, never left unexplained."""
    gap = AcceptanceGap.read(Layout(demo_run / "results").acceptance_gap)
    assert gap.cause in (None, "endings"), gap.summary
    assert not any(check["failed"] for check in gap.checks if check["check"] in CONFIGURATION_CHECKS)
    if gap.cause is None:
        assert gap.diagnosis is None
    else:
        (endings,) = [check for check in gap.checks if check["check"] == "endings"]
        assert endings["evidence"]["trained_end_labels"] == 0 and endings["evidence"]["one_pass"]
        assert gap.diagnosis.startswith("endings: the drafter was never trained to end an answer")
    assert gap.other_sets and not any(s["in_training_distribution"] for s in gap.other_sets.values())


@pytest.mark.parametrize("fault", sorted(PLANTED))
def test_each_planted_fault_is_named_by_its_own_check(demo_run, tmp_path, fault):
    plant, check = PLANTED[fault]
    gap = plant(clean(demo_run), tmp_path).diagnosis()
    assert gap.cause == check, gap.summary
    failed = {c["check"] for c in gap.checks if c["failed"] and c["check"] in CONFIGURATION_CHECKS}
    assert failed == {check}
    assert gap.diagnosis.startswith(f"{check}: ")


def test_an_untrained_ending_explains_one_first_draft_per_request(tmp_path):
    """One rejected first draft per request: requests over steps. Only a drafter that never
    trained the end-of-turn label fails the check."""
    from datasets import Dataset

    from draftsmith.acceptance_gap import check_endings, trained_labels

    rows = {"input_ids": [[1, 5, 6, 2], [1, 7, 8]], "loss_mask": [[0, 1, 1, 1], [0, 0, 1]]}
    Dataset.from_dict(rows).save_to_disk(str(tmp_path / "with_end"))
    assert trained_labels(tmp_path / "with_end", 2) == (1, 4)
    assert not check_endings("</s>", 1, 4, True, 60, 373.0).failed
    never = check_endings("</s>", 0, 18722, True, 60, 373.0)
    assert never.failed and never.evidence["first_position_rejections_explained"] == round(60 / 373, 4)
    assert "in one pass each row stops before its answer's final token" in never.line


def test_a_gap_is_real_only_beyond_the_noise_of_both_sides():
    assert not beyond_noise(0.87, 0.85, served_error=0.02, validation_error=0.01)
    assert beyond_noise(0.87, 0.75, served_error=0.02, validation_error=0.01)
    assert not beyond_noise(0.80, 0.85, served_error=0.001, validation_error=0.001)  # served above
    assert conditional([0.8, 0.6, 0.3]) == [0.8, 0.75, 0.5]


def test_the_evidence_file_names_every_check(demo_run):
    values = json.loads(Layout(demo_run / "results").acceptance_gap.read_text())
    assert {c["check"] for c in values["checks"]} >= set(CONFIGURATION_CHECKS)
