"""training.from_pretrained, checked in seconds: every refusal is one line naming both sides
and the fix; the drafter is an input by content; training keeps the drafter's own map."""

import json
import os
import shutil
from pathlib import Path

import pytest
from drafter_layouts import write_speculators_drafter
from test_preflight import demo_settings

from draftsmith import preflight, train
from draftsmith.drafter_files import D2T, T2D, content_fingerprint
from draftsmith.layers import resolve_layers
from draftsmith.layout import TrainPaths
from draftsmith.run_config import RunConfig


def problems_for(target: Path, drafter: Path, tmp_path: Path, **training) -> list[str]:
    config = demo_settings(target)
    config["training"] |= {"from_pretrained": str(drafter), **training}
    return preflight.run_checks(RunConfig.from_dict(config), tmp_path / "results")


def test_a_matching_drafter_passes(target, tmp_path):
    assert problems_for(target, write_speculators_drafter(tmp_path / "drafter"), tmp_path) == []


@pytest.mark.parametrize(
    ("drafter", "training", "line"),
    [
        (
            {"aux_ids": (2, 4, 5)},
            {},
            "reads vLLM layers 2, 4, 5 (its eagle_aux_hidden_state_layer_ids), the config's layers [1, 2, 4, 5] "
            "give 2, 3, 5; set layers: [1, 3, 4, 5]",
        ),
        (
            {"hidden": 256},
            {},
            "reads hidden states of width 256 (its target_hidden_size), the target",
        ),
        ({"vocab": 300}, {}, "maps a vocabulary of 300 tokens (its t2d / vocab_size), the target"),
        (
            {},
            {"draft_vocab_size": 100},
            "drafts from 200 tokens (its draft_vocab_size), the config says training.draft_vocab_size 100: "
            "the size comes from the drafter; set training.draft_vocab_size: 200",
        ),
        ({"kind": "dflash"}, {}, "is a dflash drafter (speculators_model_type); from_pretrained continues the EAGLE-3"),
    ],
    ids=["layers", "hidden-size", "vocabulary", "draft-vocabulary", "kind"],
)
def test_each_mismatch_is_one_line_naming_both_sides_and_the_fix(target, tmp_path, drafter, training, line):
    problems = problems_for(target, write_speculators_drafter(tmp_path / "drafter", **drafter), tmp_path, **training)
    assert len(problems) == 1, problems
    assert problems[0].startswith("training.from_pretrained: the drafter at ")
    assert line in problems[0]
    assert "\n" not in problems[0]


def _no_config(path: Path) -> None:
    (path / "config.json").unlink()


def _no_weights(path: Path) -> None:
    (path / "model.safetensors").unlink()


def _unreadable_weights(path: Path) -> None:
    (path / "model.safetensors").write_bytes(b"\x00\x01 not a safetensors file")


def _foreign_format(path: Path) -> None:
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 128}))


@pytest.mark.parametrize(
    ("breakage", "line"),
    [
        (_no_config, "holds no drafter (no config.json); point it at a drafter's directory"),
        (_no_weights, "has a config but no weights (model.safetensors or pytorch_model.bin)"),
        (_unreadable_weights, "cannot be read (SafetensorError"),
        (_foreign_format, "is neither a speculators drafter (no speculators_model_type in config.json) nor a research"),
    ],
    ids=["no-drafter", "no-weights", "unreadable-weights", "unknown-format"],
)
def test_bad_input_is_one_line(target, tmp_path, breakage, line):
    drafter = write_speculators_drafter(tmp_path / "drafter")
    breakage(drafter)
    problems = problems_for(target, drafter, tmp_path)
    assert len(problems) == 1, problems
    assert line in problems[0]


def test_weights_that_do_not_match_the_config_are_named(target, tmp_path):
    drafter = write_speculators_drafter(tmp_path / "drafter", lm_head_rows=150)
    (problem,) = problems_for(target, drafter, tmp_path)
    assert "tensor lm_head.weight has shape [150, 128], the config implies [200, 128]" in problem
    assert problem.endswith("the weights do not belong to this config: copy the drafter again")


def test_a_path_that_does_not_exist_is_named(target, tmp_path):
    config = demo_settings(target)
    config["training"]["from_pretrained"] = str(tmp_path / "nowhere")
    assert preflight.check_local_inputs(RunConfig.from_dict(config)) == [
        f"training.from_pretrained {tmp_path / 'nowhere'} does not exist (a local drafter directory); "
        "fix the path in the config"
    ]


def test_the_drafter_is_an_input_by_content(tmp_path):
    drafter = write_speculators_drafter(tmp_path / "drafter")
    fingerprint = content_fingerprint(drafter)
    copy = shutil.copytree(drafter, tmp_path / "elsewhere" / "drafter")
    os.utime(copy / "model.safetensors", (1, 1))
    assert content_fingerprint(copy) == fingerprint
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (copy / "model.safetensors").write_bytes(bytes(weights))
    assert content_fingerprint(copy) != fingerprint


def test_fine_tuning_hands_speculators_the_drafters_own_map(target, tmp_path):
    """Its output head's rows are indexed by its map: speculators gets it, not one it would
    build from this run's token frequencies."""
    config = demo_settings(target)
    settings = RunConfig.from_dict(config)
    plan = resolve_layers(list(settings.layers), 6)
    paths = TrainPaths(tmp_path / "dataset", tmp_path / "hs", tmp_path / "staging", tmp_path / "out")
    start = tmp_path / "start"
    argv = train.speculators_args(settings, plan, paths, start=start)
    given = dict(zip(argv, argv[1:], strict=False))
    assert given["--from-pretrained"] == str(start)
    assert (given["--d2t-path"], given["--t2d-path"]) == (str(start / D2T), str(start / T2D))
    assert "--from-pretrained" not in train.speculators_args(settings, plan, paths)
