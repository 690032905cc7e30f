"""Evaluation stage: serve target + drafter in vLLM and measure what speculation buys.

The held-out questions run at temperature 0 twice: once on the target alone and once
with the drafter (``--speculative-config``), each on a fresh server so vLLM's
counters start at zero. Acceptance comes from vLLM's own spec-decode metrics:

    acceptance length = 1 + accepted tokens / drafts
    acceptance at position k = accepted at k / drafts

Optionally a drafter of the same shape with untrained weights is measured too: the
demo's proof that tokens, masks and vocabulary mapping line up is that training
clearly beats it.

The stage also writes the drafter's ``--speculative-config`` JSON for serving: its
``num_speculative_tokens`` is an evaluation setting, so training never depends on it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from draftsmith.atomic import atomic_write_text
from draftsmith.cli import SETTINGS_HELP, read_settings
from draftsmith.client import SPECULATORS_CLIENT, chat_poster, open_session
from draftsmith.errors import DraftsmithError
from draftsmith.plan import read_target_config
from draftsmith.progress import Progress, log
from draftsmith.server import Endpoint, ServerSpec, import_in_background, managed_server
from draftsmith.serving import EvaluationAttention, evaluation_attention
from draftsmith.slot import check_gpu_slot

SPEC_METRIC_PREFIX = "vllm:spec_decode_num_"
# The speculative method of the evaluation servers (vLLM's SpeculativeMethod).
SPECULATIVE_METHODS = ["eagle3"]


class EvaluationError(DraftsmithError):
    pass


@dataclass
class Measurement:
    requests: int
    completion_tokens: int
    seconds: float
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [n / self.drafts if self.drafts else 0.0 for n in self.accepted_per_position]


def spec_decode_counters(metrics_text: str) -> dict[str, Any]:
    """Sum vLLM's spec-decode counters (over engines/labels) from a /metrics page."""
    totals: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "per_position": {}}
    names = {
        f"{SPEC_METRIC_PREFIX}drafts_total": "drafts",
        f"{SPEC_METRIC_PREFIX}draft_tokens_total": "draft_tokens",
        f"{SPEC_METRIC_PREFIX}accepted_tokens_total": "accepted_tokens",
    }
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in names:
                totals[names[sample.name]] += int(sample.value)
            elif sample.name == f"{SPEC_METRIC_PREFIX}accepted_tokens_per_pos_total":
                position = int(sample.labels["position"])
                totals["per_position"][position] = totals["per_position"].get(position, 0) + int(sample.value)
    return totals


def read_metrics(endpoint: Endpoint) -> str:
    request = urllib.request.Request(f"{endpoint.root_url}/metrics", headers=endpoint.headers())
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()


async def answer_all(endpoint: Endpoint, questions: list[dict], evaluation: dict, label: str) -> tuple[int, float]:
    """Completion tokens generated for all questions at temperature 0, and the wall time."""
    progress = Progress(f"evaluation ({label})", len(questions))
    semaphore = asyncio.Semaphore(evaluation["concurrency"])
    completion_tokens = 0

    async with open_session(endpoint, evaluation["concurrency"], 3600) as session:
        post = chat_poster(session, endpoint, max_retries=2)

        async def answer(question: dict) -> None:
            nonlocal completion_tokens
            payload = {
                "model": endpoint.model,
                "messages": question["messages"],
                "max_tokens": evaluation["max_tokens"],
                "temperature": 0.0,
            }
            async with semaphore:
                response = await post(payload)
            completion_tokens += response["usage"]["completion_tokens"]
            progress.advance()

        started = time.monotonic()
        await asyncio.gather(*(answer(q) for q in questions))
    return completion_tokens, time.monotonic() - started


def measure(
    settings: dict, questions: list[dict], speculative_config: dict | None, label: str, attention: EvaluationAttention
) -> Measurement:
    extra = ["--speculative-config", json.dumps(speculative_config)] if speculative_config else []
    spec = ServerSpec.from_config(settings, extra_args=extra)
    spec = dataclasses.replace(spec, env={**spec.env, **attention.server_env()})
    import_in_background(SPECULATORS_CLIENT)
    with managed_server(spec) as endpoint:
        tokens, seconds = asyncio.run(answer_all(endpoint, questions, settings["evaluation"], label))
        counters = spec_decode_counters(read_metrics(endpoint))
    positions = counters["per_position"]
    measurement = Measurement(
        requests=len(questions),
        completion_tokens=tokens,
        seconds=seconds,
        drafts=counters["drafts"],
        draft_tokens=counters["draft_tokens"],
        accepted_tokens=counters["accepted_tokens"],
        accepted_per_position=[positions.get(k, 0) for k in range(len(positions))],
    )
    if speculative_config and not measurement.drafts:
        raise EvaluationError(
            f"vLLM reported no drafts while serving {speculative_config['model']}; the drafter was "
            "not used: check the server log above for a speculative-config error"
        )
    log(
        f"{label}: {tokens} tokens in {seconds:.1f}s ({measurement.tokens_per_s:.1f} tok/s), "
        f"acceptance length {measurement.acceptance_length:.2f}"
    )
    return measurement


def summarize(with_drafter: Measurement, without: Measurement, untrained: Measurement | None, k: int) -> dict:
    result = {
        "acceptance_length": round(with_drafter.acceptance_length, 4),
        "max_acceptance_length": k + 1,
        "acceptance_per_position": [round(x, 4) for x in with_drafter.acceptance_per_position],
        "tokens_per_s_with_drafter": round(with_drafter.tokens_per_s, 2),
        "tokens_per_s_without_drafter": round(without.tokens_per_s, 2),
        "speedup": round(with_drafter.tokens_per_s / without.tokens_per_s, 3) if without.tokens_per_s else None,
        "num_speculative_tokens": k,
        "with_drafter": asdict(with_drafter),
        "without_drafter": asdict(without),
    }
    if untrained is not None:
        result["untrained_acceptance_length"] = round(untrained.acceptance_length, 4)
        result["untrained_acceptance_per_position"] = [round(x, 4) for x in untrained.acceptance_per_position]
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    positions = range(1, len(result["acceptance_per_position"]) + 1)
    left.bar([p - 0.2 for p in positions], result["acceptance_per_position"], width=0.4, label="trained drafter")
    if "untrained_acceptance_per_position" in result:
        untrained = result["untrained_acceptance_per_position"]
        left.bar([p + 0.2 for p in positions], untrained, width=0.4, label="untrained drafter")
    left.set(
        xlabel="draft position",
        ylabel="acceptance rate",
        ylim=(0, 1.05),
        title=f"acceptance length {result['acceptance_length']:.2f} of {result['max_acceptance_length']}",
    )
    left.set_xticks(list(positions))
    left.legend()
    right.bar(
        ["target alone", "target + drafter"],
        [result["tokens_per_s_without_drafter"], result["tokens_per_s_with_drafter"]],
    )
    right.set(ylabel="output tokens / s", title="throughput on held-out questions")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def speculative_config(drafter: Path, num_speculative_tokens: int) -> dict:
    """The value of vLLM's ``--speculative-config`` that serves ``drafter``."""
    return {
        "model": str(drafter.resolve()),
        "method": SPECULATIVE_METHODS[0],
        "num_speculative_tokens": num_speculative_tokens,
    }


def read_heldout(path: Path, limit: int | None) -> list[dict]:
    with path.open(encoding="utf-8") as handle:
        questions = [json.loads(line) for line in handle if line.strip()]
    if not questions:
        raise EvaluationError(f"{path} holds no held-out questions; set questions.heldout ≥ 1")
    return questions[:limit] if limit else questions


def run(
    settings: dict,
    heldout: Path,
    drafter: Path,
    spec_config: Path,
    output: Path,
    plot_path: Path,
    untrained_drafter: Path | None,
    granted_gpus: int | None,
) -> dict:
    check_gpu_slot(settings, granted_gpus)
    questions = read_heldout(heldout, settings["evaluation"]["limit"])
    k = settings["evaluation"]["num_speculative_tokens"]
    # Every evaluation server runs the target the same way, so the speedup compares like with like.
    attention = evaluation_attention(read_target_config(settings["target"]["model"]), settings["device"])
    if attention.mla_disabled:
        log(attention.reason)
    log(f"evaluating on {len(questions)} held-out questions")
    without = measure(settings, questions, None, "target alone", attention)
    with_drafter = measure(settings, questions, speculative_config(drafter, k), "target + drafter", attention)
    untrained = None
    if untrained_drafter is not None:
        untrained = measure(
            settings, questions, speculative_config(untrained_drafter, k), "untrained drafter", attention
        )
    result = summarize(with_drafter, without, untrained, k)
    result["mla_disabled"] = attention.mla_disabled
    if attention.mla_disabled:
        result["mla_disabled_because"] = attention.reason
    plot(result, plot_path)
    atomic_write_text(spec_config, json.dumps(speculative_config(drafter, k)) + "\n")
    atomic_write_text(output, json.dumps(result, indent=2) + "\n")
    log(f"acceptance length {result['acceptance_length']} (per position {result['acceptance_per_position']})")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", required=True, help=SETTINGS_HELP)
    parser.add_argument("--heldout", required=True, type=Path)
    parser.add_argument("--drafter", required=True, type=Path, help="the trained drafter directory")
    parser.add_argument("--untrained-drafter", type=Path, default=None, help="a baseline drafter")
    parser.add_argument(
        "--spec-config", required=True, type=Path, help="where to write the drafter's --speculative-config JSON"
    )
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--plot", required=True, type=Path)
    parser.add_argument("--granted-gpus", type=int, default=None)
    args = parser.parse_args(argv)
    run(
        read_settings(args.settings, "evaluate"),
        args.heldout,
        args.drafter,
        args.spec_config,
        args.output,
        args.plot,
        args.untrained_drafter,
        args.granted_gpus,
    )


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
