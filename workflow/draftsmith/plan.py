"""``snakemake plan``: the cost plan (``run_costs.py``) as a table, written beside the run
(plan.json and plan.txt) and printed before anything is spent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.atomic import atomic_write_text
from draftsmith.cli import read_settings, stage_parser
from draftsmith.disk_budget import human_bytes
from draftsmith.progress import log
from draftsmith.run_costs import fitting_budget, plan_for


def storage_rows(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """A line per way to hold the hidden states, and which budget fits when offline does not."""
    rows = [("hidden states on disk (mode)", "stored / peak disk / capture passes / model loads (extract + capture)")]
    for mode in plan["storage_modes"]:
        rows.append(
            (
                f"  {mode['mode']}",
                f"{human_bytes(mode['stored_bytes'])} / {human_bytes(mode['peak_disk_bytes'])} / "
                f"{mode['capture_passes']:,} / {mode['model_loads']}",
            )
        )
        if "budget_bytes" in mode and not mode["one_pass"]:
            share = mode["rows_stored"] / max(plan["questions_train"], 1)
            rows.append(
                (
                    "  offline does not fit the free disk",
                    f"set hidden_states.disk_budget: {fitting_budget(plan)} (stores {share:.1%} "
                    "of the rows, captures the rest in every epoch) or 0 (online)",
                )
            )
    return rows


def tokens_text(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def time_rows(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """Hours per storage mode, and the rates behind them with their sources."""
    rows = [
        ("time in the heavy slot (mode)", "hours / GPU-hours: loads; decode / prefill / re-captured / trained tokens")
    ]
    for mode in plan["timed_modes"]:
        rows.append(
            (
                f"  {mode['mode']}",
                f"{mode['hours']:,.1f} h / {mode['gpu_hours']:,.0f} GPU-h: {mode['model_loads']} loads; "
                + " / ".join(
                    tokens_text(mode[key])
                    for key in ("decode_tokens", "prefill_tokens", "recapture_tokens", "trainer_tokens")
                ),
            )
        )
    names = {"decode_tokens_per_s": "decode", "prefill_tokens_per_s": "prefill", "train_tokens_per_s": "trainer"}
    for key, rate in plan["rates"].items():
        value = f"{rate['value']:,.0f} s per load" if key == "load_s" else f"{rate['value']:,.0f} tokens/s"
        rows.append((f"  rate: {names.get(key, 'model load')}", f"{value} ({rate['source']})"))
    return rows


def format_plan(plan: dict[str, Any]) -> str:
    done = plan["done"]
    loads = plan["model_loads"]
    value = "1 B (fp8) + 4 B scale" if plan["stored_dtype"] == "fp8" else f"{plan['bytes_per_value']} B"
    rows = [
        (
            "questions (train / held out)",
            f"{plan['questions_train']:,} / {plan['questions_heldout']:,} ({plan['questions_counted_from']})",
        ),
        (
            "turns (train): per conversation",
            f"{plan['turns_train']:,}: {plan['turns_train'] / max(plan['questions_train'], 1):.1f}",
        ),
        ("prompt tokens", f"{plan['prompt_tokens']:,} ({plan['tokens_basis']})"),
        ("completion tokens", f"{plan['completion_tokens']:,} ({plan['tokens_basis']})"),
        (
            "tokens per turn: new prompt / completion",
            f"{plan['prompt_tokens_per_turn']:,} / {plan['completion_tokens_per_turn']:,} ({plan['tokens_basis']})",
        ),
        ("training tokens (<= seq_length per row)", f"{plan['training_tokens']:,}"),
        (
            "hidden states",
            f"{human_bytes(plan['hidden_state_bytes'])} = tokens x {plan['stored_layers']} layers"
            f" x {plan['hidden_size']} x {value}",
        ),
        (
            "  still to write / free disk",
            f"{human_bytes(plan['hidden_state_bytes_to_write'])} / {human_bytes(plan['free_disk_bytes'])}",
        ),
        (
            "model loads: generation / extraction / evaluation",
            f"{loads['generation']} / {loads['extraction']} / {loads['evaluation']}"
            f" (evaluation: target alone + {plan['draft_lengths']} draft length(s)"
            f"{' + untrained' if plan['compare_untrained'] else ''}"
            f"{' + the starting drafter at each length' if plan.get('starting_drafter') else ''})",
        ),
        ("drafter kinds (same rows and states, no extra extraction)", ", ".join(plan["drafter_kinds"])),
        ("starting drafter", _starting_text(plan.get("starting_drafter"))),
        *storage_rows(plan),
        *time_rows(plan),
        ("GPU slot (GPUs per heavy job) / TP x DP", f"{plan['gpu_slot']} / {plan['gpus_per_server']}"),
        ("done: generation shards / answers staged", f"{done['generation_shards_done']} / {done['answers_staged']:,}"),
        (
            "done: extraction shards / files staged / captured in one pass",
            f"{done['extraction_shards_done']} / {done['hidden_state_files_staged']:,}"
            f" / {done['states_captured_during_generation']:,}",
        ),
        (
            "done: drafter / evaluation",
            f"{'yes' if done['drafter_done'] else 'no'} / {'yes' if done['evaluation_done'] else 'no'}",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _starting_text(start: dict[str, Any] | None) -> str:
    if start is None:
        return "none: trained from scratch"
    return f"{start['summary']} ({start['origin']})"


def main(argv: list[str] | None = None) -> None:
    parser = stage_parser(__doc__)
    parser.add_argument("--results", type=Path, required=True, help="the config's results_dir")
    parser.add_argument("--output", type=Path, help="write the plan as JSON here")
    args = parser.parse_args(argv)
    plan = plan_for(read_settings(args.settings, "plan"), args.results)
    table = format_plan(plan)
    print(table)
    if args.output:
        atomic_write_text(args.output, json.dumps(plan, indent=2) + "\n")
        atomic_write_text(args.output.with_suffix(".txt"), table + "\n")
    log("plan written" if args.output else "plan printed")


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
