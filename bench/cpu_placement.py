"""CPU placement: the request rate of one vLLM CPU server with its frontend floating vs.
kept off the cores its engine is bound to (draftsmith/cpu_placement.py).

    .venv/bin/python bench/cpu_placement.py [--questions 400] [--repeats 6]

Needs the demo target (`make demo`). One server; the two modes alternate on it
(floating, placed, floating, ...), each sending the same questions with a plain load
generator at the demo's concurrency. Writes bench/results/cpu_placement.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time

import psutil
from generation_client import demo_config, demo_questions, plain_load
from results_file import write_result

from draftsmith.cpu_placement import engine_cores_kept_free
from draftsmith.run_config import RunConfig
from draftsmith.server import ServerSpec, managed_server


def float_everything(allowed: set[int]) -> None:
    """Undo any placement: every thread of this process and of the API server on every core
    (the workers keep the binding vLLM gave them)."""
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        if process.name().startswith("VLLM::Worker"):
            continue
        for thread in process.threads():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(thread.id, allowed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    config = demo_config()
    generation = config["generation"] | {"sampling": {"temperature": 0.0}}
    questions = demo_questions(args.questions)
    allowed = os.sched_getaffinity(0)

    rates: dict[str, list[float]] = {"floating": [], "placed": []}
    # cpu_device=False: the modes are switched here, not by managed_server.
    with managed_server(ServerSpec.from_config(RunConfig.from_dict(config | {"device": "none"}))) as endpoint:
        guard = next(p for p in psutil.Process().children() if "draftsmith.guard" in p.cmdline())
        asyncio.run(plain_load(endpoint, questions[:32], generation))  # warm-up
        for _ in range(args.repeats):
            for mode in rates:
                float_everything(allowed)
                placement = engine_cores_kept_free(guard.pid) if mode == "placed" else contextlib.nullcontext()
                with placement:
                    started = time.perf_counter()
                    done = asyncio.run(plain_load(endpoint, questions, generation))
                    rates[mode].append(done / (time.perf_counter() - started))

    result = {
        "questions": len(questions),
        "concurrency": generation["concurrency"],
        "cores": sorted(allowed),
        "requests_per_s": {k: [round(v, 1) for v in vs] for k, vs in rates.items()},
        "median_requests_per_s": {k: round(statistics.median(vs), 1) for k, vs in rates.items()},
        "min_max_ratio": {k: round(min(vs) / max(vs), 3) for k, vs in rates.items()},
        "speedup_of_medians": round(statistics.median(rates["placed"]) / statistics.median(rates["floating"]), 3),
    }
    write_result("cpu_placement", result)


if __name__ == "__main__":
    main()
