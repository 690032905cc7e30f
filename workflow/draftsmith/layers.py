"""The one place where the config's layer numbers become vLLM's hidden-state ids.

Convention of the config (``layers``): each entry is a 0-based decoder layer of the
target, and we take that layer's *output*. The last entry must be the final decoder
layer (``num_layers - 1``); its output is what the drafter learns to predict.
Kimi-K2.5 (61 layers): ``[2, 30, 58, 60]``.

vLLM numbers hidden states by the decoder layer they *enter*: id ``i`` is the input
of layer ``i`` (= output of layer ``i - 1``) and id ``num_layers`` is the output of
the last layer before the final norm (checked against a Hugging Face forward pass,
where vLLM id ``i`` equals ``hidden_states[i]``). So vLLM id = config layer + 1.
Older speculators captured layer outputs while vLLM captures layer inputs; mixing
the two shifts every layer by one, silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.errors import DraftsmithError


class LayerConfigError(DraftsmithError):
    pass


@dataclass(frozen=True)
class LayerPlan:
    """Config layers resolved against a target with ``num_layers`` decoder layers."""

    config_layers: tuple[int, ...]
    num_layers: int

    @property
    def vllm_ids(self) -> list[int]:
        """Ids to extract: what ``eagle_aux_hidden_state_layer_ids`` + final mean to vLLM."""
        return [layer + 1 for layer in self.config_layers]

    @property
    def aux_vllm_ids(self) -> list[int]:
        """The drafter's auxiliary inputs (all but the final layer, which is the target)."""
        return self.vllm_ids[:-1]


def resolve_layers(config_layers: list[int], num_layers: int) -> LayerPlan:
    """Check the config's layers against the target and return the plan, or say what to fix."""
    if len(config_layers) < 2:
        raise LayerConfigError(
            f"layers {config_layers}: need at least one auxiliary layer plus the final layer; "
            f"e.g. [2, {num_layers // 2}, {num_layers - 1}]"
        )
    for layer in config_layers:
        if not 0 <= layer < num_layers:
            raise LayerConfigError(
                f"layer {layer} does not exist: the target has {num_layers} decoder layers "
                f"(0..{num_layers - 1}); fix `layers` in the config"
            )
    if list(config_layers) != sorted(set(config_layers)):
        raise LayerConfigError(f"layers {config_layers} must be strictly increasing without repeats; fix `layers`")
    if config_layers[-1] != num_layers - 1:
        raise LayerConfigError(
            f"the last entry of layers must be the final decoder layer {num_layers - 1} "
            f"(the training target), got {config_layers[-1]}; fix `layers` in the config"
        )
    return LayerPlan(tuple(config_layers), num_layers)
