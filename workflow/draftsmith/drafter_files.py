"""A drafter directory on disk, read without loading it: which layout it is in, what target it
was made for, whether its weights match its config, and its identity by content.

``training.from_pretrained`` names such a directory; the preflight, the start_drafter stage,
the training stage and the plan all read it through here. Each problem is one line naming the
field on each side and the fix.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from draftsmith.drafter_kinds import EAGLE3
from draftsmith.errors import DraftsmithError
from draftsmith.layers import LayerPlan

SPECULATORS = "speculators"
RESEARCH = "research EAGLE-3"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# The vocabulary map the training job hands speculators (--d2t-path, --t2d-path).
D2T, T2D = "d2t.npy", "t2d.npy"


class StartDrafterError(DraftsmithError):
    pass


@dataclass(frozen=True)
class DrafterFacts:
    """What a drafter directory says about the target it was made for, read from its config
    and its weights' headers (no tensor is loaded)."""

    path: Path
    layout: str  # SPECULATORS or RESEARCH
    kind: str  # speculators_model_type; EAGLE3 for a research checkpoint
    target_hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int] | None  # vLLM ids; None: the research config names none
    norm_before_residual: bool = False

    def describe(self) -> str:
        ids = "vLLM's default layers" if self.aux_layer_ids is None else f"layers {_ids(self.aux_layer_ids)}"
        name = self.layout if self.layout == RESEARCH else f"{self.layout} {self.kind}"
        return (
            f"{name} drafter at {self.path}: reads {ids} of a target of hidden size "
            f"{self.target_hidden_size} and vocabulary {self.target_vocab_size}, drafts from "
            f"{self.draft_vocab_size} tokens"
        )


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids))


def weights_file(path: Path) -> Path | None:
    return next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None)


def weight_shapes(weights: Path) -> dict[str, list[int]]:
    """Each tensor's shape, from the file's header: seconds even for a drafter of gigabytes."""
    try:
        if weights.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(weights), framework="pt") as handle:
                return {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
        import torch

        state = torch.load(weights, map_location="cpu", mmap=True, weights_only=True)
        return {name: list(tensor.shape) for name, tensor in state.items()}
    except Exception as error:  # a truncated or foreign file: safetensors and torch raise many kinds
        raise StartDrafterError(
            f"training.from_pretrained: the weights {weights} cannot be read ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'no detail'}); copy the drafter again"
        ) from error


def _aux_ids(config: dict[str, Any]) -> list[int] | None:
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:  # SpecForge keeps them in a section of their own
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids is not None else None


def read_drafter(path: Path) -> DrafterFacts:
    """The drafter's facts, or one line naming what is wrong with the directory."""
    where = f"training.from_pretrained {path}"
    if not path.is_dir():
        raise StartDrafterError(f"{where} is not a directory; point it at a drafter's directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise StartDrafterError(f"{where} holds no drafter (no config.json); point it at a drafter's directory")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise StartDrafterError(f"{where}: config.json is not JSON ({error}); copy the drafter again") from error
    weights = weights_file(path)
    if weights is None:
        raise StartDrafterError(
            f"{where} has a config but no weights ({' or '.join(WEIGHT_FILES)}); a published drafter "
            "ships its weights: copy them beside config.json"
        )
    shapes = weight_shapes(weights)
    if "speculators_model_type" in config:
        facts = _speculators_facts(path, config)
    elif any("Eagle3" in name for name in config.get("architectures", [])) or any(
        name.startswith("midlayer.") for name in shapes
    ):
        facts = _research_facts(path, config, shapes)
    else:
        raise StartDrafterError(
            f"{where} is neither a speculators drafter (no speculators_model_type in config.json) nor a "
            f"research EAGLE-3 checkpoint (architectures {config.get('architectures')}, no midlayer.* "
            "weights); give an EAGLE-3 drafter in one of those layouts"
        )
    if problem := shape_problem(facts, shapes):
        raise StartDrafterError(f"{where}: {problem}; the weights do not belong to this config: copy the drafter again")
    return facts


def _speculators_facts(path: Path, config: dict[str, Any]) -> DrafterFacts:
    layer = config.get("transformer_layer_config", {})
    try:
        return DrafterFacts(
            path=path,
            layout=SPECULATORS,
            kind=config["speculators_model_type"],
            target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"],
            target_vocab_size=layer["vocab_size"],
            draft_vocab_size=config["draft_vocab_size"],
            aux_layer_ids=_aux_ids(config),
        )
    except KeyError as error:
        raise StartDrafterError(
            f"training.from_pretrained {path}: config.json lacks {error.args[0]}; copy the drafter again"
        ) from error


def _research_facts(path: Path, config: dict[str, Any], shapes: dict[str, list[int]]) -> DrafterFacts:
    """speculators' converter reads the target's vocabulary from ``t2d``, else the config."""
    try:
        vocab = shapes["t2d"][0] if "t2d" in shapes else config["vocab_size"]
        return DrafterFacts(
            path=path,
            layout=RESEARCH,
            kind=EAGLE3,
            target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
            target_vocab_size=vocab,
            draft_vocab_size=config.get("draft_vocab_size") or vocab,
            aux_layer_ids=_aux_ids(config),
            norm_before_residual=bool(config.get("norm_before_residual", False)),
        )
    except KeyError as error:
        raise StartDrafterError(
            f"training.from_pretrained {path}: config.json lacks {error.args[0]}; copy the drafter again"
        ) from error


def shape_problem(facts: DrafterFacts, shapes: dict[str, list[int]]) -> str | None:
    """The weights against the config: the output head drafts ``draft_vocab_size`` tokens, the
    map has one entry per draft token (``d2t``) and per target token (``t2d``), and ``fc``
    folds the auxiliary layers of the target's width."""
    expected = {"d2t": [facts.draft_vocab_size], "t2d": [facts.target_vocab_size]}
    if "lm_head.weight" in shapes:
        expected["lm_head.weight"] = [facts.draft_vocab_size, shapes["lm_head.weight"][1]]
    for name, shape in expected.items():
        if name in shapes and shapes[name] != shape:
            return f"tensor {name} has shape {shapes[name]}, the config implies {shape}"
    fc, width = shapes.get("fc.weight"), facts.target_hidden_size
    if fc is None:
        return None
    if len(fc) != 2 or fc[1] % width:
        return f"tensor fc.weight has shape {fc}, its inputs not a multiple of the target hidden size {width}"
    layers = len(facts.aux_layer_ids) if facts.aux_layer_ids is not None else fc[1] // width
    if fc[1] != layers * width:
        return f"tensor fc.weight has shape {fc}, the config's {layers} aux layers imply {[fc[0], layers * width]}"
    return None


def default_aux_ids(num_layers: int) -> list[int]:
    """What vLLM reads for an EAGLE-3 drafter whose config names no layers."""
    return [2, num_layers // 2, num_layers - 3]


def compatibility_problems(
    facts: DrafterFacts,
    *,
    hidden_size: int,
    vocab_size: int | None,
    plan: LayerPlan,
    draft_vocab_size: int,
    target_name: str,
) -> list[str]:
    """The drafter against the target and the config: one line per mismatch, naming the field
    on each side and the config change that fixes it."""
    problems = []
    lead = f"training.from_pretrained: the drafter at {facts.path}"
    if facts.kind != EAGLE3:
        problems.append(
            f"{lead} is a {facts.kind} drafter (speculators_model_type); from_pretrained continues the EAGLE-3 "
            "drafter: give an eagle3 drafter"
        )
    if facts.target_hidden_size != hidden_size:
        problems.append(
            f"{lead} reads hidden states of width {facts.target_hidden_size} (its target_hidden_size), the target "
            f"{target_name} has hidden_size {hidden_size}: it was made for another model; give a drafter of this target"
        )
    if vocab_size is not None and facts.target_vocab_size != vocab_size:
        problems.append(
            f"{lead} maps a vocabulary of {facts.target_vocab_size} tokens (its t2d / vocab_size), the target "
            f"{target_name} has vocab_size {vocab_size}: it was made for another tokenizer; "
            "give a drafter of this target"
        )
    drafter_ids = facts.aux_layer_ids if facts.aux_layer_ids is not None else default_aux_ids(plan.num_layers)
    if drafter_ids != plan.aux_vllm_ids:
        # vLLM id i is the output of 0-based layer i-1 (layers.py); the last entry is the target's final layer.
        fix = [i - 1 for i in drafter_ids] + [plan.num_layers - 1]
        which = "its eagle_aux_hidden_state_layer_ids" if facts.aux_layer_ids is not None else "vLLM's default"
        problems.append(
            f"{lead} reads vLLM layers {_ids(drafter_ids)} ({which}), the config's layers "
            f"{list(plan.config_layers)} give {_ids(plan.aux_vllm_ids)}; set layers: {fix}"
        )
    if facts.draft_vocab_size != draft_vocab_size:
        problems.append(
            f"{lead} drafts from {facts.draft_vocab_size} tokens (its draft_vocab_size), the config says "
            f"training.draft_vocab_size {draft_vocab_size}: the size comes from the drafter; set "
            f"training.draft_vocab_size: {facts.draft_vocab_size}"
        )
    return problems


# --- the drafter as an input by content ----------------------------------------------------


def content_fingerprint(path: str | Path) -> str:
    """sha256 over the drafter's files (names and bytes), so that a copy elsewhere or a new
    mtime changes nothing and one changed byte changes it. Cached per process and per
    (path, size, mtime) of every file: Snakemake asks once per rule that tracks it."""
    root = Path(path).expanduser().resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
    stamp = tuple((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _fingerprint(root, stamp)


@cache
def _fingerprint(root: Path, stamp: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for name, _size, _mtime in stamp:
        digest.update(name.encode() + b"\0")
        with (root / name).open("rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()
