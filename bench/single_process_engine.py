"""A vLLM CPU server's start and throughput, with its worker in the engine-core process (how
draftsmith's jobs run one CPU rank, `ServerSpec.single_process_engine`) and as vLLM runs it
(a worker process of its own, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``); the first also with its
engine core spawned as vLLM's CPU build does, without draftsmith's fork plugin
(`draftsmith.vllm_cpu_fork`, which forks it on one OpenMP thread: vLLM imported once).

Both through `managed_server`, so both get the job's CPU placement. Per mode, repetition and
serving (the target alone, and with vLLM's n-gram lookup, which runs numba in the engine):
the seconds until /health answers, then 160 completions of 32 tokens at concurrency 8, three
times (tokens/s). The model is any checkpoint (default: the demo target's shape, untrained,
built here in a second: the start is vLLM's, not the model's).

    python bench/single_process_engine.py [--model results/demo_model] [--repetitions 2]
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
from results_file import write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))
from draftsmith.preflight import VLLM_PLUGINS  # noqa: E402
from draftsmith.server import ServerSpec, managed_server  # noqa: E402

WITHOUT_FORK = ",".join(p.PLUGIN_NAME for p in VLLM_PLUGINS if p.PLUGIN_NAME != "draftsmith_cpu_fork")
MODES = {
    "single_process": {},
    "single_process_spawned": {"VLLM_PLUGINS": WITHOUT_FORK},
    "worker_process": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SERVING = {"target_alone": [], "ngram_k3": ["--speculative-config", json.dumps(NGRAM)]}
REQUESTS, CONCURRENCY, MAX_TOKENS = 160, 8, 32
PROMPT = "a b c d a b c d a b c "  # repeats: n-gram lookup finds matches in it


def small_model(directory: Path) -> Path:
    """The demo target's shape (demo_model.model_config), untrained."""
    from transformers import LlamaForCausalLM

    from draftsmith.demo_language import build_tokenizer
    from draftsmith.demo_model import model_config

    tokenizer = build_tokenizer()
    LlamaForCausalLM(model_config(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


async def tokens_per_second(endpoint) -> float:
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(headers=endpoint.headers(), timeout=300) as client:

        async def one(index: int) -> int:
            body = {"model": endpoint.model, "prompt": f"{PROMPT}{index}", "max_tokens": MAX_TOKENS}
            async with limit:
                response = await client.post(f"{endpoint.base_url}/completions", json=body | {"ignore_eos": True})
            return response.json()["usage"]["completion_tokens"]

        started = time.monotonic()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(REQUESTS))))
        return tokens / (time.monotonic() - started)


def measure(model: Path, env: dict[str, str], serving: list[str], log: Path) -> dict:
    base = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    spec = ServerSpec(
        model=str(model),
        max_model_len=512,
        extra_args=["--enforce-eager", "--dtype", "bfloat16", *serving],
        env=base | env,
        cpu_device=True,
        startup_timeout_s=600,
    )
    started = time.monotonic()
    with managed_server(spec, log) as endpoint:
        ready_s = time.monotonic() - started
        rates = [asyncio.run(tokens_per_second(endpoint)) for _ in range(3)]
    return {"ready_s": round(ready_s, 1), "tokens_per_s": [round(rate, 1) for rate in rates]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--repetitions", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        model = args.model or small_model(Path(work) / "model")
        runs: dict[str, list[dict]] = {f"{mode}, {name}": [] for mode in MODES for name in SERVING}
        for repetition in range(args.repetitions):  # interleaved: a slow minute hits both
            for mode, env in MODES.items():
                for name, serving in SERVING.items():
                    key = f"{mode}, {name}"
                    runs[key].append(measure(model, env, serving, Path(work) / f"{mode}_{name}_{repetition}.log"))
                    print(key, runs[key][-1], flush=True)
    write_result(
        "single_process_engine",
        {
            "model": str(args.model) if args.model else "the demo target's shape, untrained",
            "cpu_count": os.cpu_count(),
            "requests": {"count": REQUESTS, "concurrency": CONCURRENCY, "max_tokens": MAX_TOKENS},
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
