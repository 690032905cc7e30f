"""The vLLM server that writes hidden states: its flags and what every file it writes holds.

Three stages start one: extraction (a prefill per dataset row), generation in one pass
(``hidden_states.capture: during_generation``: each answer's states as it is written) and
training past a disk budget (the rows not stored, on demand). They share this module, so no
stage imports another.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.disk_budget import StoredRowFormat
from draftsmith.layers import LayerPlan, resolve_layers
from draftsmith.run_config import RunConfig
from draftsmith.shard_gate import check_sample
from draftsmith.target import TargetShape, read_target_shape

# The speculative method of the capture server (vLLM's SpeculativeMethod).
SPECULATIVE_METHODS = ["extract_hidden_states"]
VLLM_STORAGE_DIR = "vllm"  # inside staging: same filesystem, so moves are atomic renames
# The connector vLLM loads by name (draftsmith/hidden_states_connector.py); named here so
# that this module does not import vLLM.
CONNECTOR_MODULE = "draftsmith.hidden_states_connector"
CONNECTOR_NAME = "CpuSafeHiddenStatesConnector"
FP8_CONNECTOR_NAME = "CpuSafeFP8HiddenStatesConnector"  # hidden_states.stored_dtype: fp8


@dataclass(frozen=True)
class SampleShape:
    """What every file of this target must look like (see ``shard_gate.check_sample``): the
    stored row format that also sizes the disk budget, with its dtypes as torch's."""

    row: StoredRowFormat

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the target is served in."""
        return getattr(torch, self.row.value_dtype)

    @property
    def stored_dtype(self) -> torch.dtype:
        return getattr(torch, self.row.stored_dtype)

    def check(self, path: Path, token_ids: Sequence[int]) -> None:
        check_sample(path, token_ids, self.row.num_layers, self.row.hidden_size, self.stored_dtype)


def target_shape(settings: RunConfig) -> tuple[LayerPlan, SampleShape]:
    """Layer count, width and dtype from the target's config.json; layers resolved once."""
    target = read_target_shape(settings.target.model)
    plan = resolve_layers(list(settings.layers), target.num_hidden_layers)
    return plan, sample_shape(settings, target)


def sample_shape(settings: RunConfig, target: TargetShape) -> SampleShape:
    """What each stored or captured file holds, for a target and layers already read."""
    return SampleShape(settings.stored_row(target))


def extraction_server_args(plan: LayerPlan, storage_dir: Path, shape: SampleShape) -> list[str]:
    """vLLM flags for extraction mode; ids are all stored layers, in vLLM's numbering."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": plan.vllm_ids}},
    }
    kv_transfer = {
        "kv_connector": FP8_CONNECTOR_NAME if shape.row.fp8 else CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }
    return [
        # Eager, whatever server.extra_args say: vLLM's own example of this method runs eager,
        # and our connector is untried under CUDA graphs. Only the capture server: evaluation
        # keeps the graphs, whose speed is what it measures.
        "--enforce-eager",
        "--speculative-config",
        json.dumps(speculative),
        "--kv-transfer-config",
        json.dumps(kv_transfer),
        "--dtype",
        shape.row.value_dtype,
    ]
