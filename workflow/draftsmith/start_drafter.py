"""The starting drafter (``training.from_pretrained``): a published drafter to fine-tune.

    python -m draftsmith.start_drafter --settings CONFIG --output DIR

A user with thousands of conversations, not hundreds of thousands, adapts a published
EAGLE-3 drafter rather than training one from nothing. The drafter is given as a local
directory in one of two layouts:

- speculators' own (``config.json`` with ``speculators_model_type``): copied as it is;
- a research EAGLE-3 checkpoint (the EAGLE authors' and SpecForge's ``LlamaForCausalLMEagle3``
  layout: ``midlayer.*`` weights): converted by ``speculators convert --algorithm eagle3``.

Either way the job publishes, in one rename, a speculators drafter that vLLM serves (the
evaluation measures it as the method ``start``: the published drafter before your data) and
that ``speculators train --from-pretrained`` continues, with its vocabulary map beside it as
``d2t.npy``/``t2d.npy``. The map indexes the rows of the drafter's output head, so training
must use it as it is: a map recomputed from the new data would send each row's learnt token
to another token.

It is an input by content, not by path or mtime (``content_fingerprint``): the rule tracks
the drafter's bytes, so a copy elsewhere re-runs nothing and one changed byte re-trains.
Reading and checking a drafter directory (the preflight's checks too) is drafter_files.py's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from draftsmith.drafter_files import (
    D2T,
    SPECULATORS,
    T2D,
    DrafterFacts,
    StartDrafterError,
    content_fingerprint,
    read_drafter,
    weights_file,
)
from draftsmith.drafter_kinds import EAGLE3
from draftsmith.layers import LayerPlan
from draftsmith.records import DrafterOrigin

# --- the job -------------------------------------------------------------------------------


def convert_command(facts: DrafterFacts, target: str, plan: LayerPlan, output: Path) -> list[str]:
    """speculators' converter, naming the layers the run captures (checked equal to the
    drafter's own by the preflight) so the converted config says them."""
    kwargs: dict[str, Any] = {"eagle_aux_hidden_state_layer_ids": plan.aux_vllm_ids}
    if facts.norm_before_residual:
        kwargs["norm_before_residual"] = True
    return [
        sys.executable,
        "-m",
        "speculators",
        "convert",
        str(facts.path),
        "--algorithm",
        EAGLE3,
        "--verifier",
        target,
        "--output-path",
        str(output),
        "--algorithm-kwargs",
        json.dumps(kwargs),
    ]


def carry_dropped_weights(research: Path, converted: Path) -> list[str]:
    """speculators 0.9's converter builds a legacy EAGLE-3 module without the norm before ``fc``
    (``input_norm``): it drops that tensor while the converted config keeps ``norm_before_fc``,
    so vLLM would run the drafter with a norm of ones. Any research tensor the converter left
    out is written back under its speculators name."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source = weights_file(research)
    if source is None or source.suffix != ".safetensors":
        return []
    with safe_open(str(converted / "model.safetensors"), framework="pt") as handle:
        weights = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        metadata = handle.metadata()
    carried = []
    with safe_open(str(source), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118
            renamed = name.replace("midlayer.", "layers.0.", 1)
            if renamed not in weights:
                weights[renamed] = handle.get_tensor(name)
                carried.append(renamed)
    if carried:
        save_file(weights, str(converted / "model.safetensors"), metadata=metadata)
    return carried


def write_vocabulary_map(drafter: Path) -> None:
    """The drafter's own d2t/t2d, as the .npy files ``speculators train`` takes."""
    import numpy as np
    from safetensors import safe_open

    with safe_open(str(drafter / "model.safetensors"), framework="np") as handle:
        names = set(handle.keys())  # noqa: SIM118
        if not {"d2t", "t2d"} <= names:
            raise StartDrafterError(
                f"training.from_pretrained: the drafter {drafter} has no d2t/t2d vocabulary map in its weights; "
                "give a drafter with a reduced draft vocabulary (EAGLE-3's)"
            )
        np.save(drafter / D2T, handle.get_tensor("d2t"))
        np.save(drafter / T2D, handle.get_tensor("t2d"))


def prepare(source: Path, target: str, plan: LayerPlan, output: Path, staging: Path) -> DrafterFacts:
    """Copy or convert the drafter into ``staging``, write its map, publish it to ``output``."""
    from draftsmith.progress import log

    facts = read_drafter(source)
    log(f"starting from the {facts.describe()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    if facts.layout == SPECULATORS:
        shutil.copytree(source, staging, symlinks=False)
    else:
        command = convert_command(facts, target, plan, staging)
        log("converting: " + " ".join(command[2:]))
        if subprocess.run(command).returncode != 0:
            raise StartDrafterError(
                f"training.from_pretrained: speculators convert failed on {source} (its error is above); "
                "check that it is an EAGLE-3 checkpoint of this target"
            )
        if carried := carry_dropped_weights(facts.path, staging):
            log(f"carried over what the converter dropped: {', '.join(carried)}")
        converted = read_drafter(staging)
        log(f"converted: {converted.describe()}")
    write_vocabulary_map(staging)
    DrafterOrigin(str(source.resolve()), facts.layout, facts.describe(), content_fingerprint(source)).write(staging)
    shutil.rmtree(output, ignore_errors=True)
    staging.rename(output)
    return facts


def main(argv: list[str] | None = None) -> None:
    from draftsmith.cli import read_settings, stage_parser
    from draftsmith.layers import resolve_layers
    from draftsmith.target import read_target_shape

    parser = stage_parser(__doc__)
    parser.add_argument("--staging", required=True, type=Path, help="where the drafter is made before its rename")
    parser.add_argument("--output", required=True, type=Path, help="the drafter directory to publish")
    args = parser.parse_args(argv)
    settings = read_settings(args.settings, "start_drafter")
    source = settings.training.from_pretrained
    if source is None:
        raise StartDrafterError("training.from_pretrained is not set; this job has nothing to do")
    target = read_target_shape(settings.target.model)
    plan = resolve_layers(list(settings.layers), target.num_hidden_layers)
    prepare(Path(source).expanduser(), settings.target.model, plan, args.output, args.staging)


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
