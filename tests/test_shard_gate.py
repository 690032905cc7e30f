"""The hidden-state gate: every way a sample can be wrong is rejected with the file named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.layout import hidden_state_file
from draftsmith.shard_gate import BadSample, check_sample, check_shard

LAYERS, HIDDEN, DTYPE = 4, 64, torch.bfloat16
TOKENS = [5, 9, 2, 7, 7, 3]


def good_tensors(tokens: list[int] = TOKENS) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(len(tokens))
    return {
        "hidden_states": torch.randn(len(tokens), LAYERS, HIDDEN, generator=generator).to(DTYPE),
        "token_ids": torch.tensor(tokens, dtype=torch.long),
    }


def write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, str(path))
    return path


def rejection(path: Path, tokens: list[int] = TOKENS) -> str:
    with pytest.raises(BadSample) as caught:
        check_sample(path, tokens, LAYERS, HIDDEN, DTYPE)
    message = str(caught.value)
    assert path.name in message, f"message does not name the file: {message}"
    return message


def test_good_sample_passes(tmp_path: Path) -> None:
    check_sample(write(tmp_path / "hs_0.safetensors", good_tensors()), TOKENS, LAYERS, HIDDEN, DTYPE)


def test_single_token_sample_passes(tmp_path: Path) -> None:
    """One token: a layer is a single vector, which must not count as 'constant'."""
    path = write(tmp_path / "hs_0.safetensors", good_tensors([11]))
    check_sample(path, [11], LAYERS, HIDDEN, DTYPE)


def test_rejects_seed_layout_of_771_flat_tensors(tmp_path: Path) -> None:
    """The seed's bug: 771 tensors of shape [512] instead of 4 x [512, 7168]."""
    flat = {f"hidden_states.{i}": torch.randn(512).to(DTYPE) for i in range(771)}
    message = rejection(write(tmp_path / "hs_3.safetensors", flat), list(range(512)))
    assert "wrong layout" in message and "771 tensor(s)" in message and "[512]" in message


@pytest.mark.parametrize(
    "shape",
    [
        (len(TOKENS), LAYERS - 1, HIDDEN),
        (LAYERS, len(TOKENS), HIDDEN),
        (len(TOKENS), LAYERS * HIDDEN),
    ],
    ids=["one-layer-short", "layers-and-tokens-swapped", "layers-flattened"],
)
def test_rejects_wrong_shape(tmp_path: Path, shape: tuple[int, ...]) -> None:
    tensors = good_tensors() | {"hidden_states": torch.randn(shape).to(DTYPE)}
    message = rejection(write(tmp_path / "hs_1.safetensors", tensors))
    assert f"shape {list(shape)}" in message and f"[{len(TOKENS)}, {LAYERS}, {HIDDEN}]" in message


def test_rejects_extra_keys(tmp_path: Path) -> None:
    tensors = good_tensors() | {"extra": torch.zeros(1)}
    assert "wrong layout" in rejection(write(tmp_path / "hs_1.safetensors", tensors))


def test_rejects_wrong_dtype(tmp_path: Path) -> None:
    tensors = good_tensors()
    tensors["hidden_states"] = tensors["hidden_states"].float()
    assert "dtype is float32, expected bfloat16" in rejection(write(tmp_path / "hs_1.safetensors", tensors))


def test_rejects_non_finite(tmp_path: Path) -> None:
    tensors = good_tensors()
    tensors["hidden_states"][2, 1, 7] = float("nan")
    tensors["hidden_states"][0, 0, 0] = float("inf")
    assert "2 non-finite" in rejection(write(tmp_path / "hs_1.safetensors", tensors))


def test_rejects_all_zero_layer(tmp_path: Path) -> None:
    tensors = good_tensors()
    tensors["hidden_states"][:, 2, :] = 0
    assert "layer 2 is all zeros" in rejection(write(tmp_path / "hs_1.safetensors", tensors))


def test_rejects_constant_layer(tmp_path: Path) -> None:
    tensors = good_tensors()
    tensors["hidden_states"][:, 1, :] = 0.5
    assert "layer 1 is constant" in rejection(write(tmp_path / "hs_1.safetensors", tensors))


def test_rejects_zero_token_row(tmp_path: Path) -> None:
    """A token whose state was never written (a wrong slot mapping) reads as zeros."""
    tensors = good_tensors()
    tensors["hidden_states"][4:6, 3, :] = 0
    message = rejection(write(tmp_path / "hs_1.safetensors", tensors))
    tokens = tensors["token_ids"].shape[0]
    assert f"layer 3 is all zeros at 2 token(s), first at position 4, last at 5 of {tokens} tokens" in message


def test_rejects_token_mismatch(tmp_path: Path) -> None:
    path = write(tmp_path / "hs_1.safetensors", good_tensors())
    other = TOKENS[:3] + [99] + TOKENS[4:]
    assert "differ from the dataset row at position 3 (file 7, dataset 99)" in rejection(path, other)


def test_rejects_token_count_mismatch(tmp_path: Path) -> None:
    path = write(tmp_path / "hs_1.safetensors", good_tensors())
    assert "hidden_states has shape" in rejection(path, TOKENS + [1])


def test_rejects_truncated_and_missing_files(tmp_path: Path) -> None:
    path = write(tmp_path / "hs_1.safetensors", good_tensors())
    path.write_bytes(path.read_bytes()[:-100])
    assert "not a readable safetensors file" in rejection(path)
    assert "file is missing" in rejection(tmp_path / "hs_2.safetensors")


def test_check_shard_names_count_and_files(tmp_path: Path) -> None:
    rows = {row: TOKENS for row in range(4)}
    for row in (0, 1, 3):
        write(hidden_state_file(tmp_path, row), good_tensors())
    bad = good_tensors()
    bad["hidden_states"][:, 0, :] = 0
    write(hidden_state_file(tmp_path, 3), bad)
    with pytest.raises(BadSample) as caught:
        check_shard(tmp_path, rows, LAYERS, HIDDEN, DTYPE)
    message = str(caught.value)
    assert message.startswith("2 of 4 samples")
    assert "hs_2.safetensors: file is missing" in message and "hs_3.safetensors" in message
    check_shard(tmp_path, {row: TOKENS for row in (0, 1)}, LAYERS, HIDDEN, DTYPE)


def fp8_tensors(tokens: list[int] = TOKENS) -> dict[str, torch.Tensor]:
    """A row as ``hidden_states.stored_dtype: fp8`` writes it (hs_connectors' quantizer)."""
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

    tensors = good_tensors(tokens)
    quantized, scales = quantize_tensor_to_fp8(tensors["hidden_states"])
    return tensors | {"hidden_states": quantized, SCALES_KEY: scales}


def test_fp8_rows_pass_with_their_scales_and_fail_without(tmp_path: Path) -> None:
    fp8 = torch.float8_e4m3fn
    check_sample(write(tmp_path / "hs_0.safetensors", fp8_tensors()), TOKENS, LAYERS, HIDDEN, fp8)
    no_scales = {key: value for key, value in fp8_tensors().items() if key != "hidden_states_scales"}
    with pytest.raises(BadSample, match="expected exactly .*'hidden_states_scales'"):
        check_sample(write(tmp_path / "hs_1.safetensors", no_scales), TOKENS, LAYERS, HIDDEN, fp8)
    # A row stored as served where fp8 is configured (or the other way round) is refused.
    with pytest.raises(BadSample, match="wrong layout"):
        check_sample(write(tmp_path / "hs_2.safetensors", good_tensors()), TOKENS, LAYERS, HIDDEN, fp8)
    with pytest.raises(BadSample, match="wrong layout"):
        check_sample(tmp_path / "hs_0.safetensors", TOKENS, LAYERS, HIDDEN, DTYPE)


def test_fp8_values_are_checked_dequantized(tmp_path: Path) -> None:
    """A dead layer stays dead through the quantizer: the gate sees it in the fp8 file."""
    tensors = good_tensors()
    tensors["hidden_states"][2, 1] = 0
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

    quantized, scales = quantize_tensor_to_fp8(tensors["hidden_states"])
    path = write(tmp_path / "hs_4.safetensors", tensors | {"hidden_states": quantized, SCALES_KEY: scales})
    with pytest.raises(BadSample, match="layer 1 is all zeros at 1 token"):
        check_sample(path, TOKENS, LAYERS, HIDDEN, torch.float8_e4m3fn)


def test_already_gated_rows_are_only_checked_for_presence(tmp_path: Path) -> None:
    rows = {row: TOKENS for row in range(3)}
    bad = good_tensors()
    bad["hidden_states"][:, 0, :] = 0
    write(hidden_state_file(tmp_path, 0), bad)
    write(hidden_state_file(tmp_path, 1), good_tensors())
    with pytest.raises(BadSample) as caught:
        check_shard(tmp_path, rows, LAYERS, HIDDEN, DTYPE, already_gated={0, 1, 2})
    message = str(caught.value)
    assert message.startswith("1 of 3 samples") and "hs_2.safetensors: file is missing" in message
    with pytest.raises(BadSample, match="1 of 2 samples"):
        check_shard(tmp_path, {0: TOKENS, 1: TOKENS}, LAYERS, HIDDEN, DTYPE, already_gated={1})


def test_a_present_file_that_cannot_be_opened_is_not_called_missing(tmp_path: Path) -> None:
    """safetensors reports any failure to open as "not found"; out of descriptors, the gate says
    so (a GPU run once had 1,481 present files reported missing)."""
    import os
    import resource

    path = write(tmp_path / "hs_0.safetensors", good_tensors())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    filler: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        while True:
            try:
                filler.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        with pytest.raises(BadSample) as caught:
            check_sample(path, TOKENS, LAYERS, HIDDEN, DTYPE)
    finally:
        for descriptor in filler:
            os.close(descriptor)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    message = str(caught.value)
    assert "present but could not be opened" in message and "ulimit -n" in message, message
