"""The CPU trainer's speed at a real model's width: SmolLM2-135M-Instruct, before and after cpu_speedups.

An EAGLE-3 drafter for SmolLM2-135M-Instruct (Llama, hidden 576, vocabulary 49,152; draft
vocabulary 8,192, one drafter layer, 3 TTT steps) trained with the training stage's CPU
flags (train.CPU_TRAINER_FLAGS) at --total-seq-len 4096. The inputs are built here: the
target checkpoint from the GGUF of `make real-data` (gguf_target), and a dataset of random
rows (300-1,800 tokens, the last two thirds trainable; or, with ``--rows-like``, the token ids
and loss masks of a finished run's dataset) with random hidden states of width
576 for 4 stored layers, in the files speculators 0.9.0 reads (hs_<row>.safetensors,
token_freq.pt). Speed does not depend on the values.

Each setting runs real `speculators train` steps through draftsmith.speculators_cpu:
- ``speculators``: the CPU adaptation alone (speculators' dense-mask SDPA, eager KL loss);
- ``packed_attention``: + the attention over packed documents (cpu_speedups);
- ``packed_attention_kl``: + the KL loss without per-entry logarithms;
- ``packed_attention_kl_heads``: + the two heads computed only where the loss reads them
  (the trainer's setting); their share of the work is the prompts' share of the rows;
- ``all``: + freed memory kept for reuse (mallopt). Within noise of ``packed_attention_kl``
  (209 against 215 tokens/s), so the trainer does not.
Every setting trains from the same seed on the same batches, so its per-step losses show
that the changes compute the same thing (they differ by float rounding only). Reported per
setting: tokens/s (speculators' own per-step figure, first step dropped as warm-up), the
forward, backward and optimizer milliseconds, medians over steps and repeats; the runs of
the settings are interleaved, as the host may be shared.

    python bench/train_cpu_width.py [--gguf results/real_data/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--work DIR] [--steps 5] [--repeats 2] [--settings speculators all]
        [--rows-like results/bench_real_model/questions_400/dataset --name train_cpu_width_sharegpt]
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results_file import write_result

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "speculators": {"attention": False, "kl_loss": False, "heads": False, "memory": False},
    "packed_attention": {"attention": True, "kl_loss": False, "heads": False, "memory": False},
    "packed_attention_kl": {"attention": True, "kl_loss": True, "heads": False, "memory": False},
    "packed_attention_kl_heads": {"attention": True, "kl_loss": True, "heads": True, "memory": False},
    "all": {"attention": True, "kl_loss": True, "heads": True, "memory": True},
}
TOTAL_SEQ_LEN = 4096
DRAFT_VOCAB = 8192
HIDDEN = 576
STORED_LAYERS = 4  # 3 auxiliary + the last
AUX_LAYER_IDS = ["3", "16", "28"]  # vLLM ids of SmolLM2's (30 layers) decoder layers 2, 15, 27
ROWS = 48  # 43 training rows (about 11 steps of 4,096 tokens), 5 validation rows
BASELINE_TOKENS_PER_S = 168  # the figure this benchmark set out to triple

RUN = """
import sys, json
from draftsmith import cpu_speedups, speculators_cpu
parts = json.loads(sys.argv.pop(1))
speculators_cpu.faster_attention_and_loss = lambda: cpu_speedups.install(**parts)
sys.argv = ["speculators", "train", *sys.argv[1:]]
speculators_cpu.main()
"""


def build_target(gguf: Path, work: Path) -> Path:
    from draftsmith.gguf_target import convert

    target = work / "smollm2"
    if not (target / "config.json").is_file():
        convert(gguf, target, "bfloat16")
    return target


def synthetic_rows() -> list[tuple[list[int], list[int]]]:
    """300-1,800 tokens of Zipf-like ids (a few thousand frequent tokens, so the draft
    vocabulary is a real choice), the last two thirds trainable."""
    import torch

    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(ROWS):
        length = rng.randint(300, 1800)
        ids = (torch.empty(length).exponential_(1 / 3000, generator=generator).long() % 49152).tolist()
        rows.append((ids, [0] * (length // 3) + [1] * (length - length // 3)))
    return rows


def rows_like(dataset: Path) -> list[tuple[list[int], list[int]]]:
    """The token ids and loss masks of a finished run's dataset (real prompts and answers)."""
    from datasets import load_from_disk

    rows = load_from_disk(str(dataset)).with_format(None)
    return list(zip(rows["input_ids"], rows["loss_mask"], strict=True))


def build_data(work: Path, like: Path | None) -> Path:
    """Rows and random hidden states in speculators' file layout (see the docstring)."""
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    data = work / ("like_" + like.parent.name if like else "synthetic")
    if (data / "token_freq.pt").is_file():
        return data
    generator = torch.Generator().manual_seed(0)
    (data / "hidden_states").mkdir(parents=True, exist_ok=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    counts: dict[int, int] = {}
    for row, (ids, mask) in enumerate(rows_like(like) if like else synthetic_rows()):
        rows["input_ids"].append(ids)
        rows["loss_mask"].append(mask)
        rows["seq_len"].append(len(ids))
        for token in ids:
            counts[token] = counts.get(token, 0) + 1
        states = torch.randn(len(ids), STORED_LAYERS, HIDDEN, generator=generator).to(torch.bfloat16)
        save_file(
            {"hidden_states": states, "token_ids": torch.tensor(ids)},
            str(data / "hidden_states" / f"hs_{row}.safetensors"),
        )
    dataset = Dataset.from_dict(rows)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(data / "dataset"))
    torch.save(counts, data / "token_freq.pt")
    return data


def trainable_share(data: Path) -> float:
    from datasets import load_from_disk

    masks = load_from_disk(str(data / "dataset")).with_format(None)["loss_mask"]
    return round(sum(map(sum, masks)) / sum(map(len, masks)), 3)


def train_args(target: Path, data: Path, save: Path, steps: int) -> list[str]:
    from draftsmith.train import CPU_TRAINER_FLAGS

    return [
        "--verifier-name-or-path", str(target),
        "--target-layer-ids", *AUX_LAYER_IDS,
        "--token-freq-path", str(data / "token_freq.pt"),
        "--draft-vocab-size", str(DRAFT_VOCAB),
        "--num-layers", "1",
        "--epochs", "1",
        "--lr", "0.0001",
        "--total-seq-len", str(TOTAL_SEQ_LEN),
        "--seed", "0",
        "--save-path", str(save),
        "--data-path", str(data / "dataset"),
        "--hidden-states-path", str(data / "hidden_states"),
        "--on-missing", "raise",
        "--loss-implementation", "eager",
        "--max-steps", str(steps),
        *CPU_TRAINER_FLAGS,
    ]  # fmt: skip


def run(setting: str, target: Path, data: Path, steps: int) -> list[dict]:
    """The per-step records speculators logged (DRAFTSMITH_METRICS_FILE)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        env = {**os.environ, "DRAFTSMITH_METRICS_FILE": str(metrics)}
        args = train_args(target, data, Path(tmp) / "checkpoints", steps)
        done = subprocess.run(
            [sys.executable, "-c", RUN, json.dumps(SETTINGS[setting]), *args], capture_output=True, text=True, env=env
        )
        if done.returncode != 0:
            raise SystemExit(f"{setting} failed:\n{done.stderr[-3000:]}")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in records if r.get("profile")]


def summary(runs: list[list[dict]]) -> dict:
    steps = [step for records in runs for step in records[1:]]  # the first step warms up

    def median(key: str) -> float:
        return round(statistics.median(step["profile"][key] for step in steps), 1)

    return {
        "tokens_per_s": median("tokens_per_s"),
        "tokens_per_s_each": [round(step["profile"]["tokens_per_s"], 1) for step in steps],
        "forward_ms": median("fwd_ms"),
        "backward_ms": median("bwd_ms"),
        "optimizer_ms": median("opt_ms"),
        "step_ms": median("step_ms"),
        "losses": [round(step["train"]["loss"], 4) for step in runs[0]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=ROOT / "results/real_data/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--work", type=Path, help="where the inputs are built (kept); a temporary folder if unset")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--rows-like", type=Path, help="a finished run's dataset: its rows' ids and loss masks")
    parser.add_argument("--name", default="train_cpu_width", help="results file name")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        target = build_target(args.gguf, work)
        data = build_data(work, args.rows_like)
        runs: dict[str, list[list[dict]]] = {name: [] for name in args.settings}
        for _ in range(args.repeats):
            for name in args.settings:
                runs[name].append(run(name, target, data, args.steps))
                print(name, [round(r["profile"]["tokens_per_s"], 1) for r in runs[name][-1]], file=sys.stderr)
    measured = {name: summary(setting_runs) for name, setting_runs in runs.items()}
    result = {
        "goal": f"at least 3x {BASELINE_TOKENS_PER_S} tokens/s at SmolLM2-135M's width on this CPU",
        "cpu_count": os.cpu_count(),
        # 1-minute load averages: other work on the host slows every setting alike.
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "total_seq_len": TOTAL_SEQ_LEN,
        "draft_vocab_size": DRAFT_VOCAB,
        "rows": str(args.rows_like) if args.rows_like else "synthetic: 300-1,800 tokens, the last two thirds trainable",
        "trainable_share": trainable_share(data),
        "steps": args.steps,
        "repeats": args.repeats,
        **measured,
    }
    if "speculators" in measured:
        base = measured["speculators"]
        for name, m in measured.items():
            result.setdefault("speedup_over_speculators", {})[name] = round(m["tokens_per_s"] / base["tokens_per_s"], 2)
            result.setdefault("max_loss_difference", {})[name] = max(
                abs(a - b) for a, b in zip(m["losses"], base["losses"], strict=True)
            )
    last = measured[args.settings[-1]]["tokens_per_s"]
    result["last_setting_over_168"] = round(last / BASELINE_TOKENS_PER_S, 2)
    write_result(args.name, result)


if __name__ == "__main__":
    main()
