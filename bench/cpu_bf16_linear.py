"""bfloat16 linear layers on a CPU without bfloat16 units: torch's matmul against the float32
computation draftsmith's vLLM plugin uses (`draftsmith.vllm_cpu_bf16`), per call and in a
served model.

Per call: the demo targets' linear shapes (tokens x in -> out), bfloat16 against the input
cast to float32, the float32 copy of the weight, and the result cast back. Served: the demo
target's shape (untrained; or any checkpoint with --model) through `managed_server`, with
the plugin and without it (VLLM_PLUGINS leaving it out), interleaved, 160 completions of 32
tokens at concurrency 8, three times per start (tokens/s).

    python bench/cpu_bf16_linear.py [--model results/deepseek-v3-tiny/demo_model] [--repetitions 2]
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from results_file import write_result
from single_process_engine import measure, small_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))
from draftsmith import vllm_cpu_bf16  # noqa: E402
from draftsmith.preflight import VLLM_PLUGINS  # noqa: E402

SHAPES = [(8, 128, 384), (8, 256, 576), (8, 256, 512), (64, 256, 512), (8, 576, 1536)]
WITHOUT_PLUGIN = ",".join(p.PLUGIN_NAME for p in VLLM_PLUGINS if p.PLUGIN_NAME != vllm_cpu_bf16.PLUGIN_NAME)


def milliseconds(call, repeats: int = 300) -> float:
    call()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return round((time.perf_counter() - started) / repeats * 1e3, 4)


def per_call() -> list[dict]:
    rows = []
    for tokens, inputs, outputs in SHAPES:
        x = torch.randn(tokens, inputs).to(torch.bfloat16)
        weight = torch.randn(outputs, inputs).to(torch.bfloat16)
        upcast = vllm_cpu_bf16.float32_linear(weight, None)
        bf16 = milliseconds(lambda x=x, weight=weight: torch.nn.functional.linear(x, weight))
        fp32 = milliseconds(lambda x=x, weight=weight, upcast=upcast: upcast(x, weight, None))
        rows.append(
            {"shape": [tokens, inputs, outputs], "bf16_ms": bf16, "float32_ms": fp32, "ratio": round(bf16 / fp32, 2)}
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--repetitions", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the engine runs on 2 cores
    calls = per_call()
    modes = {"with_plugin": {}, "without_plugin": {"VLLM_PLUGINS": WITHOUT_PLUGIN}}
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as work:
        model = args.model or small_model(Path(work) / "model")
        for repetition in range(args.repetitions):  # interleaved: a slow minute hits both
            for mode, env in modes.items():
                runs[mode].append(measure(model, env, [], Path(work) / f"{mode}_{repetition}.log"))
                print(mode, runs[mode][-1], flush=True)
    write_result(
        f"cpu_bf16_linear{'_' + args.model.parent.name if args.model else ''}",
        {
            "model": str(args.model) if args.model else "the demo target's shape, untrained",
            "cpu_has_bf16_units": vllm_cpu_bf16.cpu_has_bf16_units(),
            "cpu_count": os.cpu_count(),
            "per_call_one_thread": calls,
            "served": runs,
        },
    )


if __name__ == "__main__":
    main()
