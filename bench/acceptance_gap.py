"""What validation predicts against what serving gets, on a finished demo, and the diagnosis.

Reads the run's ``eval/gap.json`` (the ``diagnose_gap`` rule: held-out, greedy, default draft
length and concurrency) for the demo's expected and served acceptance per position and its
cause, then plants each fault of ``tests/planted_faults.py`` into a copy of the run's drafter
or config and records the cause the diagnosis names for it (each must be its own).

``before_fix`` is the demo's gap before the end-of-turn token was counted into the draft
vocabulary (one pass), measured once and kept here for the record: the drafter of commit
9abbc50 served on the held-out split, and this stage's coverage check on that drafter's
``t2d`` and the run's answers (the cause it named once the tokens, wiring and numerics checks
passed).

    python bench/acceptance_gap.py [--results results]   # after make demo
"""

import argparse
import sys
import tempfile
from pathlib import Path

from results_file import write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "workflow"), str(ROOT / "tests")]
from planted_faults import PLANTED, clean  # noqa: E402

from draftsmith.records import AcceptanceGap, EvaluationSummary  # noqa: E402

BEFORE_FIX = {
    "expected": [0.8674, 0.7244, 0.6053],
    "served": [0.8179, 0.6773, 0.5751],
    "served_standard_error": [0.0218, 0.0264, 0.0279],
    "acceptance_length": {"expected": 3.1971, "served": 3.0703},
    "cause": "coverage",
    "diagnosis": (
        "5.8% of answer tokens are outside the draft vocabulary (most: '</s>' 1139 of 1140 answers): one-pass "
        "rows end before the final answer token, so the token counts never saw the end-of-turn token"
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "results", help="a finished demo's results directory")
    args = parser.parse_args()
    workdir = args.results.resolve().parent
    gap = AcceptanceGap.read(args.results / "eval" / "gap.json")
    summary = EvaluationSummary.from_json((args.results / "eval" / "acceptance.json").read_text())
    run = clean(workdir)
    planted = {}
    for fault, (plant, _check) in sorted(PLANTED.items()):
        with tempfile.TemporaryDirectory() as where:
            diagnosed = plant(run, Path(where)).diagnosis()
            planted[fault] = diagnosed.diagnosis
    clean_diagnosis = run.diagnosis()
    write_result(
        "acceptance_gap",
        {
            "demo": {
                "expected": gap.expected,
                "served": gap.served,
                "served_standard_error": gap.served_standard_error,
                "validation_standard_error": gap.validation_standard_error,
                "validation_positions": gap.validation_positions,
                "beyond_noise": gap.beyond_noise,
                "acceptance_length": {
                    "expected": summary.expected_acceptance_length,
                    "served": summary.acceptance_length,
                },
                "cause": gap.cause,
                "summary": gap.summary,
            },
            "planted": planted,
            "planted_causes": {fault: check for fault, (_plant, check) in sorted(PLANTED.items())},
            "clean": clean_diagnosis.diagnosis,
            "before_fix": BEFORE_FIX,
            "measured_on": "config/config.yaml (make demo): held-out, greedy, k=3, concurrency 8",
        },
    )


if __name__ == "__main__":
    main()
