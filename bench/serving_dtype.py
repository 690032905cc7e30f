"""Serving speed of the real target on this CPU: bf16 against fp32, eager against compiled.

    .venv/bin/python bench/serving_dtype.py [--questions 32] [--max-tokens 128] [--repeats 2]

Needs `make real-data` (SmolLM2-135M-Instruct as a GGUF, ShareGPT V3). The GGUF is turned into
an fp32 checkpoint once (rule gguf_target's code), then one vLLM CPU server per setting serves
the same ShareGPT questions (greedy, concurrency 8, the questions stage's prompt limit), and
the completion tokens per second are recorded, with the server's load time. A CPU without
native bf16 (no AVX512-BF16 or AMX) converts every bf16 matmul: the config defaults follow
what this measures. Writes bench/results/serving_dtype.json.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from pathlib import Path

import aiohttp
from results_file import write_result

from draftsmith.gguf_target import main as convert_gguf
from draftsmith.prompt_length import PromptLimit, PromptMeter
from draftsmith.question_sources import collect_questions, read_rows
from draftsmith.server import ServerSpec, managed_server

ROOT = Path(__file__).resolve().parents[1]
REAL_DATA = ROOT / "results" / "real_data"
CHECKPOINT = ROOT / "results" / "bench" / "smollm2-fp32"
SETTINGS = {  # name -> vLLM flags
    "fp32 eager": ["--dtype", "float32", "--enforce-eager"],
    "bf16 eager": ["--dtype", "bfloat16", "--enforce-eager"],
    "fp32 compiled": ["--dtype", "float32"],
    "bf16 compiled": ["--dtype", "bfloat16"],
}
MAX_MODEL_LEN = 1024
CONCURRENCY = 8


def questions(limit: int, max_tokens: int) -> list[list[dict[str, str]]]:
    meter = PromptMeter(str(CHECKPOINT))
    fitting = PromptLimit(meter, MAX_MODEL_LEN - max_tokens, "too long")
    rows = read_rows(str(REAL_DATA / "ShareGPT_V3_unfiltered_cleaned_split.json"))
    kept, _ = collect_questions(rows, limit, prompt_limit=fitting)
    return [question.chat() for question in kept]


async def completion_tokens(base_url: str, model: str, headers: dict, chats: list, max_tokens: int) -> int:
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with aiohttp.ClientSession(headers=headers) as session:

        async def one(messages: list[dict[str, str]]) -> int:
            payload = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
            async with semaphore, session.post(f"{base_url}/chat/completions", json=payload) as response:
                response.raise_for_status()
                return int((await response.json())["usage"]["completion_tokens"])

        return sum(await asyncio.gather(*(one(m) for m in chats)))


def measure(flags: list[str], chats: list, max_tokens: int, repeats: int) -> dict:
    spec = ServerSpec(
        model=str(CHECKPOINT),
        max_model_len=MAX_MODEL_LEN,
        startup_timeout_s=1800,
        extra_args=flags,
        env={"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"},
        cpu_device=True,
    )
    started = time.monotonic()
    with managed_server(spec) as endpoint:
        load_s = time.monotonic() - started
        headers = endpoint.headers()
        asyncio.run(completion_tokens(endpoint.base_url, endpoint.model, headers, chats[:CONCURRENCY], 16))  # warm-up
        rates = []
        for _ in range(repeats):
            began = time.monotonic()
            tokens = asyncio.run(completion_tokens(endpoint.base_url, endpoint.model, headers, chats, max_tokens))
            rates.append(tokens / (time.monotonic() - began))
    return {
        "load_s": round(load_s, 1),
        "tokens_per_s": [round(r, 1) for r in rates],
        "median": statistics.median(rates),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    args = parser.parse_args()
    if not (CHECKPOINT / "config.json").exists():
        gguf = REAL_DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"
        convert_gguf(["--gguf", str(gguf), "--dtype", "float32", "--output", str(CHECKPOINT)])
    chats = questions(args.questions, args.max_tokens)
    results = {name: measure(SETTINGS[name], chats, args.max_tokens, args.repeats) for name in args.settings}
    flags = Path("/proc/cpuinfo").read_text()
    write_result(
        "serving_dtype",
        {
            "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to fp32)",
            "cpu": platform.processor() or platform.machine(),
            "native_bf16": " avx512_bf16 " in flags or " amx_bf16 " in flags,
            "questions": len(chats),
            "max_tokens": args.max_tokens,
            "concurrency": CONCURRENCY,
            "settings": results,
        },
    )


if __name__ == "__main__":
    main()
