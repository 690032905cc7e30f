"""The config against its schema, as one clear line, and settings that cannot work together.

Snakemake's ``validate`` fills in the defaults, but reports a problem followed by a dump
of the schema section (dozens of lines) that buries the key at fault. This check runs
first and names the key, the problem and where to read about it. The cross-field checks
run next, on the validated config: at parse time, in seconds, where a loaded server would
otherwise refuse every request (after 25 minutes of loading on Kimi).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from jsonschema.exceptions import best_match
from jsonschema.validators import validator_for

from draftsmith.drafter_kinds import DEFAULT_KIND, serving_problem
from draftsmith.run_config import RunConfig, flag_value


def config_problem(config: dict[str, Any], schema_path: str | Path) -> str | None:
    schema = yaml.safe_load(Path(schema_path).read_text())
    error = best_match(validator_for(schema)(schema).iter_errors(config))
    if error is None:
        return None
    where = ".".join(map(str, error.absolute_path)) or "top level"
    return f"config {where}: {error.message}; fix it in the config file (every key is described in config/README.md)"


def cross_field_problems(config: RunConfig) -> list[str]:
    """Settings valid one by one that cannot work together, one line each with the fix."""
    problems = []
    max_model_len = config.server.max_model_len
    for section, max_tokens in (
        ("generation", config.generation.max_tokens),
        ("evaluation", config.evaluation.max_tokens),
    ):
        if max_tokens >= max_model_len:
            problems.append(
                f"config {section}.max_tokens {max_tokens} is not below server.max_model_len {max_model_len}: "
                f"vLLM would refuse every request (no room for the prompt); lower {section}.max_tokens "
                "or raise server.max_model_len"
            )
    if config.target.gguf and config.target.build_demo:
        problems.append(
            "config target.gguf and target.build_demo both make target.model; keep one (build_demo is for the demo)"
        )
    if config.hidden_states.during_generation and config.generation.endpoint is not None:
        problems.append(
            "config hidden_states.capture during_generation needs the workflow's own generation server "
            "(it saves the states as it answers), not generation.endpoint; remove one of them"
        )
    if config.hidden_states.during_generation and config.hidden_states.limited_budget == 0:
        problems.append(
            "config hidden_states.capture during_generation stores states, but disk_budget 0 stores none; "
            "set capture: separate, or a disk budget above 0"
        )
    if flag_value(config.training.extra_args, "--train-data-ratio") is not None:
        problems.append(
            "config training.extra_args sets --train-data-ratio, which training.validation_fraction decides; "
            "remove it and set training.validation_fraction (one minus the ratio)"
        )
    kinds = config.training.kinds
    if DEFAULT_KIND not in kinds:
        problems.append(
            f"config training.kinds {list(kinds)} lacks eagle3: the other kinds are measured beside "
            "the EAGLE-3 drafter (the headline and the untrained comparison); add eagle3 to the list"
        )
    problems += [problem for kind in kinds if (problem := serving_problem(kind, config.device))]
    seq_length = config.dataset.seq_length
    if max_model_len < seq_length + 1:
        problems.append(
            f"config server.max_model_len {max_model_len} is below dataset.seq_length + 1 = {seq_length + 1}: "
            "extraction prompts would be refused; raise server.max_model_len or lower dataset.seq_length"
        )
    return problems
