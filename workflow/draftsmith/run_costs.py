"""The cost plan's numbers: what a run will ask of the GPUs and the disk, before it spends anything.

Needs only the target's ``config.json`` (no weights, no GPU). Token counts are
measured where generation already ran and bounded from the config where it did
not (every answer at ``max_tokens``, every row at most ``dataset.seq_length``), so
the hidden-state bytes are an upper bound until the completions exist. A conversation
(``questions.turns: all``) is one row and one answer per user turn: the questions stage
counts the turns, and the tokens are planned per turn:

    hidden-state bytes = tokens x stored layers x hidden size x 2 (bf16; 1 B + a 4 B
    scale per token with hidden_states.stored_dtype: fp8)

``plan.py`` prints them (``snakemake plan``); the preflight checks the disk with them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from draftsmith.disk_budget import human_bytes
from draftsmith.drafter_files import read_drafter
from draftsmith.errors import DraftsmithError
from draftsmith.layout import TRAINING_METRICS, Layout
from draftsmith.records import TrainingMetrics, read_generation_records
from draftsmith.run_config import RunConfig
from draftsmith.target import read_target_config, read_target_shape
from draftsmith.throughputs import Rates, active_parameters, measured_rates, table_rates

# The share of the free disk a suggested budget takes: the rest is for checkpoints and logs.
FREE_DISK_SHARE = 0.9
CONFIGURED_BUDGET = "budget (configured)"
# Until the questions stage has run, prompts are assumed this long (chat template included).
ASSUMED_PROMPT_TOKENS = 256


class PlanError(DraftsmithError):
    pass


def existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _count_lines(path: Path) -> int:
    with path.open("rb") as handle:
        return sum(1 for line in handle if line.strip())


def _question_counts(settings: RunConfig, results: Path) -> tuple[int, int, int, str]:
    """(train questions, their user turns, held-out questions, where the numbers come from).
    Before the questions stage has run, a question counts as one turn."""
    summary = Layout(results).questions_summary
    if summary.exists():
        data = json.loads(summary.read_text())
        too_long = data.get("too_long", 0)  # a summary written before prompts were measured has none
        dropped = f"; {too_long:,} dropped: prompt over {data['max_prompt_tokens']:,} tokens" if too_long else ""
        turns = data.get("train_turns", data["train"])  # one each in a summary from before turns
        return data["train"], turns, data["heldout"], f"questions stage{dropped}"
    section = settings.questions
    total = section.limit
    source = Path(section.source)
    if source.suffix == ".jsonl" and source.is_file():
        total = min(total or 10**18, _count_lines(source))
    if total is None:
        raise PlanError("questions.limit is unset and the source is not a local JSONL: set questions.limit to plan")
    heldout = min(section.heldout, total)
    return total - heldout, total - heldout, heldout, "config (before dedup; one turn each)"


def _measured_tokens(results: Path) -> tuple[int, int, int, int] | None:
    """(conversations, turns, prompt tokens, completion tokens) from published completion shards."""
    shards = Layout(results).completion_shards()
    if not shards:
        return None
    answers = turns = prompt = completion = 0
    for shard in shards:
        for record in read_generation_records(shard):
            answers += 1
            turns += record.turns
            prompt += record.prompt_tokens
            completion += record.completion_tokens
    return answers, turns, prompt, completion


def _done(layout: Layout) -> dict[str, Any]:
    """What exists in this config's results_dir (and nowhere else)."""
    return {
        "generation_shards_done": len(layout.completion_shards()),
        "answers_staged": sum(_count_lines(p) for p in layout.staged_answer_files()),
        "extraction_shards_done": len(layout.extracted_shards()),
        "hidden_state_files_staged": len(layout.hidden_state_files(staged=True)),
        "states_captured_during_generation": len(layout.captured_state_files()),
        "drafter_done": layout.drafter.is_dir(),
        "evaluation_done": layout.acceptance.is_file(),
    }


def plan_for(settings: RunConfig, results: Path) -> dict[str, Any]:
    target = read_target_shape(settings.target.model)
    train, turns, heldout, counted_from = _question_counts(settings, results)
    measured = _measured_tokens(results)
    seq_length = settings.dataset.seq_length
    if measured and measured[0]:
        answers, turns_counted, prompt_tokens, completion_tokens = measured
        per_row = min(seq_length, (prompt_tokens + completion_tokens) / answers)
        turns = round(turns_counted / answers * train)  # the context may have ended some early
        tokens_basis = "measured"
    else:  # every turn's new prompt at the assumed length, every answer at max_tokens
        turns_counted = turns
        prompt_tokens = turns * ASSUMED_PROMPT_TOKENS
        completion_tokens = turns * settings.generation.max_tokens
        per_row = min(seq_length, (prompt_tokens + completion_tokens) / max(train, 1))
        tokens_basis = "upper bound"
    training_tokens = int(per_row * train)
    row = settings.stored_row(target)
    hidden_bytes = training_tokens * row.state_bytes_per_token
    layout = Layout(results)
    done = _done(layout)
    written_bytes = sum(p.stat().st_size for p in layout.hidden_state_files())
    external = settings.generation.endpoint is not None
    free_disk = shutil.disk_usage(existing_parent(results)).free
    modes = storage_modes(settings, train, row.row_bytes(round(per_row)), free_disk + written_bytes)
    plan = {
        "questions_train": train,
        "questions_heldout": heldout,
        "questions_counted_from": counted_from,
        # User turns answered (one request and one answer each; one row per conversation).
        "turns_train": turns,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_per_turn": round(prompt_tokens / max(turns_counted, 1)),
        "completion_tokens_per_turn": round(completion_tokens / max(turns_counted, 1)),
        "training_tokens": training_tokens,
        "tokens_basis": tokens_basis,
        "stored_layers": row.num_layers,
        "hidden_size": row.hidden_size,
        "stored_dtype": "fp8" if row.fp8 else "served",
        "bytes_per_value": row.value_bytes,
        "hidden_state_bytes": hidden_bytes,
        "hidden_state_bytes_to_write": max(hidden_bytes - written_bytes, 0),
        "free_disk_bytes": free_disk,
        "storage_modes": modes,
        "model_loads": {
            "generation": 0 if external else settings.questions.shards,
            # One pass: the generation server saved the stored rows; extraction loads nothing.
            "extraction": 0 if settings.hidden_states.during_generation else settings.extraction.shards,
            "evaluation": evaluation_loads(settings),
        },
        "draft_lengths": len(settings.evaluation.draft_lengths),
        "compare_untrained": settings.evaluation.compare_untrained,
        # Every kind trains from the same rows and states: more kinds cost training time
        # and evaluation loads, never extraction.
        "drafter_kinds": list(settings.training.kinds),
        "starting_drafter": starting_drafter(settings),
        "gpu_slot": settings.gpu_slot,
        "gpus_per_server": settings.server.gpus,
        "done": done,
    }
    active = active_parameters(read_target_config(settings.target.model))
    rates = measured_rates(results, table_rates(settings.device, settings.gpu_slot, active), settings.training.epochs)
    plan["active_parameters"] = active
    plan["rates"] = rates.to_json()
    plan["timed_modes"] = timed_modes(plan, settings, rates)
    return plan


def in_flight_rows(settings: RunConfig) -> int:
    """Captured files on disk at once, at most: speculators loads and deletes each file as
    its dataloader worker gets it (what is prefetched waits in memory), so one per worker
    (or per trainer process without workers)."""
    args = list(settings.training.extra_args)
    workers = int(args[args.index("--num-workers") + 1]) if "--num-workers" in args[:-1] else 0
    return settings.trainer_processes * max(workers, 1)


def storage_mode(
    name: str, settings: RunConfig, rows: int, stored: int, each: int, one_pass: bool = False
) -> dict[str, Any]:
    """``each``: the bytes of a stored row of the average length. In one pass the stored
    rows come from generation's own load: no extraction job loads the target."""
    captured = rows - stored
    in_flight = min(in_flight_rows(settings), captured)
    extraction_loads = settings.extraction.shards if stored and not one_pass else 0
    return {
        "mode": name,
        "one_pass": one_pass,
        "rows_stored": stored,
        "stored_bytes": stored * each,
        "peak_disk_bytes": (stored + in_flight) * each,
        "capture_passes": captured * settings.training.epochs,
        "model_loads": extraction_loads + (1 if captured else 0),
    }


def storage_modes(settings: RunConfig, rows: int, each: int, disk: int) -> list[dict[str, Any]]:
    """Offline, the configured budget, the largest budget the disk holds (when offline
    does not fit), and online: what each stores and captures (rows of ``each`` bytes); and
    the storing ones again in one pass (hidden_states.capture: during_generation)."""
    modes = [storage_mode("offline", settings, rows, rows, each)]
    budget = settings.hidden_states.limited_budget
    if budget not in (None, 0):
        modes.append(storage_mode(CONFIGURED_BUDGET, settings, rows, min(budget // each, rows), each))
    fitting = int(disk * FREE_DISK_SHARE) - min(in_flight_rows(settings), rows) * each
    if modes[0]["peak_disk_bytes"] > disk * FREE_DISK_SHARE:
        stored = min(max(fitting, 0) // each, rows)
        fits = storage_mode("budget that fits", settings, rows, stored, each)
        modes.append(fits | {"budget_bytes": stored * each})
    one_pass = [
        storage_mode(f"one pass, {mode['mode']}", settings, rows, mode["rows_stored"], each, one_pass=True)
        | ({"budget_bytes": mode["budget_bytes"]} if "budget_bytes" in mode else {})
        for mode in modes
    ]
    return modes + [storage_mode("online", settings, rows, 0, each)] + one_pass


def timed_modes(plan: dict[str, Any], settings: RunConfig, rates: Rates) -> list[dict[str, Any]]:
    """Each storage mode in tokens through the target and the trainer, and in hours of the
    heavy slot (generation, extraction and training; the evaluation is the same in all).
    A capture server shares the slot with the trainer, so their times add up."""
    rows = max(plan["questions_train"], 1)
    per_row = plan["training_tokens"] / rows
    epochs = settings.training.epochs
    generation_loads = plan["model_loads"]["generation"]
    timed = []
    for mode in plan["storage_modes"]:
        prefill = 0 if mode["one_pass"] else round(mode["rows_stored"] * per_row)
        recapture = round(mode["capture_passes"] * per_row)
        # Each kind of drafter reads every row each epoch. The rate is EAGLE-3's; on the CPU
        # demo a P-EAGLE or DFlash step was slower (docs/evaluation.md, drafter kinds).
        trainer = plan["training_tokens"] * epochs * len(plan["drafter_kinds"])
        loads = generation_loads + mode["model_loads"]
        seconds = {
            "generation": plan["completion_tokens"] / rates.decode_tokens_per_s.value,
            "extraction": prefill / rates.prefill_tokens_per_s.value,
            "training": trainer / rates.train_tokens_per_s.value + recapture / rates.prefill_tokens_per_s.value,
            "loads": loads * rates.load_s.value,
        }
        hours = sum(seconds.values()) / 3600
        timed.append(
            {
                "mode": mode["mode"],
                "model_loads": loads,
                "decode_tokens": plan["completion_tokens"],
                "prefill_tokens": prefill,
                "recapture_tokens": recapture,
                "trainer_tokens": trainer,
                "hours_by_stage": {stage: round(s / 3600, 2) for stage, s in seconds.items()},
                "hours": round(hours, 2),
                "gpu_hours": round(hours * settings.gpu_slot, 1),
            }
        )
    return timed


def configured_mode(plan: dict[str, Any], settings: RunConfig) -> dict[str, Any]:
    """The storage mode this config runs in (``storage_modes``' row for it)."""
    budget = settings.hidden_states.limited_budget
    name = "offline" if budget is None else "online" if budget == 0 else CONFIGURED_BUDGET
    if settings.hidden_states.during_generation and budget != 0:
        name = f"one pass, {name}"
    return next(mode for mode in plan["storage_modes"] if mode["mode"] == name)


def fitting_budget(plan: dict[str, Any]) -> str | None:
    """The budget to suggest when offline does not fit the free disk, as the config spells it."""
    fits = [mode for mode in plan["storage_modes"] if "budget_bytes" in mode]
    return f'"{human_bytes(fits[0]["budget_bytes"])}"' if fits else None


def starting_drafter(settings: RunConfig) -> dict[str, Any] | None:
    """What training.from_pretrained names and where it came from: a published drafter, or an
    earlier run's (its training metrics say how it was trained, and from what)."""
    source = settings.training.from_pretrained
    if source is None:
        return None
    path = Path(source).expanduser()
    try:
        summary = read_drafter(path).describe()
    except DraftsmithError as error:
        summary = f"unreadable: {error}"
    earlier = TrainingMetrics.read(path) if (path / TRAINING_METRICS).is_file() else None
    origin = "published"
    if earlier is not None:
        origin = f"an earlier draftsmith run's drafter, {len(earlier.epochs)} epoch(s)"
        origin += f", itself fine-tuned from the {earlier.started_from}" if earlier.started_from else " from scratch"
    return {"source": str(path.resolve()), "summary": summary, "origin": origin}


def evaluation_loads(settings: RunConfig) -> int:
    """The target alone once, once per draft length for each kind of drafter and each free
    method, and the untrained drafter once: on a 1T-parameter target each load is many
    minutes, so a long sweep shows here first."""
    evaluation = settings.evaluation
    lengths = len(evaluation.draft_lengths)
    per_length = len(settings.training.kinds) + len(evaluation.free_methods)
    per_length += settings.training.from_pretrained is not None  # the starting drafter, measured too
    return 1 + lengths * per_length + int(evaluation.compare_untrained)
