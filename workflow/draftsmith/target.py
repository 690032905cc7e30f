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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from draftsmith.errors import DraftsmithError


class TargetError(DraftsmithError):
    pass


def read_target_config(model: str) -> dict[str, Any]:
    """The target's config.json (the text config of a multimodal model), or what to fix."""
    config = _read_config_json(model)
    text_config = config.get("text_config", config)
    if "num_hidden_layers" not in text_config or "hidden_size" not in text_config:
        raise TargetError(
            f"{Path(model) / 'config.json'} has no num_hidden_layers/hidden_size; is target.model a language model?"
        )
    # The checkpoint's dtype may be said only at the top of a multimodal config.
    dtype = (
        text_config.get("dtype") or text_config.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
    )
    return text_config | {"dtype": dtype}


def _read_config_json(model: str) -> dict[str, Any]:
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
    return config


@dataclass(frozen=True)
class TargetShape:
    """The numbers of the target's (text) config the stages use, read once."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    # Multi-head latent attention (DeepSeek-V3, Kimi): the cached latent and the rope key.
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    dtype: str | None = None  # the checkpoint's ("bfloat16"); None if it does not say

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Self:
        return cls(
            config["num_hidden_layers"],
            config["hidden_size"],
            config.get("num_attention_heads"),
            config.get("num_key_value_heads"),
            config.get("head_dim"),
            config.get("vocab_size"),
            config.get("kv_lora_rank"),
            config.get("qk_rope_head_dim") or 0,
            config.get("qk_nope_head_dim") or 0,
            config.get("dtype"),
        )

    @property
    def mla(self) -> bool:
        return bool(self.kv_lora_rank)

    @property
    def mla_latent(self) -> int:
        """What MLA caches per token and layer: the latent and the rope key."""
        return (self.kv_lora_rank or 0) + self.qk_rope_head_dim

    @property
    def mla_query_head(self) -> int:
        """The attention head with MLA disabled (ordinary attention): nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def read_target_shape(model: str) -> TargetShape:
    return TargetShape.from_dict(read_target_config(model))


def draft_vocab_problem(draft_vocab_size: int, target_vocab_size: int | None) -> str | None:
    """speculators itself fails with an IndexError deep in vocab_mapping.py."""
    if target_vocab_size and not 0 < draft_vocab_size <= target_vocab_size:
        return (
            f"training.draft_vocab_size {draft_vocab_size} exceeds the target's vocabulary of "
            f"{target_vocab_size}; set it to at most {target_vocab_size}"
        )
    return None
