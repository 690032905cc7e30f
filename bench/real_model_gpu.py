"""The real model at real scale on one GPU: does a drafter trained on thousands of regenerated
conversations beat n-gram lookup and the target alone?

Runs the whole workflow on ``config/smollm2-sharegpt-gpu.yaml`` (SmolLM2-135M-Instruct from its
GGUF, 6,144 ShareGPT V3 first turns answered again by the target, HumanEval as a second set)
and records, from the run's own files:
- the questions stage's counts, wall seconds per heavy job (Snakemake's benchmark records),
  tokens/s of generation and of training;
- the drafter's validation metrics per epoch;
- per draft length k, concurrency, method and set (greedy): acceptance length, tokens per
  target step and tokens/s of the drafter, n-gram lookup and the target alone;
- CUDA parity of the stored hidden states against Hugging Face's forward on the GPU at the
  configured layers, for rows the run captured in one pass and for rows its extraction stage
  prefilled (when one pass captured every row: rows of a second, small run with a separate
  extraction that shares the target), with the neighbouring layers' distance;
- the recommendation the run made.

    python bench/real_model_gpu.py [--draft-lengths 3] [--epochs 2] [--parity-rows 8] [--config FILE]

``--config`` runs another config of the same shape (a CPU rehearsal of the bench at a tiny size).

Each part is a plain Snakemake run, so an interrupted bench resumes where it stopped (the
GPU set-up to run it on a machine without a package index: docs/gpu.md).
"""

import argparse
import csv
import json
import sys
from pathlib import Path

import yaml
from real_model import per_set, snakemake
from results_file import RESULTS, write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow"))
from draftsmith import vllm_build  # noqa: E402
from draftsmith.layout import HIDDEN_STATE_GLOB, Layout, hidden_state_file, hidden_state_row  # noqa: E402
from draftsmith.one_pass import ADOPTED, CUT, CaptureOutcomes  # noqa: E402
from draftsmith.records import EvaluationSummary, TrainingMetrics  # noqa: E402

CONFIG = ROOT / "config/smollm2-sharegpt-gpu.yaml"


def job_seconds(layout: Layout) -> dict[str, float]:
    """Wall seconds of each heavy job, from Snakemake's benchmark records."""
    seconds = {}
    for record in sorted((layout.results / "benchmarks").rglob("*.tsv")):
        with record.open() as handle:
            row = next(csv.DictReader(handle, delimiter="\t"))
        seconds[str(record.relative_to(layout.results / "benchmarks").with_suffix(""))] = round(float(row["s"]), 1)
    return seconds


def evaluations(config: dict, layout: Layout) -> dict:
    """k -> concurrency -> method -> set -> acceptance, tokens per step and tokens/s (greedy);
    a method the run has not measured yet is None."""

    def measured(path: Path, k: int, concurrency: int) -> dict | None:
        return per_set(path, k, concurrency) if path.is_file() else None

    found: dict = {}
    for k in config["evaluation"]["num_speculative_tokens"]:
        for concurrency in config["evaluation"]["concurrency"]:
            methods = {"target_alone": measured(layout.baseline_measurement, 0, concurrency)}
            methods["drafter"] = measured(layout.drafter_measurement(k), k, concurrency)
            for method in config["evaluation"]["free_methods"]:
                methods[method] = measured(layout.free_method_measurement(method, k), k, concurrency)
            found.setdefault(str(k), {})[str(concurrency)] = methods
    return found


def measured_so_far(config: dict, layout: Layout) -> dict:
    """What the run's own files hold, finished or not: the questions stage's account, seconds
    per heavy job, validation per epoch and the greedy measurements (None where not yet made).
    A run that did not end (the GPU machine's session ran out) is read from the partial.tgz
    `tools/gpu/session.sh` brings back, unpacked as ``layout.results``."""
    metrics = TrainingMetrics.read(layout.drafter) if layout.training_metrics.is_file() else None
    return {
        "questions": json.loads(layout.questions_summary.read_text()),
        "epochs": config["training"]["epochs"],
        "job_seconds": job_seconds(layout),
        "validation": [{"epoch": e["epoch"], **e.get("val", {})} for e in metrics.epochs] if metrics else None,
        "published_epoch": metrics.published_epoch if metrics else None,
        "greedy": evaluations(config, layout),
    }


def rows_by_capture(layout: Layout) -> dict[str, list[Path]]:
    """The published files of the rows generation captured (``one_pass``) and of those the
    extraction stage prefilled (``extraction``), from each shard's one-pass outcomes (a
    separate capture has none: every row was prefilled)."""
    groups: dict[str, list[Path]] = {"one_pass": [], "extraction": []}
    for shard in layout.extracted_shards():
        outcomes = CaptureOutcomes(layout.staging_for("hidden_states", shard.name.removeprefix("shard_")))
        if not outcomes.rows:
            groups["extraction"] += sorted(shard.glob(HIDDEN_STATE_GLOB), key=hidden_state_row)
        for row, outcome in sorted(outcomes.rows.items()):
            groups["one_pass" if outcome in (ADOPTED, CUT) else "extraction"].append(hidden_state_file(shard, row))
    return groups


def parity(groups: dict[str, list[Path]], target: Path, layers: list[int]) -> dict[str, dict]:
    """Per group of files: stored states against Hugging Face's fp32 forward on the GPU.

    vLLM serves in bf16, so a stored state differs from the fp32 forward by bf16 kernel
    rounding; the floor is Hugging Face's own bf16 forward against its fp32 one on the same
    tokens. Per layer: the median token error (relative L2) of the stored states, of the
    floor, and of the nearest wrong candidate (the layer before or after, or the post-norm
    state for the last layer). A correct layer sits near its floor; a wrong one far above.
    The two models load once for every group."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = {
        dtype: AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
        for dtype in (torch.float32, torch.bfloat16)
    }
    last = models[torch.float32].config.num_hidden_layers - 1

    def states(dtype, token_ids: list[int]) -> list[torch.Tensor]:
        captured = []
        model = models[dtype]
        hook = model.model.layers[-1].register_forward_hook(
            lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out)
        )
        with torch.no_grad():
            out = model(torch.tensor([token_ids], device=device), output_hidden_states=True)
        hook.remove()
        return [s[0].float() for s in out.hidden_states] + [captured[0][0].float()]

    def errors(got, want):
        return (got - want).norm(dim=-1) / want.norm(dim=-1)

    def of_files(files: list[Path]) -> dict:
        per_layer: dict[int, dict[str, list]] = {layer: {"stored": [], "floor": [], "wrong": []} for layer in layers}
        tokens = 0
        for path in files:
            stored = load_file(path)
            token_ids = stored["token_ids"].tolist()
            tokens += len(token_ids)
            exact, rounded = states(torch.float32, token_ids), states(torch.bfloat16, token_ids)
            for index, layer in enumerate(layers):
                want = exact[-1] if layer == last else exact[layer + 1]
                got = stored["hidden_states"][:, index, :].float().to(device)
                floor_state = rounded[-1] if layer == last else rounded[layer + 1]
                wrongs = [exact[layer], exact[-2]] if layer == last else [exact[layer], exact[layer + 2]]
                per_layer[layer]["stored"].append(errors(got, want))
                per_layer[layer]["floor"].append(errors(floor_state, want))
                per_layer[layer]["wrong"].append(torch.stack([errors(got, w) for w in wrongs]).min(dim=0).values)
        result = {"rows": len(files), "tokens": tokens, "layers": {}}
        for layer, found in per_layer.items():
            medians = {name: round(torch.cat(values).median().item(), 5) for name, values in found.items()}
            medians["stored_max"] = round(torch.cat(found["stored"]).max().item(), 5)
            medians["holds"] = medians["stored"] <= 2 * medians["floor"] + 0.01 < medians["wrong"]
            result["layers"][str(layer)] = medians
        return result

    return {name: of_files(files) for name, files in groups.items()}


def separate_extraction_config(config: dict, work: Path) -> dict:
    """A small run of the same target with a separate extraction: its rows prefilled anew."""
    small = json.loads(json.dumps(config))
    small["results_dir"] = str(work / "separate_extraction")
    small["target"]["model"] = config["target"]["model"]
    small["questions"] |= {"limit": 24, "heldout": 8}
    small["generation"]["max_tokens"] = 128
    small["hidden_states"] = {"capture": "separate"}
    return small


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-lengths", type=int, nargs="+", help="evaluate only these k (default: the config's)")
    parser.add_argument("--parity-rows", type=int, default=8)
    parser.add_argument("--epochs", type=int, help="train this many epochs (default: the config's)")
    parser.add_argument("--work", type=Path, default=ROOT / "results/bench_real_model_gpu")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--name", default="real_model_gpu", help="the results file's name")
    parser.add_argument(
        "--partial", type=Path, help="only summarize an unfinished run's results_dir (unpacked partial.tgz)"
    )
    parser.add_argument("--parity", type=Path, help="with --partial: the parity.json the session brought back")
    parser.add_argument("--note", help="with --partial: what the session did differently, in words")
    parser.add_argument(
        "--without-drafter",
        action="store_true",
        help="measure only n-gram lookup and the target alone (no generation, extraction or training):"
        " a session with little device time; summarize it with --partial",
    )
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())
    if args.draft_lengths:
        config["evaluation"]["num_speculative_tokens"] = args.draft_lengths
    if args.epochs:
        config["training"]["epochs"] = args.epochs
    if args.partial:
        partial = {"config": shown(args.config), "complete": False, "note": args.note}
        partial |= measured_so_far(config, Layout(args.partial))
        if args.parity:
            partial["parity"] = json.loads(args.parity.read_text())
        write_result(args.name, partial)
        plot(partial, RESULTS / f"{args.name}.png")
        return
    import torch

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    layout = Layout(config["results_dir"])
    separate = separate_extraction_config(config, work)
    separate_layout = Layout(separate["results_dir"])
    layers, target = config["layers"], ROOT / config["target"]["model"]
    draft_lengths, free_methods = config["evaluation"]["num_speculative_tokens"], config["evaluation"]["free_methods"]

    def free_measurements(lengths: list[int]) -> tuple[str, ...]:
        return tuple(str(layout.free_method_measurement(method, k)) for method in free_methods for k in lengths)

    free_first = free_measurements(draft_lengths)
    if args.without_drafter:
        # The free methods at the first draft length and the target alone, then the other lengths.
        first = (*free_measurements(draft_lengths[:1]), str(layout.baseline_measurement))
        snakemake(config, "main", work, first, gpus=config["gpu_slot"])
        snakemake(config, "main", work, free_first, gpus=config["gpu_slot"])
        return
    # Parity first, as soon as the hidden states are published: a session that runs out of
    # device time during training or evaluation still brings it back (work/parity.json).
    wall = {"to_hidden_states": snakemake(config, "main", work, (str(layout.training_view),), gpus=config["gpu_slot"])}
    groups = rows_by_capture(layout)
    chosen = {name: files[: args.parity_rows] for name, files in groups.items() if files}
    found_parity = parity(chosen, target, layers)
    (work / "parity.json").write_text(json.dumps(found_parity, indent=2) + "\n")
    # The drafter's own measurement next: what a session short of device time most needs.
    drafter_first = tuple(str(layout.drafter_measurement(k)) for k in draft_lengths)
    wall["to_drafter_measurement"] = snakemake(config, "main", work, drafter_first, gpus=config["gpu_slot"])
    # Then what it must beat in tokens a step, n-gram lookup, before the target alone.
    if free_first:
        wall["to_free_measurement"] = snakemake(config, "main", work, free_first, gpus=config["gpu_slot"])
    wall["main"] = snakemake(config, "main", work, gpus=config["gpu_slot"])
    measured = measured_so_far(config, layout)
    seconds = measured["job_seconds"]
    from datasets import load_from_disk

    rows = load_from_disk(str(layout.dataset)).with_format(None)
    answer_tokens = sum(sum(mask) for mask in rows["loss_mask"])
    row_tokens = sum(rows["seq_len"])
    generate_s = sum(s for name, s in seconds.items() if name.startswith("generate"))
    train_s = seconds.get("train", 0.0)
    result = {
        "config": shown(args.config),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "vllm": str(vllm_build.installed_version()),
        "torch": torch.__version__,
        "wall_s_this_call": wall,
        "complete": True,
        **measured,
        "training_rows": len(rows),
        "row_tokens": row_tokens,
        "answer_tokens": answer_tokens,
        "generation_answer_tokens_per_s": round(answer_tokens / generate_s, 1) if generate_s else None,
        "training_tokens_per_s": round(row_tokens * config["training"]["epochs"] / train_s, 1) if train_s else None,
        "recommendation": EvaluationSummary.read(layout.acceptance).to_dict()["recommendation"],
    }
    result["parity"] = found_parity
    result["extraction_parity_rows"] = "prefilled by this run's extraction stage" if chosen.get("extraction") else None
    record(result, args.name, work)
    if not groups["extraction"]:
        # One pass captured every row: extraction's parity from a small run of its own, after
        # the main run (vLLM's memory profiling fails a server whose start overlaps another
        # server's exit on the same GPU).
        wall["separate_extraction"] = snakemake(
            separate, "separate_extraction", work, (str(separate_layout.training_view),), gpus=separate["gpu_slot"]
        )
        files = separate_layout.hidden_state_files()[: args.parity_rows]
        result["parity"] |= parity({"extraction": files}, target, layers)
        result["extraction_parity_rows"] = "a separate run's extraction (one pass captured every row)"
        record(result, args.name, work)


def plot(result: dict, path: Path) -> None:
    """Per draft length: tokens/s (bars) and tokens a target step (labels) of each method
    measured, per set and concurrency; a method not yet measured is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (k, concurrency, methods)
        for k, by_concurrency in sorted(result["greedy"].items(), key=lambda item: int(item[0]))
        for concurrency, methods in sorted(by_concurrency.items(), key=lambda item: int(item[0]))
    ]
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for axis, (k, concurrency, methods) in zip(axes[0], panels, strict=True):
        measured = {method: sets for method, sets in methods.items() if sets}
        names = sorted({name for sets in measured.values() for name in sets})
        width = 0.8 / max(len(measured), 1)
        for offset, (method, sets) in enumerate(measured.items()):
            present = [(i, sets[name]) for i, name in enumerate(names) if name in sets]
            xs = [i + offset * width for i, _ in present]
            bars = axis.bar(xs, [one["tokens_per_s"] for _, one in present], width, label=method)
            steps = [one.get("tokens_per_step") for _, one in present]
            axis.bar_label(bars, labels=[f"{s:.2f}/step" if s else "" for s in steps], fontsize=8)
        axis.set_xticks([i + width * (len(measured) - 1) / 2 for i in range(len(names))], labels=names)
        axis.set_title(f"k={k}, concurrency {concurrency}, greedy")
        axis.set_ylabel("tokens/s")
        axis.margins(y=0.2)  # room for the legend above the bars
        axis.legend(ncol=len(measured), loc="upper center", fontsize=8)
    figure.tight_layout()
    figure.savefig(path)


def shown(config: Path) -> str:
    """The config's path as results files name it: from the repository's root when inside it."""
    config = config.resolve()
    return str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config)


def record(result: dict, name: str, work: Path) -> None:
    write_result(name, result)
    # Beside the run too: on a borrowed machine the repository's new files may not outlive a call.
    (work / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / f"{name}.png")


if __name__ == "__main__":
    main()
