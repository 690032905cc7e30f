"""The kinds of drafter speculators trains (``speculators train --speculator-type``), and
what the installed vLLM does with each: how it is served, and on which device; and the
speculative methods vLLM serves with no drafter (``evaluation.free_methods``). The config
schema's lists of both are checked against these (tests/test_config.py).

What is true here was measured on this release pair (speculators 0.9, vLLM 0.32): each kind
trained for one epoch on the demo's data on a CPU, then a vLLM CPU server was started with
it and asked one chat completion. The reasons below are vLLM's own errors and code.

Every kind that trains reads the same rows and hidden-state files as EAGLE-3: the auxiliary
layers and the last configured layer (``layers``), so a second kind costs no extraction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith import vllm_build

EAGLE3 = "eagle3"  # speculators' and vLLM's name of the kind (and of its serving method)
DEFAULT_KIND = EAGLE3  # the drafter the workflow has always trained: drafter/, eval/drafter_k<k>
# The method name of the starting drafter (training.from_pretrained) in the evaluation: the
# published drafter before the run's data, eval/start_k<k>.
START_METHOD = "start"


@dataclass(frozen=True)
class DrafterKind:
    name: str
    # vLLM's --speculative-config fields besides model and num_speculative_tokens.
    serving: dict[str, Any] = field(default_factory=dict)
    devices: tuple[str, ...] = ("cpu", "cuda")  # where vLLM 0.32 serves it
    unserved_because: str = ""  # vLLM's reason, on the devices it is not in
    full_vocabulary: bool = False  # trains only with draft_vocab_size = the target's vocabulary


KINDS: dict[str, DrafterKind] = {
    kind.name: kind
    for kind in (
        DrafterKind(EAGLE3, serving={"method": EAGLE3}),
        # Block drafting: non-causal attention over masked positions; vLLM's CPU build has a
        # C++ path for its input kernel (platforms/cpu.py) and a non-causal CPU attention.
        DrafterKind("dflash", serving={"method": "dflash"}),
        # P-EAGLE: an EAGLE-3 head that drafts every position in one forward.
        DrafterKind("peagle", serving={"method": EAGLE3, "parallel_drafting": True}),
        DrafterKind(
            "dflash2",
            serving={"method": "dflash"},
            devices=("cuda",),
            unserved_because="vLLM's V1 model runner refuses 'DFlash candidate-head drafts', "
            "and its V2 runner needs Triton, which the CPU build lacks",
            full_vocabulary=True,
        ),
        DrafterKind(
            "dspark",
            serving={"method": "dspark"},
            devices=("cuda",),
            unserved_because="vLLM's V1 model runner refuses 'dspark speculative decoding', "
            "and its V2 runner needs Triton, which the CPU build lacks",
        ),
        DrafterKind(
            "xpress",
            devices=(),
            unserved_because="vLLM 0.32 has no speculative method for it (not among the speculators "
            "formats it loads: eagle3, peagle, dflash, dflash2, dspark)",
        ),
        DrafterKind(
            "mtp",
            devices=(),
            unserved_because="speculators trains it only for targets with their own MTP head (Qwen3 "
            "families), and vLLM serves MTP as part of the target, not as a speculators drafter",
        ),
    )
}


@dataclass(frozen=True)
class FreeMethod:
    """A speculative method vLLM serves without a trained drafter."""

    name: str
    # vLLM's --speculative-config fields besides method and num_speculative_tokens: what we
    # measure it at.
    options: dict[str, Any] = field(default_factory=dict)
    # (module, distribution) of a package it needs beside vLLM, which vLLM imports only once
    # the server is up: checked by the preflight, before any model loads.
    package: tuple[str, str] | None = None


FREE_METHODS: dict[str, FreeMethod] = {
    method.name: method
    for method in (
        # n-gram looks up the last 2 to 4 tokens in the prompt and the answer so far (the lookup
        # window we compared it at when it beat a drafter on a real model).
        FreeMethod("ngram", options={"prompt_lookup_min": 2, "prompt_lookup_max": 4}),
        FreeMethod("suffix", package=("arctic_inference", "arctic-inference")),
    )
}


def serving_problem(kind: str, device: str) -> str | None:
    """One line naming why vLLM cannot serve ``kind`` on ``device`` and what to do, or None."""
    known = KINDS[kind]
    if device in known.devices:
        if vllm_build.installed_version() is None or vllm_build.loads_speculators_format(kind):
            return None
        newest = vllm_build.dotted(vllm_build.SUPPORTED[device][1])
        return (
            f"config training.kinds: the installed vLLM does not read {kind} drafters (its format came in a later "
            f"release); drop {kind} from training.kinds or install vLLM {newest}"
        )
    where = f"only on {', '.join(known.devices)}" if known.devices else "on no device"
    servable = sorted(name for name, other in KINDS.items() if device in other.devices)
    return (
        f"config training.kinds: {kind} is served {where} by vLLM 0.32 ({known.unserved_because}); "
        f"on device {device} use {', '.join(servable)}"
    )


def speculative_config(kind: str, drafter: str, num_speculative_tokens: int) -> dict[str, Any]:
    """The value of vLLM's ``--speculative-config`` that serves a ``kind`` drafter. The method
    is always named: without it vLLM serves a drafter directory as a plain draft model."""
    return {"model": drafter, **KINDS[kind].serving, "num_speculative_tokens": num_speculative_tokens}


def drafter_speculative_config(drafter: Path, num_speculative_tokens: int, kind: str = DEFAULT_KIND) -> dict[str, Any]:
    """The value of vLLM's ``--speculative-config`` that serves ``drafter`` (of ``kind``)."""
    return speculative_config(kind, str(drafter.resolve()), num_speculative_tokens)


def free_method_config(method: str, num_speculative_tokens: int) -> dict[str, Any]:
    """The value of vLLM's ``--speculative-config`` for a method that needs no drafter."""
    return {"method": method, "num_speculative_tokens": num_speculative_tokens, **FREE_METHODS[method].options}
