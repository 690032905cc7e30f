"""Generation client: the generation stage's request throughput vs. a plain load generator
at the same concurrency, against the same vLLM server and prompts. Goal: >= 0.95.

    .venv/bin/python bench/generation_client.py [--questions 400] [--concurrency 16] [--repeats 3]

Needs the demo target (`make demo`). One server serves both clients; runs alternate
(stage, plain, stage, plain, ...) so that the machine's noise hits both alike. On a CPU
both run where the stage's client does: on the cores vLLM's engine is not bound to. The stage's
client does everything it does in production (speculators' request logic, an fsynced
record per answer, progress lines); the plain one only posts and reads the JSON.
Writes bench/results/generation_client.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml
from results_file import write_result
from snakemake.utils import validate

from draftsmith.generate import RecordWriter, answer_questions, generation_stage
from draftsmith.run_config import RunConfig
from draftsmith.server import ServerSpec, managed_server

ROOT = Path(__file__).resolve().parents[1]


async def plain_load(endpoint, questions, generation) -> int:
    semaphore = asyncio.Semaphore(generation["concurrency"])
    async with aiohttp.ClientSession(headers=endpoint.headers()) as session:

        async def one(question):
            payload = {
                **generation["sampling"],
                "model": endpoint.model,
                "messages": question["messages"],
                "max_tokens": generation["max_tokens"],
                "return_token_ids": True,
            }
            async with semaphore, session.post(f"{endpoint.base_url}/chat/completions", json=payload) as response:
                await response.json()

        await asyncio.gather(*(one(q) for q in questions))
    return len(questions)


def demo_config() -> dict:
    """The demo config with defaults filled in, its target path absolute."""
    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    validate(config, str(ROOT / "workflow/schemas/config.schema.yaml"))
    config["target"]["model"] = str(ROOT / config["target"]["model"])
    return config


def demo_questions(limit: int) -> list[dict]:
    """The first ``limit`` usable questions of the demo's file, with ids."""
    rows = [json.loads(line) for line in (ROOT / "config/demo_questions.jsonl").read_text().splitlines()]
    questions = [{"id": f"b{i}", "messages": r["messages"]} for i, r in enumerate(rows) if "messages" in r]
    return questions[:limit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = demo_config()
    generation = config["generation"] | {"concurrency": args.concurrency, "sampling": {"temperature": 0.0}}
    questions = demo_questions(args.questions)
    stage = generation_stage(RunConfig.from_dict(config | {"generation": generation}))

    rates: dict[str, list[float]] = {"stage": [], "plain": []}
    with (
        managed_server(ServerSpec.from_config(RunConfig.from_dict(config))) as endpoint,
        tempfile.TemporaryDirectory() as scratch,
    ):
        asyncio.run(plain_load(endpoint, questions[:32], generation))  # warm-up
        # The stage imports speculators' client while its server loads; here too, not in the timing.
        import speculators.data_generation.vllm_client  # noqa: F401

        for repeat in range(args.repeats):
            writer = RecordWriter(Path(scratch) / f"records_{repeat}.jsonl")
            started = time.perf_counter()
            tally = asyncio.run(
                answer_questions(stage, endpoint, questions, writer, already_done=0, total=len(questions))
            )
            rates["stage"].append(tally.ok / (time.perf_counter() - started))
            writer.close()
            started = time.perf_counter()
            done = asyncio.run(plain_load(endpoint, questions, generation))
            rates["plain"].append(done / (time.perf_counter() - started))

    result = {
        "questions": len(questions),
        "concurrency": args.concurrency,
        "max_tokens": generation["max_tokens"],
        "requests_per_s": {k: [round(v, 2) for v in vs] for k, vs in rates.items()},
        "median_requests_per_s": {k: round(statistics.median(vs), 2) for k, vs in rates.items()},
        "ratio_stage_over_plain": round(statistics.median(rates["stage"]) / statistics.median(rates["plain"]), 4),
        "goal": 0.95,
    }
    write_result("generation_client", result)


if __name__ == "__main__":
    main()
