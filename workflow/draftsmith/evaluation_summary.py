"""Evaluation summary: the sweep's measurements as numbers a user can act on.

Reads the baseline job, one job per draft length, and one per free method and draft length
(``evaluate.py``) and writes:

- ``acceptance.json`` (``records.EvaluationSummary``, the type every reader reads it as): at
  its top level, as before, the held-out set at the default draft length and concurrency,
  greedy; beside that, ``results`` (every method, set, category, draft length, concurrency
  and sampling) and ``recommendation``;
- the recommendation, for each concurrency and sampling, over all sets together. First
  each method's draft length: the one with the best measured throughput. Each throughput
  carries its spread (``records.relative_spread``); when other draft lengths come within
  the spread of the fastest, the recommendation says so and takes, of those, the one with
  the most tokens per target step: a difference the measurement cannot tell apart should
  not decide. Then, the same way, what to serve: the target alone, the drafter or a free
  method (``serve``). When the target alone is faster beyond noise, that is the choice;
- ``drafter_speculative_config.json``: vLLM's ``--speculative-config`` for what is
  recommended at the default (first) concurrency, greedy, or ``null`` when that is the
  target alone. The recommendation table gives the choice at every other concurrency;
- the report's plots and tables (drawn by ``evaluation_report``).

Tokens per target step compare methods that draft at every step (a drafter) with those
that draft only where they find a match (n-gram lookup), whose acceptance per draft counts
the drafted steps only. Every step yields one token and each accepted draft token one more,
so over all steps: tokens / (tokens - accepted draft tokens).

Throughput of a set is its tokens over its wall time. Categories share their set's
wall time, so a category's speed is per request: its tokens over its requests' latencies.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.atomic import atomic_write_text
from draftsmith.cli import read_settings, stage_parser
from draftsmith.drafter_kinds import START_METHOD, drafter_speculative_config, free_method_config
from draftsmith.evaluation_report import (
    choice_text,
    plot_acceptance,
    plot_speedup,
    sampling_name,
    serve_text,
    tables_html,
)
from draftsmith.layout import TRAINING_METRICS
from draftsmith.progress import log
from draftsmith.records import (
    HELDOUT,
    NO_CATEGORY,
    WHOLE_SET,
    CategoryResult,
    DefaultCounts,
    EvaluationSummary,
    Measurement,
    Phase,
    Recommendation,
    ServingOption,
    SetResult,
    Tally,
    TrainingMetrics,
    acceptance_length,
    accepted_tokens,
    merged,
    relative_spread,
)
from draftsmith.run_config import RunConfig


def accepted_at_positions(tally: Tally, k: int) -> list[int]:
    """Steps that accepted a token at each draft position: those that accepted more than p."""
    return [sum(tally.histogram[p + 1 :]) for p in range(k)]


def per_position(tally: Tally, k: int) -> list[float]:
    """Acceptance at each draft position: accepted there / steps."""
    steps = sum(tally.histogram)
    return [round(n / steps, 4) if steps else 0.0 for n in accepted_at_positions(tally, k)]


def per_position_standard_error(tally: Tally, k: int) -> list[float]:
    """The binomial standard error of each position's rate over the verify steps."""
    steps = sum(tally.histogram)
    rates = per_position(tally, k)
    return [round(math.sqrt(rate * (1 - rate) / steps), 4) if steps else 0.0 for rate in rates]


def drafter_metrics(job: Measurement) -> TrainingMetrics | None:
    """The training metrics published with a measured drafter (none for free methods, or a
    starting drafter that did not come from a draftsmith run)."""
    if job.drafter is None or not (Path(job.drafter) / TRAINING_METRICS).is_file():
        return None
    return TrainingMetrics.read(Path(job.drafter))


def expected(metrics: TrainingMetrics | None, k: int, temperature: float) -> dict[str, Any]:
    """What validation predicts for a greedy row: full_acc_i per position, 1 + their sum."""
    per_position_expected = metrics.expected_per_position(k) if metrics and temperature == 0.0 else None
    if per_position_expected is None:
        return {}
    return {
        "expected_acceptance_per_position": per_position_expected,
        "expected_acceptance_length": round(1 + sum(per_position_expected), 4),
    }


def tokens_per_step(tally: Tally) -> float:
    """Output tokens per target forward step, over all steps (module docstring)."""
    steps = tally.completion_tokens - accepted_tokens(tally)
    return round(tally.completion_tokens / steps, 4) if steps > 0 else 1.0


def _key(phase: Phase) -> tuple[float, int, str]:
    return phase.temperature, phase.concurrency, phase.set


def drafter_length(job: Measurement) -> int:
    if job.num_speculative_tokens is None:
        raise ValueError(f"{job.drafter}: a drafter's measurement without a draft length")
    return job.num_speculative_tokens


def _speed(tokens: int, seconds: float) -> float:
    return round(tokens / seconds, 2) if seconds else 0.0


def _spread(tally: Tally, speed: float) -> float:
    """± tokens per second of a speed measured on ``tally``'s requests."""
    return round(speed * relative_spread(tally), 2)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def result_rows(drafter: Measurement, baseline: Measurement) -> list[SetResult | CategoryResult]:
    """One row per set (category ``*``) and per category of a set that has several, for
    every phase of one drafter (or free method) job, against the baseline's same phase."""
    k = drafter_length(drafter)
    alone = {_key(phase): phase for phase in baseline.phases}
    metrics = drafter_metrics(drafter)
    rows: list[SetResult | CategoryResult] = []
    for phase in drafter.phases:
        base = alone[_key(phase)]
        tallies, base_tallies = phase.categories, base.categories
        whole, base_whole = merged(tallies.values()), merged(base_tallies.values())
        common: dict[str, Any] = {
            "method": str(drafter.name),
            "num_speculative_tokens": k,
            "concurrency": phase.concurrency,
            "temperature": phase.temperature,
            "set": phase.set,
        }
        with_drafter = _speed(whole.completion_tokens, phase.seconds)
        without = _speed(base_whole.completion_tokens, base.seconds)
        rows.append(
            SetResult(
                **common,
                category=WHOLE_SET,
                **_acceptance(whole, k),
                **expected(metrics, k, phase.temperature),
                tokens_per_s_with_drafter=with_drafter,
                tokens_per_s_with_drafter_spread=_spread(whole, with_drafter),
                tokens_per_s_without_drafter=without,
                tokens_per_s_without_drafter_spread=_spread(base_whole, without),
                speedup=_ratio(with_drafter, without),
                with_drafter_seconds=round(phase.seconds, 3),
                without_drafter_seconds=round(base.seconds, 3),
            )
        )
        if set(tallies) != {NO_CATEGORY}:
            for category, tally in tallies.items():
                row = _category_row(common, category, tally, base_tallies.get(category), k)
                rows.append(dataclasses.replace(row, **expected(metrics, k, phase.temperature)))
    return rows


def _acceptance(tally: Tally, k: int) -> dict[str, Any]:
    return {
        "requests": tally.requests,
        "completion_tokens": tally.completion_tokens,
        "acceptance_length": round(acceptance_length(tally), 4),
        "acceptance_per_position": per_position(tally, k),
        "acceptance_per_position_standard_error": per_position_standard_error(tally, k),
        "tokens_per_step": tokens_per_step(tally),
    }


def _category_row(common: dict[str, Any], category: str, tally: Tally, base: Tally | None, k: int) -> CategoryResult:
    """A category's speed per request (it shares its set's wall time with the others)."""
    with_drafter = _speed(tally.completion_tokens, tally.request_seconds)
    without = _speed(base.completion_tokens, base.request_seconds) if base else 0.0
    return CategoryResult(
        **common,
        category=category,
        **_acceptance(tally, k),
        request_tokens_per_s_with_drafter=with_drafter,
        request_tokens_per_s_with_drafter_spread=_spread(tally, with_drafter),
        request_tokens_per_s_without_drafter=without,
        request_tokens_per_s_without_drafter_spread=_spread(base, without) if base else 0.0,
        speedup=_ratio(with_drafter, without),
    )


@dataclass(frozen=True)
class Pooled:
    """One job's measurement at one (sampling, concurrency), all sets together."""

    tokens_per_s: float
    spread: float  # ± tokens per second
    acceptance_length: float
    tokens_per_step: float

    def within_noise_of(self, other: Pooled) -> bool:
        """The two throughputs differ by less than the spread of their difference."""
        return abs(self.tokens_per_s - other.tokens_per_s) <= math.hypot(self.spread, other.spread)

    def option(self, alone: Pooled) -> ServingOption:
        return ServingOption(
            tokens_per_s=self.tokens_per_s,
            spread=self.spread,
            acceptance_length=self.acceptance_length,
            tokens_per_step=self.tokens_per_step,
            speedup=_ratio(self.tokens_per_s, alone.tokens_per_s),
        )


def pooled(job: Measurement) -> dict[tuple[float, int], Pooled]:
    """(temperature, concurrency) -> the job's throughput over all sets together."""
    tallies: dict[tuple[float, int], list[Tally]] = {}
    seconds: dict[tuple[float, int], float] = {}
    for phase in job.phases:
        key = (phase.temperature, phase.concurrency)
        tallies.setdefault(key, []).append(merged(phase.categories.values()))
        seconds[key] = seconds.get(key, 0.0) + phase.seconds
    measured = {}
    for key, parts in tallies.items():
        whole = merged(parts)
        speed = _speed(whole.completion_tokens, seconds[key])
        measured[key] = Pooled(speed, _spread(whole, speed), round(acceptance_length(whole), 4), tokens_per_step(whole))
    return measured


def choose(measured: dict[Any, Pooled], simplest_first: list[Any]) -> tuple[Any, list[Any]]:
    """The fastest option, or, of those within noise of it, the one with the most tokens per
    target step (ties: the earlier in ``simplest_first``); and the options within noise."""
    fastest = max(measured, key=lambda option: measured[option].tokens_per_s)
    tied = [option for option in simplest_first if measured[option].within_noise_of(measured[fastest])]
    return max(tied, key=lambda option: (measured[option].tokens_per_step, -simplest_first.index(option))), tied


TARGET_ALONE = "target alone"


def recommend(
    drafters: dict[int, Measurement],
    baseline: Measurement,
    free_methods: dict[str, dict[int, Measurement]] | None = None,
    kinds: dict[str, dict[int, Measurement]] | None = None,
    start: dict[int, Measurement] | None = None,
) -> list[Recommendation]:
    """For each (sampling, concurrency): the drafter's best draft length, each free method's,
    the starting drafter's and each other kind of drafter's, and of those and the target
    alone, what to serve (module docstring)."""
    alone = pooled(baseline)
    measured = {k: pooled(job) for k, job in drafters.items()}
    free_measured = {
        method: {k: pooled(job) for k, job in jobs.items()} for method, jobs in (free_methods or {}).items()
    }
    kinds = kinds or {}
    kinds_measured = {kind: {k: pooled(job) for k, job in jobs.items()} for kind, jobs in kinds.items()}
    start = start or {}
    start_measured = {k: pooled(job) for k, job in start.items()}
    rows = []
    for key in sorted(alone):
        at = {k: measured[k][key] for k in sorted(measured)}
        best, tied = choose(at, sorted(at))
        configs = {f"drafter k={best}": drafter_speculative_config(Path(str(drafters[best].drafter)), best)}
        options = {TARGET_ALONE: alone[key], f"drafter k={best}": at[best]}
        for method, by_length in free_measured.items():
            method_at = {k: by_length[k][key] for k in sorted(by_length)}
            method_best, _ = choose(method_at, sorted(method_at))
            configs[f"{method} k={method_best}"] = free_method_config(method, method_best)
            options[f"{method} k={method_best}"] = method_at[method_best]
        free_options = list(options)[2:]
        if start_measured:  # the published drafter before the run's data: served as it came
            start_at = {k: start_measured[k][key] for k in sorted(start_measured)}
            start_best, _ = choose(start_at, sorted(start_at))
            name = f"{START_METHOD} k={start_best}"
            configs[name] = drafter_speculative_config(Path(str(start[start_best].drafter)), start_best)
            options[name] = start_at[start_best]
        for kind, by_length in kinds_measured.items():
            kind_at = {k: by_length[k][key] for k in sorted(by_length)}
            kind_best, _ = choose(kind_at, sorted(kind_at))
            drafter = Path(str(kinds[kind][kind_best].drafter))
            configs[f"{kind} k={kind_best}"] = drafter_speculative_config(drafter, kind_best, kind)
            options[f"{kind} k={kind_best}"] = kind_at[kind_best]
        # Ties go to the simplest: the target alone, then what needs no training, then EAGLE-3.
        simplest = [TARGET_ALONE, *free_options, f"drafter k={best}", *list(options)[2 + len(free_options) :]]
        served, served_tied = choose(options, simplest)
        rows.append(
            Recommendation(
                temperature=key[0],
                concurrency=key[1],
                num_speculative_tokens=best,
                chosen_by="throughput" if len(tied) == 1 else "tokens per step",
                within_noise=tied,
                tokens_per_s_with_drafter=at[best].tokens_per_s,
                tokens_per_s_with_drafter_spread=at[best].spread,
                tokens_per_s_without_drafter=alone[key].tokens_per_s,
                tokens_per_s_without_drafter_spread=alone[key].spread,
                speedup=_ratio(at[best].tokens_per_s, alone[key].tokens_per_s),
                tokens_per_s_by_draft_length={str(k): at[k].tokens_per_s for k in at},
                spread_by_draft_length={str(k): at[k].spread for k in at},
                acceptance_length_by_draft_length={str(k): at[k].acceptance_length for k in at},
                tokens_per_step_by_draft_length={str(k): at[k].tokens_per_step for k in at},
                drafter_speculative_config=configs[f"drafter k={best}"],
                options={name: option.option(alone[key]) for name, option in options.items()},
                serve=served,
                serve_chosen_by="throughput" if len(served_tied) == 1 else "tokens per step",
                serve_within_noise=served_tied,
                serve_speedup=_ratio(options[served].tokens_per_s, alone[key].tokens_per_s),
                speculative_config=configs.get(served),
            )
        )
    return rows


def _default_measurement(job: Measurement, concurrency: int) -> tuple[Phase, Tally]:
    phase = next(p for p in job.phases if _key(p) == (0.0, concurrency, HELDOUT))
    return phase, merged(phase.categories.values())


def headline(
    drafter: Measurement,
    baseline: Measurement,
    untrained: Measurement | None,
    k: int,
    concurrency: int,
    results: list[SetResult | CategoryResult],
    recommendation: list[Recommendation],
    start: Measurement | None = None,
) -> EvaluationSummary:
    """The summary, with at its top level the numbers read first: held-out, the default draft
    length and concurrency, greedy."""
    phase, tally = _default_measurement(drafter, concurrency)
    base_phase, base = _default_measurement(baseline, concurrency)
    with_speed, without_speed = (
        _speed(tally.completion_tokens, phase.seconds),
        _speed(base.completion_tokens, base_phase.seconds),
    )
    untrained_tally = _default_measurement(untrained, concurrency)[1] if untrained else None
    start_tally = _default_measurement(start, concurrency)[1] if start else None
    metrics = drafter_metrics(drafter)
    return EvaluationSummary(
        acceptance_length=round(acceptance_length(tally), 4),
        max_acceptance_length=k + 1,
        acceptance_per_position=per_position(tally, k),
        tokens_per_s_with_drafter=with_speed,
        tokens_per_s_with_drafter_spread=_spread(tally, with_speed),
        tokens_per_s_without_drafter=without_speed,
        tokens_per_s_without_drafter_spread=_spread(base, without_speed),
        speedup=_ratio(with_speed, without_speed),
        num_speculative_tokens=k,
        concurrency=concurrency,
        with_drafter=_counts(tally, phase.seconds, k),
        without_drafter=_counts(base, base_phase.seconds, 0),
        untrained_acceptance_length=round(acceptance_length(untrained_tally), 4)
        if untrained_tally is not None
        else None,
        untrained_acceptance_per_position=per_position(untrained_tally, k) if untrained_tally is not None else None,
        start_acceptance_length=round(acceptance_length(start_tally), 4) if start_tally is not None else None,
        start_acceptance_per_position=per_position(start_tally, k) if start_tally is not None else None,
        **expected(metrics, k, 0.0),
        acceptance_per_position_standard_error=per_position_standard_error(tally, k),
        validation_positions=metrics.validation_positions if metrics else None,
        mla_disabled=drafter.mla_disabled,
        mla_disabled_because=drafter.mla_disabled_because if drafter.mla_disabled else None,
        results=results,
        recommendation=recommendation,
    )


def _counts(tally: Tally, seconds: float, k: int) -> DefaultCounts:
    return DefaultCounts(
        requests=tally.requests,
        completion_tokens=tally.completion_tokens,
        seconds=round(seconds, 3),
        drafts=sum(tally.histogram),
        draft_tokens=tally.draft_tokens,
        accepted_tokens=accepted_tokens(tally),
        accepted_per_position=accepted_at_positions(tally, k),
        tokens_per_step=tokens_per_step(tally),
    )


# --- the stage -----------------------------------------------------------------------------


def summarize(
    settings: RunConfig,
    baseline: Measurement,
    drafters: dict[int, Measurement],
    untrained: Measurement | None,
    free_methods: dict[str, dict[int, Measurement]] | None = None,
    kinds: dict[str, dict[int, Measurement]] | None = None,
    start: dict[int, Measurement] | None = None,
) -> EvaluationSummary:
    k, concurrency = settings.evaluation.draft_lengths[0], settings.evaluation.concurrencies[0]
    free_methods, kinds, start = free_methods or {}, kinds or {}, start or {}
    jobs = [drafters[length] for length in sorted(drafters)]
    jobs += [start[length] for length in sorted(start)]
    for others in (free_methods, kinds):
        jobs += [others[name][length] for name in sorted(others) for length in sorted(others[name])]
    results = [row for job in jobs for row in result_rows(job, baseline)]
    recommendation = recommend(drafters, baseline, free_methods, kinds, start)
    return headline(drafters[k], baseline, untrained, k, concurrency, results, recommendation, start.get(k))


def by_method_and_length(jobs: list[Measurement]) -> dict[str, dict[int, Measurement]]:
    grouped: dict[str, dict[int, Measurement]] = {}
    for job in jobs:
        grouped.setdefault(str(job.name), {})[drafter_length(job)] = job
    return grouped


def run(
    settings: RunConfig,
    baseline: Path,
    drafter_jobs: list[Path],
    untrained: Path | None,
    outputs: dict[str, Path],
    free_method_jobs: list[Path] | None = None,
    kind_jobs: list[Path] | None = None,
    start_jobs: list[Path] | None = None,
) -> EvaluationSummary:
    drafters = {drafter_length(job): job for job in map(Measurement.read, drafter_jobs)}
    start = {drafter_length(job): job for job in map(Measurement.read, start_jobs or [])}
    untrained_job = Measurement.read(untrained) if untrained else None
    free_methods = by_method_and_length([Measurement.read(job) for job in free_method_jobs or []])
    kinds = by_method_and_length([Measurement.read(job) for job in kind_jobs or []])
    result = summarize(settings, Measurement.read(baseline), drafters, untrained_job, free_methods, kinds, start)
    plot_acceptance(result, outputs["acceptance_plot"])
    plot_speedup(result, outputs["speedup_plot"])
    atomic_write_text(outputs["tables"], tables_html(result))
    atomic_write_text(outputs["spec_config"], json.dumps(result.default_recommendation.speculative_config) + "\n")
    result.write(outputs["acceptance"])
    log(
        f"held-out, k={result.num_speculative_tokens}: acceptance length {result.acceptance_length} "
        f"(per position {result.acceptance_per_position})"
    )
    for row in result.recommendation:
        drafter = f"drafter k={row.num_speculative_tokens}"
        log(
            f"concurrency {row.concurrency}, {sampling_name(row.temperature)}: serve {row.serve} "
            f"({row.serve_speedup}× the target alone; {serve_text(row)})"
            + ("" if row.serve == drafter else f"; the {drafter}: {row.speedup}× ({choice_text(row)})")
        )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = stage_parser(__doc__)
    parser.add_argument("--baseline", required=True, type=Path)
    parser.add_argument("--drafter-jobs", required=True, nargs="+", type=Path)
    parser.add_argument("--untrained", type=Path, default=None)
    parser.add_argument("--free-method-jobs", nargs="*", type=Path, default=[])
    parser.add_argument("--kind-jobs", nargs="*", type=Path, default=[], help="other kinds of drafter (training.kinds)")
    parser.add_argument("--start-jobs", nargs="*", type=Path, default=[], help="the starting drafter (from_pretrained)")
    for name in ("acceptance", "spec-config", "acceptance-plot", "speedup-plot", "tables"):
        parser.add_argument(f"--{name}", required=True, type=Path)
    args = parser.parse_args(argv)
    outputs = {
        "acceptance": args.acceptance,
        "spec_config": args.spec_config,
        "acceptance_plot": args.acceptance_plot,
        "speedup_plot": args.speedup_plot,
        "tables": args.tables,
    }
    run(
        read_settings(args.settings, "evaluate"),
        args.baseline,
        args.drafter_jobs,
        args.untrained,
        outputs,
        args.free_method_jobs,
        args.kind_jobs,
        args.start_jobs,
    )


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
