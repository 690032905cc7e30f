"""The training stage's compute dtype on a CPU: speculators' default bf16 autocast vs fp32.

On a CPU without AVX512-BF16 or AMX, bf16 matmuls fall back to a naive kernel; the
training stage therefore passes ``--hidden-states-dtype float32`` on ``device: cpu``, and
its CPU adaptation runs Muon's orthogonalization (bf16 in torch) in fp32 as well.
Runs a few real `speculators train` steps of the demo (after `make demo`) under
torch.profiler, once per setting, and records the CPU time, the step and optimizer times:
- ``bfloat16``: speculators' defaults (bf16 compute, torch's bf16 Muon);
- ``float32_torch_muon``: fp32 compute, torch's bf16 Muon;
- ``float32``: the stage's choice (fp32 compute, fp32 Muon).

    python bench/cpu_training_dtype.py [--results results] [--steps 3]
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from results_file import write_result

PROFILED = """
import sys
from torch.optim import _muon
from torch.profiler import ProfilerActivity, profile
from draftsmith import speculators_cpu
if sys.argv.pop(1) == "torch-muon":  # apply() installs whatever this name holds
    speculators_cpu.newton_schulz_fp32 = _muon._zeropower_via_newtonschulz
sys.argv = ["speculators", "train", *sys.argv[1:]]
with profile(activities=[ProfilerActivity.CPU]) as prof:
    try:
        speculators_cpu.main()
    except SystemExit:
        pass
print("CPU_SECONDS", sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6)
"""


def run(results: Path, dtype: str, steps: int, muon: str) -> dict:
    with tempfile.TemporaryDirectory() as save:
        args = [
            "--verifier-name-or-path",
            str(results / "demo_model"),
            "--target-layer-ids",
            "2",
            "3",
            "5",
            "--token-freq-path",
            str(results / "dataset/token_freq.pt"),
            "--draft-vocab-size",
            "200",
            "--epochs",
            "1",
            "--lr",
            "0.003",
            "--total-seq-len",
            "2048",
            "--seed",
            "0",
            "--save-path",
            save,
            "--data-path",
            str(results / "dataset"),
            "--hidden-states-path",
            str(results / "hidden_states/all"),
            "--on-missing",
            "raise",
            "--num-workers",
            "0",
            "--draft-attn-impl",
            "sdpa",
            "--loss-implementation",
            "eager",
            "--max-steps",
            str(steps),
            "--hidden-states-dtype",
            dtype,
        ]
        output = subprocess.run([sys.executable, "-c", PROFILED, muon, *args], capture_output=True, text=True).stdout
    return {
        "cpu_seconds": round(float(re.search(r"CPU_SECONDS ([0-9.]+)", output).group(1)), 2),
        "step_ms": [float(v) for v in re.findall(r"profile/step_ms=([0-9.e+]+)", output)],
        "optimizer_ms": [float(v) for v in re.findall(r"profile/opt_ms=([0-9.e+]+)", output)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("results"), help="a finished demo's results_dir")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    flags = Path("/proc/cpuinfo").read_text()
    settings = {
        "bfloat16": ("bfloat16", "torch-muon"),
        "float32_torch_muon": ("float32", "torch-muon"),
        "float32": ("float32", "fp32-muon"),
    }
    measured = {name: run(args.results, dtype, args.steps, muon) for name, (dtype, muon) in settings.items()}
    write_result(
        "cpu_training_dtype",
        {
            "goal": "fp32 faster than bf16 on this CPU (the stage's choice), fp32 Muon faster than torch's bf16 one",
            "cpu_bf16_support": any(f in flags for f in ("avx512_bf16", "amx_bf16")),
            "steps": args.steps,
            **measured,
            "bf16_over_fp32_cpu_time": round(
                measured["bfloat16"]["cpu_seconds"] / measured["float32"]["cpu_seconds"], 2
            ),
            "torch_muon_over_fp32_muon_cpu_time": round(
                measured["float32_torch_muon"]["cpu_seconds"] / measured["float32"]["cpu_seconds"], 2
            ),
        },
    )


if __name__ == "__main__":
    main()
