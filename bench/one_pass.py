"""One pass against a separate extraction, on the demo: what capturing the hidden states
while generating saves, and whether the drafter stays as good.

Runs the whole workflow on ``config/config.yaml`` twice, each in its own results directory
under ``--work``, with one shared target (built by the first run): once with
``hidden_states.capture: separate`` and once with ``during_generation``; nothing else
differs. Recorded per run, from the run's own files:
- wall seconds of generation and of extraction (Snakemake's benchmark files) and their sum;
- model loads of the two stages (servers their logs started);
- hidden-state bytes written (the extraction's shards, or the captured files) and the
  generation's answer tokens/s (does saving states slow decoding?);
- rows adopted from generation or requested by prefill, by reason (the shard's manifest);
- the drafter's acceptance length (greedy, the config's default draft length) and the
  first-position validation accuracy of its last epoch.

With ``--real-model N`` it also runs ``config/smollm2-sharegpt.yaml`` in one pass for N
training questions up to the extraction (the real model on ShareGPT, ChatML special tokens;
`make real-data` first, and the target converted by ``bench/real_model.py``) and records how
many of its rows matched their captured ids.

    python bench/one_pass.py [--work results/bench_one_pass] [--real-model 60]

Each run is a plain Snakemake run, so an interrupted bench resumes where it stopped.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml
from results_file import RESULTS, write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow"))
from draftsmith.layout import Layout  # noqa: E402
from draftsmith.records import EvaluationSummary, ShardManifest, TrainingMetrics  # noqa: E402

CONFIG = ROOT / "config/config.yaml"
MODES = ("separate", "during_generation")


def mode_config(base: dict, mode: str, work: Path) -> dict:
    config = json.loads(json.dumps(base))
    config["results_dir"] = str(work / mode)
    config["target"]["model"] = str(work / "target")
    config["target"]["build_demo"] = mode == MODES[0]  # the first run builds it, the second reads it
    config["hidden_states"] = {**config.get("hidden_states", {}), "capture": mode}
    return config


def run(config: dict, mode: str, work: Path, cores: str) -> None:
    config_path = work / f"{mode}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    with (work / f"{mode}.snakemake.log").open("a") as log:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "snakemake",
                "--cores",
                cores,
                "--resources",
                "gpu=8",
                "--configfile",
                str(config_path),
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if done.returncode != 0:
        raise SystemExit(f"the {mode} run failed; see {work / f'{mode}.snakemake.log'}")


def benchmark_seconds(path: Path) -> float:
    lines = path.read_text().splitlines() if path.is_file() else []
    return float(lines[1].split("\t")[0]) if len(lines) > 1 else 0.0


def servers_started(logs: list[Path]) -> int:
    return sum(log.read_text(errors="replace").count("starting vLLM for") for log in logs if log.is_file())


def measured(config: dict) -> dict:
    layout = Layout(config["results_dir"])
    generation = [benchmark_seconds(p) for p in sorted((layout.results / "benchmarks/generate").glob("*.tsv"))]
    extraction = [benchmark_seconds(p) for p in sorted((layout.results / "benchmarks/extract").glob("*.tsv"))]
    manifests = [ShardManifest.read(shard) for shard in layout.extracted_shards()]
    summaries = [
        json.loads(p.read_text()) for p in sorted(layout.staging_for("completions").glob("shard_*/summary.json"))
    ]
    captured_bytes = sum((s.get("states_captured") or {}).get("bytes", 0) for s in summaries)
    answer_tokens = 0
    for shard in layout.completion_shards():
        answer_tokens += sum(json.loads(line)["completion_tokens"] for line in shard.read_text().splitlines())
    outcomes: dict[str, int] = {}
    for manifest in manifests:
        for outcome, n in (manifest.captured_during_generation or {}).items():
            outcomes[outcome] = outcomes.get(outcome, 0) + n
    metrics = TrainingMetrics.read(layout.drafter)
    last = metrics.epochs[-1]["val"] if metrics.epochs else {}
    return {
        "generation_s": round(sum(generation), 1),
        "extraction_s": round(sum(extraction), 1),
        "generation_plus_extraction_s": round(sum(generation) + sum(extraction), 1),
        "model_loads": {
            "generation": servers_started(sorted((layout.logs / "generate").glob("*.log"))),
            "extraction": servers_started(sorted((layout.logs / "extract").glob("*.log"))),
        },
        "answer_tokens": answer_tokens,
        "answer_tokens_per_s_with_load": round(answer_tokens / sum(generation), 1) if generation else None,
        "hidden_state_bytes_written": captured_bytes or sum(m.bytes for m in manifests if m),
        "rows": sum(m.num_rows for m in manifests if m),
        "rows_by_source": outcomes
        or {"requested by prefill (separate extraction)": sum(m.num_rows for m in manifests)},
        "acceptance_length": EvaluationSummary.read(layout.acceptance).acceptance_length,
        "validation": {key: value for key, value in last.items() if "0" in key or "acc" in key},
    }


REAL_CONFIG = ROOT / "config/smollm2-sharegpt.yaml"
REAL_TARGET = ROOT / "results/bench_real_model/target"  # bench/real_model.py converts it once


def real_model_rows(questions: int, work: Path, cores: str) -> dict:
    """The real model in one pass up to the extraction: answers captured, rows adopted or
    requested by prefill (and why), and the generation's seconds and loads."""
    config = yaml.safe_load(REAL_CONFIG.read_text())
    config["results_dir"] = str(work / "smollm2")
    config["target"] = {"model": str(REAL_TARGET)}
    config["questions"]["limit"] = questions + config["questions"]["heldout"]
    config["hidden_states"] = {"capture": "during_generation"}
    config_path = work / "smollm2.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    layout = Layout(config["results_dir"])
    targets = [str(layout.hidden_state_shard(shard)) for shard in range(config["extraction"]["shards"])]
    with (work / "smollm2.snakemake.log").open("a") as log:
        done = subprocess.run(
            [sys.executable, "-m", "snakemake", *targets, "--cores", cores, "--resources", "gpu=8"]
            + ["--configfile", str(config_path)],  # last: it takes every value after it
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if done.returncode != 0:
        raise SystemExit(f"the real-model run failed; see {work / 'smollm2.snakemake.log'}")
    manifests = [ShardManifest.read(shard) for shard in layout.extracted_shards()]
    summaries = [json.loads(p.read_text()) for p in layout.staging_for("completions").glob("shard_*/summary.json")]
    outcomes: dict[str, int] = {}
    for manifest in manifests:
        for outcome, n in (manifest.captured_during_generation or {}).items():
            outcomes[outcome] = outcomes.get(outcome, 0) + n
    return {
        "config": str(REAL_CONFIG.relative_to(ROOT)),
        "training_questions": questions,
        "answers": sum(s["answered"] for s in summaries),
        "answers_with_states": sum(s["states_captured"]["answers"] for s in summaries),
        "rows": sum(m.num_rows for m in manifests if m),
        "rows_by_source": outcomes,
        "generation_s": round(
            sum(benchmark_seconds(p) for p in (layout.results / "benchmarks/generate").glob("*.tsv")), 1
        ),
        "extraction_servers_started": servers_started(sorted((layout.logs / "extract").glob("*.log"))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=ROOT / "results/bench_one_pass")
    parser.add_argument("--cores", default="all")
    parser.add_argument("--real-model", type=int, default=0, help="training questions of the real-model run")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(CONFIG.read_text())
    runs = {}
    for mode in MODES:
        config = mode_config(base, mode, args.work)
        run(config, mode, args.work, args.cores)  # a finished run is not run again
        runs[mode] = measured(config)
        print(json.dumps({mode: runs[mode]}, indent=1), flush=True)
    separate, one_pass = runs["separate"], runs["during_generation"]
    real = real_model_rows(args.real_model, args.work, args.cores) if args.real_model else None
    write_result(
        "one_pass",
        {
            "config": str(CONFIG.relative_to(ROOT)),
            "runs": runs,
            "real_model": real,
            "saved_s": round(separate["generation_plus_extraction_s"] - one_pass["generation_plus_extraction_s"], 1),
            "loads_saved": sum(separate["model_loads"].values()) - sum(one_pass["model_loads"].values()),
            "acceptance_difference": round(one_pass["acceptance_length"] - separate["acceptance_length"], 4),
        },
    )
    print(f"written to {RESULTS / 'one_pass.json'}")


if __name__ == "__main__":
    main()
