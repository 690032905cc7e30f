"""fp8 storage of hidden states: bytes and acceptance against rows stored as served (bf16).

Both runs are offline (every row stored) from the same finished dataset of the demo and
train the demo's full schedule, so the only difference is ``hidden_states.stored_dtype``:
``served`` (bf16) or ``fp8`` (float8 e4m3 with a float32 scale per token, read back
through speculators' fp8 backend). Recorded per run, as in ``scale.py``: hidden-state
bytes on disk, acceptance length (greedy, k=3, held-out set), training wall time.

    python bench/fp8_storage.py --workdir DIR [--epochs 15]

DIR is a finished run of the demo (a copy of the repository after ``make demo``); it is
left at fp8. Results go to ``bench/results/fp8_storage.json``.
"""

from results_file import write_result
from scale import FinishedDemo, acceptance_gap

GOAL = "fp8 about half the bytes of bf16; acceptance within 0.15 of bf16"


def main() -> None:
    demo = FinishedDemo.from_args(__doc__, epochs=15)
    served, fp8 = (demo.run_mode(name, {"disk_budget": "all", "stored_dtype": name}) for name in ("served", "fp8"))
    write_result(
        "fp8_storage",
        {
            "goal": GOAL,
            "modes": [served, fp8],
            "bytes_ratio_fp8_over_bf16": round(fp8["hidden_state_bytes_after"] / served["hidden_state_bytes_after"], 4),
            "acceptance_gap_fp8_minus_bf16": acceptance_gap(fp8, served),
        },
    )


if __name__ == "__main__":
    main()
