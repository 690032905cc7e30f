"""The evaluation drawn for people: its plots and tables, from what ``evaluation_summary``
computes (``records.EvaluationSummary``: acceptance.json), for the report."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, on machines without a display
import matplotlib.pyplot as plt  # noqa: E402

from draftsmith.drafter_kinds import FREE_METHODS, START_METHOD  # noqa: E402
from draftsmith.records import (  # noqa: E402
    WHOLE_SET,
    CategoryResult,
    EvaluationSummary,
    Recommendation,
    ResultRow,
    SetResult,
)
from draftsmith.report import save_figure  # noqa: E402


def choice_text(row: Recommendation) -> str:
    """How the drafter's draft length was chosen, in words."""
    if row.chosen_by == "throughput":
        return "fastest beyond noise"
    others = ", ".join(f"k={k}" for k in row.within_noise)
    return f"{others} within noise: most tokens per step"


def serve_text(row: Recommendation) -> str:
    """How what to serve was chosen, in words; when the starting drafter beats the one trained
    from it, that the run's data made it worse."""
    why = (
        "fastest beyond noise"
        if row.serve_chosen_by == "throughput"
        else f"{', '.join(row.serve_within_noise)} within noise: most tokens per step"
    )
    if not row.serve.startswith(f"{START_METHOD} "):
        return why
    trained = row.options[f"drafter k={row.num_speculative_tokens}"]
    started = row.options[row.serve]
    before, after = started.tokens_per_step, trained.tokens_per_step
    if before >= after:
        return (
            f"{why}; the starting drafter, not the one fine-tuned from it: your data made it worse "
            f"(tokens per step {before:.2f} before it, {after:.2f} after)"
        )
    return (
        f"{why}; the starting drafter measured faster, though the one fine-tuned from it drafts more "
        f"tokens per step ({after:.2f} against {before:.2f})"
    )


def is_drafter_row(row: ResultRow) -> bool:
    return row.method not in FREE_METHODS


def sampling_name(value: float) -> str:
    return "greedy" if value == 0 else f"T={value:g}"


def plot_acceptance(result: EvaluationSummary, path: Path) -> None:
    """Left: the held-out set per position, trained vs the starting drafter and untrained. Right: every set and category
    per position at the longest draft length."""
    drafter_rows = [row for row in result.results if is_drafter_row(row)]
    longest = max(row.num_speculative_tokens for row in drafter_rows)
    rows = [r for r in drafter_rows if r.num_speculative_tokens == longest and r.concurrency == result.concurrency]
    kinds = len({r.method for r in rows}) > 1  # several kinds of drafter: name each row's
    labels = [
        ("" if not kinds else f"{r.method} · ")
        + f"{r.set}{'' if r.category == WHOLE_SET else ' / ' + r.category} · {sampling_name(r.temperature)}"
        f"  (AL {r.acceptance_length:.2f})"
        for r in rows
    ]
    grid = [r.acceptance_per_position for r in rows]
    figure, (left, right) = plt.subplots(
        1, 2, figsize=(13, max(4, 0.4 * len(rows) + 1.5)), gridspec_kw={"width_ratios": [1, 1.4]}
    )
    positions = range(1, len(result.acceptance_per_position) + 1)
    bars = [("trained drafter", result.acceptance_per_position)]
    if result.start_acceptance_per_position is not None:
        bars.append(("starting drafter, before your data", result.start_acceptance_per_position))
    if result.untrained_acceptance_per_position is not None:
        bars.append(("untrained drafter", result.untrained_acceptance_per_position))
    width = 0.8 / len(bars)
    for index, (label, values) in enumerate(bars):
        offset = (index - (len(bars) - 1) / 2) * width
        errors = result.acceptance_per_position_standard_error if index == 0 else None
        left.bar([p + offset for p in positions], values, width=width, label=label, yerr=errors, capsize=3)
    if result.expected_acceptance_per_position is not None:
        left.errorbar(
            [p - 0.4 + width / 2 for p in positions],
            result.expected_acceptance_per_position,
            yerr=[
                validation_error(rate, result.validation_positions) for rate in result.expected_acceptance_per_position
            ],
            fmt="k_",
            markersize=18,
            capsize=3,
            label="validation predicts (full_acc)",
        )
    left.set(
        xlabel="draft position",
        ylabel="acceptance rate",
        ylim=(0, 1.05),
        title=f"held-out, k={result.num_speculative_tokens}: acceptance length "
        f"{result.acceptance_length:.2f} of {result.max_acceptance_length}",
    )
    left.set_xticks(list(positions))
    left.legend()
    image = right.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    right.set_yticks(range(len(labels)), labels, fontsize="small")
    right.set_xticks(range(longest), [str(p + 1) for p in range(longest)])
    right.set(xlabel="draft position", title=f"acceptance per set and category, k={longest}")
    for y, values in enumerate(grid):
        for x, value in enumerate(values):
            right.text(x, y, f"{value:.2f}", ha="center", va="center", color="white" if value < 0.6 else "black")
    figure.colorbar(image, ax=right, fraction=0.04)
    save_figure(figure, path)


def plot_speedup(result: EvaluationSummary, path: Path) -> None:
    """Throughput over all sets against concurrency: speedup per draft length (and of each free
    method at its best draft length), and tokens/s."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    temperatures = sorted({r.temperature for r in result.recommendation})
    lengths = sorted({int(k) for r in result.recommendation for k in r.tokens_per_s_by_draft_length})
    methods = sorted({name.split(" k=")[0] for r in result.recommendation for name in r.options})
    methods = [method for method in methods if method not in ("target alone", "drafter")]
    for t_index, value in enumerate(temperatures):
        rows = sorted((r for r in result.recommendation if r.temperature == value), key=lambda r: r.concurrency)
        x = [r.concurrency for r in rows]
        style = "-o" if t_index == 0 else "--s"
        for index, k in enumerate(lengths):
            speeds = [r.tokens_per_s_by_draft_length[str(k)] for r in rows]
            spreads = [r.spread_by_draft_length.get(str(k), 0.0) for r in rows]
            name = f"k={k} {sampling_name(value)}"
            left.plot(
                x,
                [s / r.tokens_per_s_without_drafter for s, r in zip(speeds, rows, strict=True)],
                style,
                color=f"C{index}",
                label=name,
            )
            right.errorbar(x, speeds, yerr=spreads, fmt=style, color=f"C{index}", capsize=3, label=name)
        for index, method in enumerate(methods, start=len(lengths)):
            options = [next(o for n, o in r.options.items() if n.startswith(f"{method} k=")) for r in rows]
            name = f"{method} (best k) {sampling_name(value)}"
            left.plot(x, [o.speedup for o in options], style, color=f"C{index}", label=name)
            right.errorbar(
                x,
                [o.tokens_per_s for o in options],
                yerr=[o.spread for o in options],
                fmt=style,
                color=f"C{index}",
                capsize=3,
                label=name,
            )
        right.errorbar(
            x,
            [r.tokens_per_s_without_drafter for r in rows],
            yerr=[r.tokens_per_s_without_drafter_spread for r in rows],
            fmt=style,
            color="black",
            capsize=3,
            label=f"target alone {sampling_name(value)}",
        )
    left.axhline(1.0, color="grey", linewidth=0.8)
    measured = sorted({r.concurrency for r in result.recommendation})
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(measured, [str(c) for c in measured])
        axis.minorticks_off()
        axis.set_xlabel("concurrency (requests in flight)")
        axis.legend(fontsize="small")
    left.set(ylabel="speedup over the target alone", title="speedup, all sets together")
    right.set(ylabel="output tokens / s (bars: spread)", title="throughput, all sets together")
    save_figure(figure, path)


def tables_html(result: EvaluationSummary) -> str:
    """The recommendation and the per-set results, for the report."""
    recommendation = [
        [
            r.concurrency,
            sampling_name(r.temperature),
            r.serve,
            serve_text(r),
            " · ".join(
                f"{name}: {_plus_minus(o.tokens_per_s, o.spread)}, {o.tokens_per_step:.2f} tok/step"
                for name, o in r.options.items()
            ),
            r.num_speculative_tokens,
            choice_text(r),
            _times(r.speedup),
            _plus_minus(r.tokens_per_s_with_drafter, r.tokens_per_s_with_drafter_spread),
            _plus_minus(r.tokens_per_s_without_drafter, r.tokens_per_s_without_drafter_spread),
            " · ".join(
                f"k={k}: {_plus_minus(speed, r.spread_by_draft_length[k])}, "
                f"AL {r.acceptance_length_by_draft_length[k]:.2f}"
                for k, speed in r.tokens_per_s_by_draft_length.items()
            ),
            json.dumps(r.speculative_config),
        ]
        for r in result.recommendation
    ]
    results = [
        [
            r.set,
            r.category,
            r.method,
            r.num_speculative_tokens,
            r.concurrency,
            sampling_name(r.temperature),
            r.requests,
            f"{r.acceptance_length:.2f}",
            f"{r.tokens_per_step:.2f}",
            " / ".join(
                f"{a:.2f} ± {e:.2f}"
                for a, e in zip(r.acceptance_per_position, r.acceptance_per_position_standard_error, strict=False)
            )
            or " / ".join(f"{a:.2f}" for a in r.acceptance_per_position),
            _expected_text(r),
            _row_speed(r),
            _times(r.speedup),
        ]
        for r in result.results
    ]
    return (
        "<html><head><meta charset='utf-8'><style>table{border-collapse:collapse;font:13px sans-serif}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}</style></head><body>"
        "<h3>What to serve per concurrency (best measured throughput, all sets together)</h3>"
        f"<p>drafter_speculative_config.json holds the choice at concurrency {result.concurrency}, greedy "
        "(null: the target alone). The options are the target alone, the drafter (EAGLE-3) at its best draft "
        "length, and each free method and each other kind of drafter at its best. A speedup below 1× means "
        "the target alone is faster there. "
        "± is the spread of a throughput (two standard errors of its requests' mean speed); where options "
        "are within it of the fastest, the most tokens per target step decides. Tokens per step count "
        "every step, also those where n-gram lookup found nothing to draft.</p>"
        + _table(
            [
                "concurrency",
                "sampling",
                "serve",
                "chosen by",
                "options",
                "drafter's draft length",
                "chosen by",
                "drafter's speedup",
                "drafter tok/s",
                "target alone tok/s",
                "drafter at every draft length",
                "--speculative-config served",
            ],
            recommendation,
        )
        + "<h3>Acceptance per method, set and category</h3><p>Category speeds and speedups are per request."
        " Acceptance length counts the steps that drafted; tokens per step counts them all. What validation"
        " predicts (greedy rows of a trained drafter): speculators' full_acc_i of the published epoch at each"
        " position, and 1 + their sum"
        + (f", on {result.validation_positions:,} validation positions" if result.validation_positions else "")
        + (f". At the headline point, {line}" if (line := gap_line(result)) else "")
        + ".</p>"
        + _table(
            [
                "set",
                "category",
                "method",
                "k",
                "concurrency",
                "sampling",
                "requests",
                "acceptance length (per draft)",
                "tokens per step",
                "per position (± standard error)",
                "validation predicts (AL; per position)",
                "tok/s with",
                "speedup",
            ],
            results,
        )
        + "</body></html>\n"
    )


def validation_error(rate: float, positions: int | None) -> float:
    """The binomial standard error of a validation rate over the split's positions."""
    return (rate * (1 - rate) / positions) ** 0.5 if positions else 0.0


def _expected_text(row: ResultRow) -> str:
    if row.expected_acceptance_per_position is None:
        return ""
    return f"{row.expected_acceptance_length:.2f}; " + " / ".join(
        f"{a:.2f}" for a in row.expected_acceptance_per_position
    )


def gap_line(result: EvaluationSummary) -> str:
    """Expected against served at the headline point, in one line (the diagnosis, when the
    run made one, is eval/gap.json's)."""
    if result.expected_acceptance_per_position is None:
        return ""
    return (
        f"held-out, k={result.num_speculative_tokens}, greedy: validation predicts "
        f"{result.expected_acceptance_length:.2f}, served {result.acceptance_length:.2f}"
    )


def _plus_minus(value: float, spread: float) -> str:
    return f"{value:g} ± {spread:g}"


def _times(speedup: float | None) -> str:
    return f"{speedup:.2f}×" if speedup is not None else ""


def _row_speed(row: SetResult | CategoryResult) -> str:
    """A set's throughput, or a category's per-request speed, with its spread."""
    if isinstance(row, SetResult):
        return _plus_minus(row.tokens_per_s_with_drafter, row.tokens_per_s_with_drafter_spread)
    return _plus_minus(row.request_tokens_per_s_with_drafter, row.request_tokens_per_s_with_drafter_spread)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"
