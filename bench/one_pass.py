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

    python bench/one_pass.py [--work results/bench_one_pass]

Each run is a plain Snakemake run, so an interrupted bench resumes where it stopped.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml
from results_file import RESULTS, write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow"))
from draftsmith.layout import Layout  # noqa: E402
from draftsmith.records import ShardManifest, TrainingMetrics  # noqa: E402

CONFIG = ROOT / "config/config.yaml"
MODES = ("separate", "during_generation")


def mode_config(base: dict, mode: str, work: Path) -> dict:
    config = json.loads(json.dumps(base))
    config["results_dir"] = str(work / mode)
    config["target"]["model"] = str(work / "target")
    config["target"]["build_demo"] = mode == MODES[0]  # the first run builds it, the second reads it
    config["hidden_states"] = {**config.get("hidden_states", {}), "capture": mode}
    return config


def run(config: dict, mode: str, work: Path, cores: str) -> float:
    config_path = work / f"{mode}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.monotonic()
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
    return round(time.monotonic() - started, 1)


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
    acceptance = json.loads(layout.acceptance.read_text())
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
        "acceptance_length": acceptance["acceptance_length"],
        "validation": {key: value for key, value in last.items() if "0" in key or "acc" in key},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=ROOT / "results/bench_one_pass")
    parser.add_argument("--cores", default="all")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(CONFIG.read_text())
    runs = {}
    for mode in MODES:
        config = mode_config(base, mode, args.work)
        wall = run(config, mode, args.work, args.cores)
        runs[mode] = {"wall_s_this_call": wall, **measured(config)}
        print(json.dumps({mode: runs[mode]}, indent=1), flush=True)
    separate, one_pass = runs["separate"], runs["during_generation"]
    write_result(
        "one_pass",
        {
            "config": str(CONFIG.relative_to(ROOT)),
            "runs": runs,
            "saved_s": round(separate["generation_plus_extraction_s"] - one_pass["generation_plus_extraction_s"], 1),
            "loads_saved": sum(separate["model_loads"].values()) - sum(one_pass["model_loads"].values()),
            "acceptance_difference": round(one_pass["acceptance_length"] - separate["acceptance_length"], 4),
        },
    )
    print(f"written to {RESULTS / 'one_pass.json'}")


if __name__ == "__main__":
    main()
