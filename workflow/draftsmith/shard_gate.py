"""The gate every hidden-state file passes before it counts as extracted.

Silent wrong data is the worst failure in this pipeline: the seed once produced
771 tensors of shape [512] per sample instead of 4 x [512, 7168], and training ran
on it. A file passes only if it has exactly the layout vLLM's hidden-state connector
writes (``hidden_states`` [tokens, layers, hidden], ``token_ids`` [tokens]) with the
target's layer count, width and dtype, finite values, no dead layer, and the token
ids of its dataset row. Stored as fp8 (``hidden_states.stored_dtype``), a file also holds
hs_connectors' per-token scales [tokens, 1, 1], and the values are checked dequantized.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import torch
from hs_connectors.fp8_utils import SCALES_KEY, dequantize_fp8_tensor
from safetensors import safe_open

from draftsmith.errors import DraftsmithError
from draftsmith.layout import hidden_state_file

EXPECTED_KEYS = ("hidden_states", "token_ids")
FP8_KEYS = (*EXPECTED_KEYS, SCALES_KEY)
SHOW_FIRST = 5
# safetensors header names -> torch names, for comparing with the target's dtype.
SAFETENSORS_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


class BadSample(DraftsmithError):
    """A hidden-state file that must not be used; the message names the file and why."""


def _describe_layout(shapes: Mapping[str, list[int]]) -> str:
    shown = ", ".join(f"{key!r} {shape}" for key, shape in list(shapes.items())[:3])
    more = ", ..." if len(shapes) > 3 else ""
    return f"{len(shapes)} tensor(s): {shown}{more}"


def _read_layout(path: Path) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Keys, shapes and dtypes from the header only (cheap; catches truncated files)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = list(handle.keys())
            shapes = {key: list(handle.get_slice(key).get_shape()) for key in keys}
            dtypes = {key: handle.get_slice(key).get_dtype() for key in keys}
    except FileNotFoundError:
        # safetensors reports every failure to open a file as "not found": the file is missing
        # only if it is not there. A GPU run once had 1,481 present files reported missing.
        if not path.exists():
            raise BadSample(f"{path}: file is missing") from None
        raise BadSample(f"{path}: present but could not be opened ({open_files()})") from None
    except Exception as error:  # safetensors raises its own error types
        raise BadSample(f"{path}: not a readable safetensors file ({error})") from None
    return shapes, dtypes


def _check_layout(path: Path, shapes: dict[str, list[int]], expected_shape: list[int], fp8: bool) -> None:
    if sorted(shapes) != sorted(FP8_KEYS if fp8 else EXPECTED_KEYS):
        scales = f" and {SCALES_KEY!r} [{expected_shape[0]}, 1, 1]" if fp8 else ""
        raise BadSample(
            f"{path}: wrong layout, holds {_describe_layout(shapes)}; expected exactly "
            f"'hidden_states' {expected_shape}, 'token_ids' [{expected_shape[0]}]{scales}"
        )
    if fp8 and shapes[SCALES_KEY] != [expected_shape[0], 1, 1]:
        raise BadSample(f"{path}: {SCALES_KEY} has shape {shapes[SCALES_KEY]}, expected [{expected_shape[0]}, 1, 1]")
    if shapes["hidden_states"] != expected_shape:
        raise BadSample(
            f"{path}: hidden_states has shape {shapes['hidden_states']}, expected "
            f"{expected_shape} [tokens, layers, hidden]"
        )
    if shapes["token_ids"] != expected_shape[:1]:
        raise BadSample(f"{path}: token_ids has shape {shapes['token_ids']}, expected {expected_shape[:1]}")


def _check_values(path: Path, hidden_states: torch.Tensor) -> None:
    if not torch.isfinite(hidden_states).all():
        bad = (~torch.isfinite(hidden_states)).sum().item()
        raise BadSample(f"{path}: hidden_states holds {bad} non-finite value(s) (nan/inf)")
    for layer in range(hidden_states.shape[1]):
        values = hidden_states[:, layer, :]
        low, high = torch.aminmax(values)
        if low == high == 0:
            raise BadSample(f"{path}: stored layer {layer} is all zeros")
        if low == high:
            raise BadSample(f"{path}: stored layer {layer} is constant ({low.item()} everywhere)")
        dead_tokens = (values == 0).all(dim=-1).nonzero().flatten()
        if len(dead_tokens):
            raise BadSample(
                f"{path}: stored layer {layer} is all zeros at {len(dead_tokens)} token(s), "
                f"first at position {dead_tokens[0].item()}, last at {dead_tokens[-1].item()} of "
                f"{values.shape[0]} tokens (a slot that was never written?)"
            )


def check_sample(
    path: Path,
    expected_token_ids: Sequence[int],
    num_layers_stored: int,
    hidden_size: int,
    dtype: torch.dtype,
) -> None:
    """Raise ``BadSample`` unless ``path`` is a complete, plausible sample of its row."""
    path = Path(path)
    expected_token_ids = [int(token) for token in expected_token_ids]
    expected_shape = [len(expected_token_ids), num_layers_stored, hidden_size]
    shapes, dtypes = _read_layout(path)
    fp8 = dtype == torch.float8_e4m3fn
    _check_layout(path, shapes, expected_shape, fp8)
    expected_dtype = str(dtype).removeprefix("torch.")
    found_dtype = SAFETENSORS_DTYPES.get(dtypes["hidden_states"], dtypes["hidden_states"])
    if found_dtype != expected_dtype:
        why = "hidden_states.stored_dtype: fp8" if fp8 else "the dtype the target is served in"
        raise BadSample(f"{path}: hidden_states dtype is {found_dtype}, expected {expected_dtype} ({why})")
    with safe_open(str(path), framework="pt") as handle:
        token_ids = handle.get_tensor("token_ids").tolist()
        if token_ids != expected_token_ids:
            first = next(i for i, (a, b) in enumerate(zip(token_ids, expected_token_ids, strict=True)) if a != b)
            raise BadSample(
                f"{path}: token_ids differ from the dataset row at position {first} "
                f"(file {token_ids[first]}, dataset {expected_token_ids[first]})"
            )
        hidden_states = handle.get_tensor("hidden_states")
        if fp8:
            hidden_states = dequantize_fp8_tensor(hidden_states, handle.get_tensor(SCALES_KEY), torch.float32)
        _check_values(path, hidden_states)


def open_files() -> str:
    """How many files this process holds open, against its limit (for errors that may be it)."""
    try:
        held: int | str = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc, or no descriptor left even to list them
        held = "all its"
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return f"this process holds {held} open files, limit {soft} (ulimit -n)"


def check_shard(
    directory: Path,
    rows: Mapping[int, Sequence[int]],
    num_layers_stored: int,
    hidden_size: int,
    dtype: torch.dtype,
    already_gated: Collection[int] = (),
) -> None:
    """Check ``hs_<row>.safetensors`` for every row (row -> its token ids); a row in
    ``already_gated`` passed ``check_sample`` in this process, so only its presence is checked
    (reading a 6,079-row shard a second time cost 55 s of GPU-machine time).

    Raises one ``BadSample`` naming how many failed and the first few with reasons.
    """
    failures = []
    for row, token_ids in rows.items():
        path = hidden_state_file(directory, row)
        try:
            if row not in already_gated:
                check_sample(path, token_ids, num_layers_stored, hidden_size, dtype)
            elif not path.exists():
                raise BadSample(f"{path}: file is missing")
        except BadSample as error:
            failures.append(str(error))
    if failures:
        shown = "; ".join(failures[:SHOW_FIRST])
        more = f"; and {len(failures) - SHOW_FIRST} more" if len(failures) > SHOW_FIRST else ""
        raise BadSample(f"{len(failures)} of {len(rows)} samples in {directory} failed the gate: {shown}{more}")
