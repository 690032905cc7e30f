"""The target model as the stages see it before loading it: its config.json, read one way.

Planning, the preflight, training, evaluation and the serve command all need a few numbers
of the target (layers, width, heads, vocabulary) without its weights. They read them here,
from the JSON itself: no model class to import (a Kimi target's needs trust_remote_code),
and planning works from a directory holding just the config. The checks of those numbers
against the config live here too, so the preflight and the stage that would fail say the
same thing.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.errors import DraftsmithError


class TargetError(DraftsmithError):
    pass


def read_target_config(model: str) -> dict:
    """The target's config.json (the text config of a multimodal model), or what to fix."""
    path = Path(model) / "config.json"
    if not path.is_file():
        raise TargetError(
            f"target config {path} not found; set target.model to the model directory "
            "(for planning, a directory holding just its config.json is enough)"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise TargetError(f"target config {path} is unreadable ({error}); fix or re-download it") from error
    config = config.get("text_config", config)
    if "num_hidden_layers" not in config or "hidden_size" not in config:
        raise TargetError(f"{path} has no num_hidden_layers/hidden_size; is target.model a language model?")
    return config


def draft_vocab_problem(draft_vocab_size: int, target_vocab_size: int | None) -> str | None:
    """speculators itself fails with an IndexError deep in vocab_mapping.py."""
    if target_vocab_size and not 0 < draft_vocab_size <= target_vocab_size:
        return (
            f"training.draft_vocab_size {draft_vocab_size} exceeds the target's vocabulary of "
            f"{target_vocab_size}; set it to at most {target_vocab_size}"
        )
    return None
