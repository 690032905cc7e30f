"""The faults that open a gap between validation and serving, planted into a copy of a finished
run's drafter or config: what the acceptance-gap diagnosis must name, each by its own cause.
Shared by tests/test_acceptance_gap.py and bench/acceptance_gap.py."""

import contextlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.acceptance_gap import diagnose, read_manifests
from draftsmith.cli import read_settings
from draftsmith.layout import Layout
from draftsmith.records import AcceptanceGap, EvaluationSummary

# A chat template unlike the demo's: a system line before every conversation.
OTHER_TEMPLATE = (
    "{{- bos_token -}}{{ '<|system|> you are helpful ' }}{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{ '<|user|> ' + message['content'] | trim + ' ' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ '<|assistant|> ' + message['content'] | trim + ' ' }}"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


@dataclass(frozen=True)
class Run:
    """A finished run's files the diagnosis reads, with the drafter and config to use."""

    workdir: Path
    drafter: Path
    settings: Path

    @property
    def layout(self) -> Layout:
        return Layout(self.workdir / "results")

    def diagnosis(self) -> AcceptanceGap:
        """As the rule runs it: in the run's directory, where the config's paths are relative."""
        layout = self.layout
        settings = read_settings(str(self.settings), "diagnose_gap")
        summary = EvaluationSummary.from_json(layout.acceptance.read_text())
        shards = sorted(p for p in layout.hidden_states.glob("shard_*") if p.is_dir())
        with contextlib.chdir(self.workdir):
            return self._diagnose(settings, summary, shards)

    def _diagnose(self, settings, summary: EvaluationSummary, shards: list[Path]) -> AcceptanceGap:
        layout = self.layout
        return diagnose(
            settings,
            summary,
            self.drafter,
            layout.dataset,
            layout.questions,
            layout.completion_shards(),
            read_manifests(shards),
        )


def clean(workdir: Path) -> Run:
    layout = Layout(workdir / "results")
    return Run(workdir, layout.drafter, layout.run_config)


def _drafter_copy(run: Run, where: Path) -> Path:
    return Path(shutil.copytree(run.drafter, where / "drafter"))


def shifted_layers(run: Run, where: Path) -> Run:
    """The drafter's config reads every aux layer one later than the run captured."""
    drafter = _drafter_copy(run, where)
    config = json.loads((drafter / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    (drafter / "config.json").write_text(json.dumps(config, indent=2))
    return Run(run.workdir, drafter, run.settings)


def shuffled_d2t(run: Run, where: Path) -> Run:
    """The vocabulary map's draft rows point at each other's tokens."""
    drafter = _drafter_copy(run, where)
    with safe_open(str(drafter / "model.safetensors"), framework="pt") as handle:
        weights = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    targets = weights["d2t"] + np.arange(len(weights["d2t"]))
    shuffled = targets[np.random.default_rng(0).permutation(len(targets))]
    weights["d2t"] = shuffled - np.arange(len(shuffled))
    save_file(weights, str(drafter / "model.safetensors"), metadata={"format": "pt"})
    return Run(run.workdir, drafter, run.settings)


def _settings_with(run: Run, where: Path, extra_args: list[str]) -> Run:
    config = json.loads(run.settings.read_text())
    config["server"]["extra_args"] = extra_args
    settings = where / "config.json"
    settings.write_text(json.dumps(config))
    return Run(run.workdir, run.drafter, settings)


def other_template(run: Run, where: Path) -> Run:
    """The servers render prompts with another chat template than the answers were made with."""
    template = where / "other_template.jinja"
    template.write_text(OTHER_TEMPLATE)
    extra = json.loads(run.settings.read_text())["server"]["extra_args"]
    return _settings_with(run, where, [*extra, "--chat-template", str(template)])


def other_dtype(run: Run, where: Path) -> Run:
    """The servers run the target in float16; the training states were computed in bfloat16."""
    extra = json.loads(run.settings.read_text())["server"]["extra_args"]
    index = extra.index("--dtype")
    return _settings_with(run, where, [*extra[: index + 1], "float16", *extra[index + 2 :]])


# fault name -> (how to plant it, the check that must name it)
PLANTED = {
    "layers shifted by one": (shifted_layers, "wiring"),
    "shuffled d2t": (shuffled_d2t, "wiring"),
    "another chat template": (other_template, "tokens"),
    "float16 serving, bfloat16 training": (other_dtype, "numerics"),
}
