"""Benchmark the training stage (`speculators train` as draftsmith.train runs it) on one GPU.

    python bench/train_gpu/bench.py run --data DIR --out DIR [--runs a,b,a,b] [--budget-s S]
    python bench/train_gpu/bench.py summarize RESULTS.jsonl... --json FILE --md FILE

`run` measures the GPU's bf16 matmul peak, then launches one trainer process per entry of
--runs (names from CONFIGS; repeat names to interleave repetitions) on the synthetic data
of make_synthetic.py, and appends one JSON line per run to OUT/results.jsonl. Each run
gets exactly the arguments of the training stage (draftsmith.train.speculators_args) plus
its config's flags, appended the way `training.extra_args` appends them (last one wins).

FLOPs counted per real (non-padding) token, for the drafter of ttt_steps (3) unrolled
steps, each running the decoder layer(s) and the draft LM head:
    matmuls  = ttt * 6 * (P_layers + H * Vd)     trainable: forward 2x, backward 4x
             + 4 * A * H * H                     fc: forward + weight gradient only
             + 2 * H * Vd                        frozen verifier head: forward only
    P_layer  = in * (heads + 2 * kv_heads) * head_dim + heads * head_dim * H + 3 * H * I
               (in = 2H for the first layer: it reads cat(embeddings, hidden))
    attention = layers * 12 * heads * head_dim * keys   (QK^T and PV, forward + 2x backward)
where keys are the ones the mask allows (causal sliding window inside the document plus
the draft diagonal), summed over the TTT steps, counted on the actual batches. Embedding
lookups, norms, the loss and the optimizer are not model FLOPs; Muon's Newton-Schulz
matmuls are reported separately (hfu_with_muon).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow"))

# name: (total_seq_len, flags for training.extra_args, extra environment)
FLEX = ["--draft-attn-impl", "simple_flex_attention"]
WORKERS = ["--num-workers", "4", "--prefetch-factor", "2"]
CONFIGS: dict[str, tuple[int, list[str], dict[str, str]]] = {
    "default": (8192, [], {}),
    "seq16k": (16384, [], {}),
    "seq32k": (32768, [], {}),
    "flex": (8192, FLEX, {}),
    "flex_seq16k": (16384, FLEX, {}),
    "flex_seq32k": (32768, FLEX, {}),
    "flex_seq64k": (65536, FLEX, {}),
    "fused_loss": (8192, ["--loss-implementation", "fused"], {}),
    "adamw": (8192, ["--optimizer", "adamw"], {}),
    "workers4": (8192, WORKERS, {}),
    "log_freq50": (8192, ["--log-freq", "50"], {}),
    "flex_seq32k_w4_log50": (32768, [*FLEX, *WORKERS, "--log-freq", "50"], {}),
    "flex_seq64k_w4_log50": (65536, [*FLEX, *WORKERS, "--log-freq", "50"], {}),
}
WARMUP = 3  # step 1 compiles; steps 2-3 settle the allocator and any recompile
MEASURE = {8192: 20, 16384: 12, 32768: 8, 65536: 5}


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def matmul_peak_tflops(n: int = 8192, reps: int = 20, trials: int = 3) -> float:
    """Best of `trials` means of `reps` bf16 n^3 matmuls on random data, in TFLOP/s."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    best = 0.0
    for _ in range(trials):
        for _ in range(5):
            a @ b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            a @ b
        end.record()
        end.synchronize()
        best = max(best, 2 * n**3 * reps / (start.elapsed_time(end) / 1000) / 1e12)
    del a, b
    torch.cuda.empty_cache()
    return best


def stage_argv(data: Path, save: Path, total_seq_len: int, extra: list[str]) -> list[str]:
    """The training stage's `speculators train` arguments for the Kimi example."""
    from draftsmith.layers import resolve_layers
    from draftsmith.layout import TrainPaths
    from draftsmith.train import speculators_args

    settings = {
        "target": {"model": str(data / "verifier"), "trust_remote_code": False},
        "training": {
            "draft_vocab_size": 32000,
            "num_layers": 1,
            "epochs": 1,
            "lr": 0.0001,
            "total_seq_len": total_seq_len,
            "seed": 0,
            "extra_args": extra,
        },
    }
    paths = TrainPaths(data / "dataset", data / "hidden_states", save, save)
    return speculators_args(settings, resolve_layers([2, 30, 58, 60], 61), paths)


def stop_tree(process: subprocess.Popen) -> None:
    """Kill torchrun and its trainer. The trainer runs in a session of its own, and after
    a CUDA OOM it was seen to print its traceback and stay alive, holding the GPU."""
    import psutil

    children = psutil.Process(process.pid).children(recursive=True)
    os.killpg(process.pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    process.wait()


def run_one(name: str, data: Path, work: Path, timeout: float) -> dict:
    total_seq_len, extra, env_extra = CONFIGS[name]
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    steps = WARMUP + MEASURE[total_seq_len]
    argv = stage_argv(data, work / "save", total_seq_len, extra)
    # --mask-token-id: the synthetic verifier has no tokenizer to resolve it from.
    argv += ["--max-steps", str(steps), "--mask-token-id", "0"]
    env = {
        **os.environ,
        **env_extra,
        "COLUMNS": "200",
        "BENCH_WARMUP": str(WARMUP),
        "BENCH_RESULT": str(work / "result.json"),
        "DRAFTSMITH_METRICS_FILE": str(work / "metrics.jsonl"),
        "PYTHONPATH": os.pathsep.join([str(REPO / "workflow"), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        str(REPO / "bench/train_gpu/timed_train.py"),
        *argv,
    ]
    record = {"name": name, "total_seq_len": total_seq_len, "extra_args": extra, "env": env_extra}
    started = time.perf_counter()
    with open(work / "log.txt", "w") as log:
        # Own process group: on a timeout torchrun and its trainer go together.
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_tree(process)
            code = "timeout"
    record["wall_s"] = time.perf_counter() - started
    result_file = work / "result.json"
    if code == 0 and result_file.is_file():
        record["status"] = "ok"
        record.update(json.loads(result_file.read_text()))
        record["profile"] = step_profile(work / "metrics.jsonl")
    else:
        record["status"] = f"failed ({code})"
        lines = (work / "log.txt").read_text(errors="replace").splitlines()
        # The child's own exception lines, not torchrun's ChildFailedError summary.
        errors = [
            line
            for line in lines
            if re.search(r"\w(Error|Exception|Unsupported)\b", line)
            and "ChildFailedError" not in line
            and "elastic" not in line
        ]
        record["errors"] = [line[:300] for line in errors[-5:]]
        record["error_tail"] = [line[:300] for line in lines[-25:]]
    return record


def step_profile(metrics: Path) -> dict:
    """Medians of speculators' own per-step timings (fwd/bwd/opt/fetch, synchronized)
    over the measured steps; logged only on log_freq steps."""
    if not metrics.is_file():
        return {}
    profiles = [
        r["profile"]
        for r in map(json.loads, metrics.read_text().splitlines())
        if r.get("profile") and r["global_step"] >= WARMUP
    ]
    keys = ("fetch_ms", "fwd_ms", "bwd_ms", "opt_ms", "step_ms")
    return {k: statistics.median(p[k] for p in profiles) for k in keys} if profiles else {}


def command_run(args: argparse.Namespace) -> None:
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    began = time.perf_counter()
    peak = matmul_peak_tflops()
    device = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(f"{device['gpu']}: bf16 matmul peak {peak:.0f} TFLOP/s", flush=True)
    walls: dict[str, float] = {}  # seconds a config's last run took, start-up included
    for i, name in enumerate(args.runs.split(",")):
        left = args.budget_s - (time.perf_counter() - began)
        same_length = [w for n, w in walls.items() if CONFIGS[n][0] == CONFIGS[name][0]]
        expected = walls.get(name) or max(same_length, default=args.expect_s)
        if expected > left:
            print(f"skip {name}: {left:.0f} s left, expects {expected:.0f} s", flush=True)
            continue
        timeout = min(left, args.run_timeout_s)
        record = run_one(name, args.data, args.work / f"{i:02d}-{name}", timeout)
        walls[name] = record["wall_s"]
        record.update(device, run_index=i, peak_tflops=peak, tag=args.tag)
        with results.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        rate = record.get("tokens", 0) / record.get("seconds", 1)
        print(
            f"{name}: {record['status']} {rate:,.0f} tok/s, "
            f"{record.get('peak_reserved_gib', 0):.1f} GiB reserved, wall {record['wall_s']:.0f} s",
            flush=True,
        )
        if record["status"] != "ok":
            print("\n".join(record["errors"] + record["error_tail"][-10:]), flush=True)
    end_peak = matmul_peak_tflops()
    with results.open("a") as handle:
        handle.write(json.dumps({"name": "_matmul_peak", "start": peak, "end": end_peak, **device}) + "\n")
    print(f"matmul peak at the end: {end_peak:.0f} TFLOP/s", flush=True)


# ---------------------------------------------------------------------------------------------
# Summarizing
# ---------------------------------------------------------------------------------------------


def flops_per_token(shape: dict, ttt: int) -> float:
    """Matmul model FLOPs per real token (module docstring)."""
    h, d, heads, kv = shape["hidden"], shape["head_dim"], shape["heads"], shape["kv_heads"]
    layers = [
        (2 * h if i == 0 else h) * (heads + 2 * kv) * d + heads * d * h + 3 * h * shape["intermediate"]
        for i in range(shape["layers"])
    ]
    vocab = shape["draft_vocab"]
    return ttt * 6 * (sum(layers) + h * vocab) + 4 * shape["aux_layers"] * h * h + 2 * h * vocab


def derive(record: dict, peak: float) -> dict:
    shape = record["shape"]
    per_token = flops_per_token(shape, record["ttt_steps"])
    attention = shape["layers"] * 12 * shape["heads"] * shape["head_dim"] * record["attention_keys"]
    model_flops = record["tokens"] * per_token + attention
    seconds = record["seconds"]
    muon = record["muon_flops_per_step"] * record["measured_steps"]
    return {
        "tokens_per_s": record["tokens"] / seconds,
        "step_ms": 1000 * seconds / record["measured_steps"],
        "fill": record["tokens"] / record["capacity_tokens"],
        "model_tflops_per_token": per_token / 1e12,
        "attention_share": attention / model_flops,
        "mfu": model_flops / seconds / 1e12 / peak,
        "hfu_with_muon": (model_flops + muon) / seconds / 1e12 / peak,
    }


def command_summarize(args: argparse.Namespace) -> None:
    records = [json.loads(line) for path in args.results for line in path.read_text().splitlines()]
    peaks = [r for r in records if r["name"] == "_matmul_peak"]
    peak = max(max(p["start"], p["end"]) for p in peaks)
    runs = [r for r in records if r["name"] != "_matmul_peak"]
    by_name: dict[str, list[dict]] = {}
    for r in runs:
        by_name.setdefault(r["name"], []).append(r)
    rows = []
    for name, reps in by_name.items():
        ok = [r for r in reps if r["status"] == "ok"]
        row = {
            "name": name,
            "total_seq_len": reps[0]["total_seq_len"],
            "extra_args": reps[0]["extra_args"],
            "env": reps[0]["env"],
            "runs": len(reps),
            "ok": len(ok),
        }
        if not ok:
            row["error"] = (reps[0]["errors"] or reps[0]["error_tail"])[-1].strip()
            rows.append(row)
            continue
        derived = [derive(r, peak) for r in ok]
        for key in derived[0]:
            row[key] = statistics.median(d[key] for d in derived)
        rates = [d["tokens_per_s"] for d in derived]
        row.update(
            tokens_per_s_min=min(rates),
            tokens_per_s_max=max(rates),
            peak_allocated_gib=max(r["peak_allocated_gib"] for r in ok),
            peak_reserved_gib=max(r["peak_reserved_gib"] for r in ok),
            first_step_s=statistics.median(r["first_step_s"] for r in ok),
            profile=ok[0]["profile"],
            shape=ok[0]["shape"],
        )
        rows.append(row)
    rows.sort(key=lambda row: list(CONFIGS).index(row["name"]))
    base = next((r["tokens_per_s"] for r in rows if r["name"] == "default" and r["ok"]), None)
    for row in rows:
        if base and row.get("tokens_per_s"):
            row["speedup"] = row["tokens_per_s"] / base
    summary = {
        "gpu": peaks[0]["gpu"],
        "torch": peaks[0]["torch"],
        "matmul_peak_tflops": peak,
        "matmul_peaks": [[p["start"], p["end"]] for p in peaks],
        "configs": rows,
        "runs": runs,
    }
    for r in runs:
        r.pop("error_tail", None)  # the exception lines stay in "errors"
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    # Hand-written notes below NOTES in an existing file survive a re-summary.
    old = args.md.read_text() if args.md.is_file() else ""
    notes = old[old.index(NOTES) :] if NOTES in old else NOTES + "\n"
    args.md.write_text(markdown(summary) + "\n\n" + notes)


NOTES = "<!-- notes: hand-written below, kept by summarize -->"


def markdown(summary: dict) -> str:
    shape = next(r["shape"] for r in summary["configs"] if r.get("shape"))
    lines = [
        "# Training stage on one GPU at Kimi-K2.5 dimensions",
        "",
        f"{summary['gpu']}, torch {summary['torch']}, speculators 0.9.0. bf16 matmul peak "
        f"(8192^3, random data, best of each call's start and end): "
        f"**{summary['matmul_peak_tflops']:.0f} TFLOP/s** "
        f"(per call: {', '.join(f'{a:.0f}/{b:.0f}' for a, b in summary['matmul_peaks'])}).",
        f"Drafter: 1 layer, hidden {shape['hidden']}, {shape['heads']} heads x {shape['head_dim']} "
        f"({shape['kv_heads']} KV heads), MLP {shape['intermediate']}, draft vocabulary "
        f"{shape['draft_vocab']}, {shape['aux_layers']} aux layers, sliding window "
        f"{shape['sliding_window']}, 3 TTT steps. Data: rows of 2,048-8,192 tokens (uniform), "
        "hidden states read from the page cache. Reproduce: `bench/train_gpu/run.sh`.",
        "",
        "tokens/s: real (non-padding) tokens over the measured steps (3 warm-up steps "
        "excluded), median of runs (min-max). fill: real tokens / total_seq_len. MFU: model "
        "FLOPs (formula in bench.py: 6x the trainable matmuls of 3 TTT steps, fc forward + "
        "weight gradient, frozen verifier head forward, attention over the keys the mask "
        "allows) per second / matmul peak. +Muon: the same plus Muon's Newton-Schulz matmuls "
        "(160 TFLOP per step). fwd / bwd / opt: speculators' synchronized step profile "
        "(only with --log-freq 1). first step: process start to the end of step 1 (compile).",
        "",
        "| config | seq | flags (training.extra_args) | runs | tokens/s (min-max) | x default "
        "| step ms | fill | peak GiB alloc / reserved | MFU | +Muon | fwd / bwd / opt ms "
        "| first step s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["configs"]:
        flags = " ".join(r["extra_args"] + [f"{k}={v}" for k, v in r["env"].items()]) or "(stage)"
        if not r["ok"]:
            lines.append(
                f"| {r['name']} | {r['total_seq_len']} | `{flags}` | {r['runs']} | "
                f"failed: {r['error'][:110]} | | | | | | | | |"
            )
            continue
        p = r["profile"]
        prof = f"{p['fwd_ms']:.0f} / {p['bwd_ms']:.0f} / {p['opt_ms']:.0f}" if p else "-"
        lines.append(
            f"| {r['name']} | {r['total_seq_len']} | `{flags}` | {r['ok']} | "
            f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f}) | "
            f"{r.get('speedup', 0):.2f} | {r['step_ms']:.0f} | {r['fill']:.2f} | "
            f"{r['peak_allocated_gib']:.1f} / {r['peak_reserved_gib']:.1f} | {r['mfu']:.1%} | "
            f"{r['hfu_with_muon']:.1%} | {prof} | {r['first_step_s']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--data", type=Path, required=True, help="make_synthetic.py --out")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--work", type=Path, default=Path("/tmp/train_bench_runs"))
    run.add_argument(
        "--runs",
        default="default,seq32k,flex_seq32k,fused_loss,seq16k,"
        "flex_seq32k_w4_log50,default,flex,adamw,flex_seq32k,log_freq50,"
        "flex_seq32k_w4_log50,default,workers4",
    )  # as measured, less the 64k OOM
    run.add_argument("--budget-s", type=float, default=3600)
    run.add_argument("--run-timeout-s", type=float, default=600)
    run.add_argument("--expect-s", type=float, default=90, help="guess for a config's first run")
    run.add_argument("--tag", default="")
    summarize = sub.add_parser("summarize")
    summarize.add_argument("results", type=Path, nargs="+")
    summarize.add_argument("--json", type=Path, required=True)
    summarize.add_argument("--md", type=Path, required=True)
    args = parser.parse_args()
    command_run(args) if args.command == "run" else command_summarize(args)


if __name__ == "__main__":
    main()
