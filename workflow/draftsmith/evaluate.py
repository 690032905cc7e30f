"""Evaluation measurement: one server load, every prompt set, concurrency and temperature.

A job serves the target alone (the baseline), the target with a drafter at one draft
length ``k`` (``--speculative-config``), or the target with a speculative method that needs
no training (``evaluation.free_methods``: vLLM's n-gram prompt lookup, suffix decoding) at
``k``, so adding a draft length or a method to the sweep adds its jobs and re-runs nothing
else. The job sends each prompt set (``evaluation_sets``) at each
concurrency of ``evaluation.concurrency`` and each sampling of ``evaluation.samplings``
(temperature 0, and the generation's sampling when ``evaluation.sampled``), one phase at
a time, and records per phase and per category:

- tokens and wall time (throughput), and each request's own latency; a conversation of
  several user turns is one request per turn, each after the target's answer to the one
  before, and every turn is measured;
- vLLM's per-request acceptance histogram (``--per-request-spec-decode-metrics``):
  the count of verify steps that accepted exactly ``j`` draft tokens. A vLLM without that
  option (before 0.29, see ``vllm_build``) gives the same histogram per phase and category
  from its ``/metrics`` counters, read before and after each category's requests, which
  are then sent one category after another.

    acceptance length = 1 + accepted tokens / verify steps
    acceptance at position p = steps that accepted more than p tokens / steps

The job's totals are checked against the server's own Prometheus counters. The
``evaluation_summary`` stage turns the records of all jobs into the report.

The order of the work and the retries are those of every server stage (``server_stage``);
a measurement keeps no work in progress, so it has no staging, and any failed request
fails the job: a measurement with holes would not compare with the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from draftsmith import vllm_build
from draftsmith.atomic import atomic_write_text
from draftsmith.cli import read_settings, stage_parser
from draftsmith.client import SPECULATORS_CLIENT, chat_poster, open_session
from draftsmith.conversation_turns import turn_messages, turn_requests
from draftsmith.drafter_kinds import DEFAULT_KIND, FREE_METHODS, KINDS, drafter_speculative_config, free_method_config
from draftsmith.progress import Progress, log
from draftsmith.records import (
    Measurement,
    Phase,
    acceptance_length,
    accepted_tokens,
    merged,
    read_prompts,
    summed,
)
from draftsmith.run_config import RunConfig
from draftsmith.server import Endpoint, ServerSpec, counter_totals, read_metrics
from draftsmith.server_stage import RequestPolicy, ServerStage, StageError
from draftsmith.serving import EvaluationAttention, evaluation_attention
from draftsmith.target import read_target_shape

SPEC_METRIC_PREFIX = "vllm:spec_decode_num_"
# The speculative method of the evaluation servers (vLLM's SpeculativeMethod), that the
# preflight checks in the install: a literal, as the preflight reads it without importing this
# module; tests/test_imports.py holds it to drafter_kinds.EAGLE3.
SPECULATIVE_METHODS = ["eagle3"]
# Steps that accepted more than p draft tokens, by position p (vLLM's per-position counter).
PER_POSITION_COUNTER = f"{SPEC_METRIC_PREFIX}accepted_tokens_per_pos_total"


class EvaluationError(StageError):
    pass


def evaluation_stage(settings: RunConfig) -> ServerStage[int]:
    """The skeleton's parts for this stage; its items are a phase's prompts, by position."""
    policy = RequestPolicy.from_section(settings.evaluation, concurrency=settings.evaluation.concurrencies[0])
    return ServerStage(
        "evaluate", settings, policy, "requests", name=lambda index: f"prompt {index}", error=EvaluationError
    )


def spec_decode_counters(metrics_text: str) -> dict[str, Any]:
    """Sum vLLM's spec-decode counters (over engines/labels) from a /metrics page, and the
    accepted tokens by draft position (``per_position``: position -> steps)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = ("drafts", "draft_tokens", "accepted_tokens")
    totals = counter_totals(metrics_text, [f"{SPEC_METRIC_PREFIX}{name}_total" for name in names])
    per_position: dict[int, int] = defaultdict(int)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == PER_POSITION_COUNTER:
                per_position[int(sample.labels["position"])] += int(sample.value)
    counters: dict[str, Any] = {name: totals[f"{SPEC_METRIC_PREFIX}{name}_total"] for name in names}
    return counters | {"per_position": dict(sorted(per_position.items()))}


async def run_phase(
    stage: ServerStage[int],
    endpoint: Endpoint,
    prompts: list[dict[str, Any]],
    phase: Phase,
    label: str,
    per_request: bool = True,
) -> None:
    """Send the phase's prompts, ``phase.concurrency`` at a time, and tally the answers.
    Without ``per_request`` acceptance, each category's prompts go in turn and its
    acceptance is the server counters' difference across them."""
    progress = Progress(f"{label}, set {phase.set}, concurrency {phase.concurrency}", len(prompts))
    async with open_session(endpoint, phase.concurrency, stage.policy.timeout_s) as session:
        post = chat_poster(session, endpoint)

        async def answer(index: int) -> None:
            """Each user turn in order, after the target's own answer to the one before."""
            prompt = prompts[index]
            parts = turn_requests(prompt["messages"])
            answers: list[str] = []
            measured: list[tuple[dict[str, Any], float]] = []
            while len(answers) < len(parts):
                payload = {
                    "model": endpoint.model,
                    "messages": turn_messages(parts, answers),
                    "max_tokens": stage.settings.evaluation.max_tokens,
                    **phase.sampling,
                }
                started = time.monotonic()
                response = await post(payload)
                measured.append((response, time.monotonic() - started))
                answers.append(response["choices"][0]["message"].get("content") or "")
            for response, seconds in measured:  # once every turn is in: a retried conversation counts once
                phase.categories[prompt["category"]].add(response, seconds)

        groups: list[list[int]] = [list(range(len(prompts)))]
        if not per_request:
            by_category: dict[str, list[int]] = defaultdict(list)
            for index, prompt in enumerate(prompts):
                by_category[prompt["category"]].append(index)
            groups = list(by_category.values())
        started = time.monotonic()
        failures: dict[int, str] = {}
        for group in groups:
            before = None if per_request else await asyncio.to_thread(settled_counters, endpoint)
            failures |= await stage.request_all(group, answer, progress, concurrency=phase.concurrency)
            if before is not None:
                after = await asyncio.to_thread(settled_counters, endpoint)
                tally = phase.categories[prompts[group[0]]["category"]]
                tally.histogram = summed(tally.histogram, histogram_between(before, after))
                tally.draft_tokens += after["draft_tokens"] - before["draft_tokens"]
        phase.seconds = time.monotonic() - started
    kept = f"{progress.label}: a measurement keeps no work in progress; rerun the job once the cause is fixed"
    stage.check_failures(failures, len(prompts), kept)
    whole = merged(phase.categories.values())
    log(
        f"{progress.label}: {whole.completion_tokens} tokens in {phase.seconds:.1f}s "
        f"({whole.completion_tokens / phase.seconds if phase.seconds else 0:.1f} tok/s)"
        + (f", acceptance length {acceptance_length(whole):.2f}" if whole.histogram else "")
    )


def settled_counters(endpoint: Endpoint, attempts: int = 20) -> dict[str, Any]:
    """The spec-decode counters once two reads 0.1 s apart agree: the server records a
    step's counts as its outputs are processed, so the last response can arrive first."""
    counters = spec_decode_counters(read_metrics(endpoint))
    for _ in range(attempts):
        time.sleep(0.1)
        again = spec_decode_counters(read_metrics(endpoint))
        if again == counters:
            break
        counters = again
    return counters


def histogram_between(before: dict[str, Any], after: dict[str, Any]) -> list[int]:
    """The acceptance histogram of the steps between two counter readings: of ``drafts``
    verify steps, ``per_position[p]`` accepted more than ``p`` tokens."""
    drafts = after["drafts"] - before["drafts"]
    positions = max(len(before["per_position"]), len(after["per_position"]))
    if not drafts:
        return []
    more_than = [after["per_position"].get(p, 0) - before["per_position"].get(p, 0) for p in range(positions)]
    bounds = [drafts, *more_than, 0]
    return [bounds[j] - bounds[j + 1] for j in range(positions + 1)]


def sampling_label(sampling: dict[str, Any]) -> str:
    return "greedy" if not sampling.get("temperature") else f"temperature {sampling['temperature']}"


def measure(
    stage: ServerStage[int],
    prompts: list[dict[str, Any]],
    speculation: dict[str, Any] | None,
    attention: EvaluationAttention,
    default_only: bool = False,
) -> Measurement:
    """Every phase on one server: the target alone (``speculation`` None), or with vLLM's
    ``--speculative-config`` ``speculation``: a drafter, or a method that needs no training."""
    settings = stage.settings
    extra = []
    # The target alone has no acceptance to read: its phases go out whole on any vLLM.
    per_request = speculation is None or vllm_build.has_per_request_spec_decode_metrics()
    if speculation is not None:
        extra = ["--speculative-config", json.dumps(speculation)]
        if per_request:
            extra += ["--per-request-spec-decode-metrics", "summary"]
        else:
            log("this vLLM has no per-request spec-decode metrics: acceptance is read from /metrics per category")
    spec = ServerSpec.from_config(settings, extra_args=extra)
    spec = dataclasses.replace(spec, env={**spec.env, **attention.server_env()})
    label = speculation_label(speculation)
    by_set: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for prompt in prompts:
        by_set[prompt["set"]].append(prompt)
    samplings, levels = settings.evaluation_samplings, settings.evaluation.concurrencies
    if default_only:  # the untrained drafter only proves the wiring: greedy, at the default concurrency
        samplings, levels = samplings[:1], levels[:1]
    phases = [Phase(name, concurrency, sampling) for sampling in samplings for concurrency in levels for name in by_set]
    with stage.server(spec, SPECULATORS_CLIENT) as endpoint:

        async def run_all() -> None:
            for phase in phases:
                phase_label = f"{label}, {sampling_label(phase.sampling)}"
                await run_phase(stage, endpoint, by_set[phase.set], phase, phase_label, per_request)

        asyncio.run(run_all())
        counters = spec_decode_counters(read_metrics(endpoint))
        del counters["per_position"]  # the histograms hold it
    measured = Measurement(
        drafter=None,
        num_speculative_tokens=None,
        phases=phases,
        server_counters=counters,
        mla_disabled=attention.mla_disabled,
        mla_disabled_because=attention.reason if attention.mla_disabled else None,
    )
    if speculation is None:
        return measured
    free = speculation["method"] in FREE_METHODS
    check_against_server(phases, counters, label, drafts_expected=not free)
    return dataclasses.replace(
        measured,
        drafter=None if free else speculation["model"],
        num_speculative_tokens=speculation["num_speculative_tokens"],
        method=speculation["method"],
    )


def speculation_label(speculation: dict[str, Any] | None) -> str:
    if speculation is None:
        return "target alone"
    if speculation["method"] in FREE_METHODS:
        return f"{speculation['method']}, k={speculation['num_speculative_tokens']}"
    return f"{Path(speculation['model']).name}, k={speculation['num_speculative_tokens']}"


def check_against_server(
    phases: list[Phase], counters: dict[str, Any], label: str, retried: int = 0, drafts_expected: bool = True
) -> None:
    """The per-request records must add up to the server's own counters: a response field
    that changed shape would otherwise skew every number silently. After ``retried``
    requests the server may hold drafts of attempts whose responses never arrived, and the
    cause is then far more likely than a changed vLLM. A drafter drafts at every step; n-gram
    lookup only where it finds a match, so for it no drafts at all is a result."""
    total = merged(t for phase in phases for t in phase.categories.values())
    steps = sum(total.histogram)
    accepted = accepted_tokens(total)
    if not counters["drafts"] and drafts_expected:
        raise EvaluationError(
            f"vLLM reported no drafts while serving {label}; the drafter was not used: "
            "check the server log above for a speculative-config error"
        )
    if (steps, accepted) == (counters["drafts"], counters["accepted_tokens"]):
        return
    disagreement = (
        f"the responses' acceptance records ({steps} steps, {accepted} accepted) disagree with the "
        f"server's counters ({counters['drafts']} drafts, {counters['accepted_tokens']} accepted)"
    )
    if retried:
        raise EvaluationError(
            f"{disagreement} after {retried} retried request(s): an attempt that failed here may have "
            "run on the server too. Rerun the job; if requests keep timing out, raise "
            "evaluation.request_timeout_s"
        )
    raise EvaluationError(
        f"{disagreement}; the per-request spec-decode metrics of this vLLM differ from what "
        "draftsmith reads: pin the tested vLLM release"
    )


def run(
    settings: RunConfig,
    prompts_path: Path,
    speculation: dict[str, Any] | None,
    output: Path,
    granted_gpus: int | None,
    default_only: bool = False,
    kind: str | None = None,
    start: bool = False,
) -> Measurement:
    stage = evaluation_stage(settings)
    stage.begin(granted_gpus)
    method = speculation and speculation["method"]
    if method in FREE_METHODS and method not in settings.evaluation.free_methods:
        raise EvaluationError(f"{method} is not in evaluation.free_methods; add it there")
    if speculation is not None and speculation["num_speculative_tokens"] not in settings.evaluation.draft_lengths:
        raise EvaluationError(
            f"draft length {speculation['num_speculative_tokens']} is not in evaluation.num_speculative_tokens; "
            "add it there"
        )
    prompts = read_prompts(prompts_path)
    # Every evaluation server runs the target the same way, so the speedup compares like with like.
    attention = evaluation_attention(read_target_shape(settings.target.model), settings.device)
    if attention.mla_disabled:
        log(attention.reason)
    log(f"evaluating on {len(prompts)} prompts in {len({p['set'] for p in prompts})} set(s)")
    result = dataclasses.replace(measure(stage, prompts, speculation, attention, default_only), kind=kind, start=start)
    atomic_write_text(output, result.to_json())
    return result


def main(argv: list[str] | None = None) -> None:
    parser = stage_parser(__doc__)
    parser.add_argument("--stage", required=True, help="the rule whose settings apply")
    parser.add_argument("--prompts", required=True, type=Path, help="the evaluation_sets stage's prompts")
    parser.add_argument("--drafter", type=Path, default=None, help="a drafter directory (none: the baseline)")
    parser.add_argument("--method", choices=sorted(FREE_METHODS), default=None, help="a method without a drafter")
    parser.add_argument("--num-speculative-tokens", type=int, default=None)
    parser.add_argument("--kind", choices=sorted(KINDS), default=None, help="the drafter's kind, if not eagle3")
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--granted-gpus", type=int, default=None)
    parser.add_argument(
        "--default-only", action="store_true", help="greedy at the first concurrency only (the untrained drafter)"
    )
    parser.add_argument("--start", action="store_true", help="the starting drafter (training.from_pretrained)")
    args = parser.parse_args(argv)
    settings = read_settings(args.settings, args.stage)
    speculation = None
    if args.drafter is not None:
        speculation = drafter_speculative_config(args.drafter, args.num_speculative_tokens, args.kind or DEFAULT_KIND)
    elif args.method is not None:
        speculation = free_method_config(args.method, args.num_speculative_tokens)
    run(settings, args.prompts, speculation, args.output, args.granted_gpus, args.default_only, args.kind, args.start)


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
