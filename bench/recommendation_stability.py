"""Is the recommended draft length stable, or does it say when it is within noise?

Re-measures the drafter jobs of a finished run (``snakemake --forcerun evaluate_drafter``)
``--runs`` times and records, for every run including the one already there, each
(concurrency, sampling): the recommended draft length, how it was chosen, and every draft
length's throughput with its spread. The choice is stable when it never changes, or when
the runs that disagree say their candidates were within noise.

    python bench/recommendation_stability.py --workdir DIR [--runs 2]

DIR is a finished run of the workflow (e.g. a copy of the repository after `make demo`).
"""

import argparse
import subprocess
import sys
from pathlib import Path

from results_file import write_result

from draftsmith.records import EvaluationSummary

ACCEPTANCE = "results/eval/acceptance.json"


def recommendation(workdir: Path) -> list[dict]:
    return [
        {
            "concurrency": row.concurrency,
            "temperature": row.temperature,
            "draft_length": row.num_speculative_tokens,
            "chosen_by": row.chosen_by,
            "within_noise": row.within_noise,
            "tokens_per_s": row.tokens_per_s_by_draft_length,
            "spread": row.spread_by_draft_length,
            "tokens_per_s_target_alone": row.tokens_per_s_without_drafter,
        }
        for row in EvaluationSummary.read(workdir / ACCEPTANCE).recommendation
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    runs = [recommendation(args.workdir)]
    for _ in range(args.runs):
        command = [sys.executable, "-m", "snakemake", "--cores", "all", "--resources", "gpu=8"]
        subprocess.run([*command, "--forcerun", "evaluate_drafter"], cwd=args.workdir, check=True)
        runs.append(recommendation(args.workdir))
    by_setting: dict[str, list[dict]] = {}
    for run in runs:
        for row in run:
            by_setting.setdefault(f"concurrency {row['concurrency']}, temperature {row['temperature']}", []).append(row)
    write_result(
        "recommendation_stability",
        {
            "goal": "the same draft length in every run, or a choice that says it was within noise",
            "runs": runs,
            "draft_lengths_chosen": {
                name: sorted({r["draft_length"] for r in rows}) for name, rows in by_setting.items()
            },
            # Where the runs disagree, every one of them must have said the choice was within noise.
            "stable": all(
                len({r["draft_length"] for r in rows}) == 1 or all(len(r["within_noise"]) > 1 for r in rows)
                for rows in by_setting.values()
            ),
        },
    )


if __name__ == "__main__":
    main()
