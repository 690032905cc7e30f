"""The run config as types: one frozen dataclass per section of ``config.yaml``.

Built once, at a job's entry point, from the config Snakemake validated against
``workflow/schemas/config.schema.yaml`` (which fills in the defaults); the stages below read
attributes, never dict keys. ``tests/test_run_config.py`` holds the schema and these fields to
the same keys.

A job sees only the keys its rule declares (``settings.stage_view``), so a section may be
built from a partial dict: the settings its rule left out hold ``UNDECLARED``, and reading one
raises :class:`UndeclaredSetting` naming the key and where to declare it. A stage therefore
cannot depend on a setting its rule does not account for.

What a change of each key re-runs is per rule, not per key (``device`` shapes the trained
drafter but is only placement for generation), so that table stays in ``settings.STAGES``.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Self

from draftsmith.disk_budget import parse_budget
from draftsmith.drafter_kinds import DEFAULT_KIND


class UndeclaredSetting(KeyError):
    """A job read a setting its rule does not declare (``settings.STAGES``)."""

    def __str__(self) -> str:
        return str(self.args[0])


class _Undeclared:
    def __repr__(self) -> str:
        return "<undeclared>"


UNDECLARED: Any = _Undeclared()


@dataclass(frozen=True, eq=False)
class Section:
    """A typed section; ``SECTION`` is its dotted prefix in the config (messages name keys by it)."""

    SECTION: ClassVar[str] = ""

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if value is UNDECLARED:
            key = f"{type(self).SECTION}{name}"
            raise UndeclaredSetting(
                f"{key} is not among the settings this job's rule declares; add it to the rule's Stage in "
                "workflow/draftsmith/settings.py"
            )
        return value

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={object.__getattribute__(self, f.name)!r}" for f in fields(self) if f.repr)
        return f"{type(self).__name__}({shown})"

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Self:
        """The section from its config dict; keys absent from it are ``UNDECLARED``, except
        those with a default (keys the schema cannot fill in: inside a set or an endpoint)."""
        hints = _hints(cls)
        return cls(
            **{
                f.name: _typed(hints[f.name], values[f.name])
                if f.name in values
                else (UNDECLARED if f.default is MISSING else f.default)
                for f in fields(cls)
                if f.init
            }
        )


_HINTS: dict[str, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The fields' resolved types (annotations are strings under ``from __future__``)."""
    if cls.__name__ not in _HINTS:
        _HINTS[cls.__name__] = typing.get_type_hints(cls)
    return _HINTS[cls.__name__]


def _typed(hint: Any, value: Any) -> Any:
    """A config value as its field's type: sections built, lists as tuples (frozen)."""
    if isinstance(hint, type) and issubclass(hint, Section):
        return hint.from_dict(value)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union) and value is not None:
        sections = [arg for arg in args if isinstance(arg, type) and issubclass(arg, Section)]
        return sections[0].from_dict(value) if sections else value
    if origin is dict and isinstance(args[1], type) and issubclass(args[1], Section):
        return {key: args[1].from_dict(item) for key, item in value.items()}
    if origin is tuple:
        return tuple(value)
    return value


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in a command line (``--flag v`` or ``--flag=v``), if given."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


# --- the sections, in config.yaml's order --------------------------------------------------


@dataclass(frozen=True, eq=False, repr=False)
class TargetSettings(Section):
    SECTION: ClassVar[str] = "target."
    model: str
    build_demo: bool
    gguf: str | None
    gguf_dtype: str
    demo_architecture: str
    demo_train_steps: int
    trust_remote_code: bool


@dataclass(frozen=True, eq=False, repr=False)
class ServerSettings(Section):
    SECTION: ClassVar[str] = "server."
    tensor_parallel_size: int
    data_parallel_size: int
    max_model_len: int
    startup_timeout_s: float
    extra_args: tuple[str, ...]
    env: dict[str, str | float]

    @property
    def gpus(self) -> int:
        """TP x DP: the GPUs one server takes."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def requested_dtype(self) -> str | None:
        """The ``--dtype`` asked of vLLM in ``extra_args``, if any."""
        return flag_value(self.extra_args, "--dtype")


@dataclass(frozen=True, eq=False, repr=False)
class QuestionsSettings(Section):
    SECTION: ClassVar[str] = "questions."
    source: str
    split: str
    subset: str | None
    limit: int | None
    heldout: int
    shards: int
    seed: int
    max_prompt_tokens: int | None
    turns: str  # first | all (questions.FIRST, questions.ALL)


@dataclass(frozen=True, eq=False, repr=False)
class EndpointSettings(Section):
    SECTION: ClassVar[str] = "generation.endpoint."
    base_url: str = UNDECLARED
    api_key_env: str | None = None
    model: str | None = None


@dataclass(frozen=True, eq=False, repr=False)
class GenerationSettings(Section):
    SECTION: ClassVar[str] = "generation."
    concurrency: int
    max_tokens: int
    sampling: dict[str, Any]
    max_error_fraction: float
    request_timeout_s: float
    max_retries: int
    endpoint: EndpointSettings | None


@dataclass(frozen=True, eq=False, repr=False)
class DatasetSettings(Section):
    SECTION: ClassVar[str] = "dataset."
    seq_length: int
    min_trainable_tokens: int


@dataclass(frozen=True, eq=False, repr=False)
class ExtractionSettings(Section):
    SECTION: ClassVar[str] = "extraction."
    shards: int
    concurrency: int
    request_timeout_s: float
    max_retries: int


@dataclass(frozen=True, eq=False, repr=False)
class HiddenStatesSettings(Section):
    SECTION: ClassVar[str] = "hidden_states."
    disk_budget: int | str
    stored_dtype: str
    capture: str
    capture_memory_fraction: float

    @property
    def limited_budget(self) -> int | None:
        """``disk_budget`` in bytes; None for "all" (every row stored)."""
        return parse_budget(self.disk_budget)

    @property
    def fp8(self) -> bool:
        """``stored_dtype: fp8``: stored and captured rows hold fp8 states."""
        return self.stored_dtype == "fp8"

    @property
    def during_generation(self) -> bool:
        """``capture: during_generation``: the generation server saves the stored rows' states."""
        return self.capture == "during_generation"


@dataclass(frozen=True, eq=False, repr=False)
class TrainingSettings(Section):
    SECTION: ClassVar[str] = "training."
    epochs: int
    lr: float
    draft_vocab_size: int
    total_seq_len: int
    num_layers: int
    seed: int
    stall_timeout_s: float
    extra_args: tuple[str, ...]
    kinds: tuple[str, ...]
    kind_args: dict[str, list[str]]
    from_pretrained: str | None  # a drafter to start from (start_drafter.py)
    fine_tune_lr: float | None  # the learning rate from it; None: training.lr

    @property
    def other_kinds(self) -> tuple[str, ...]:
        """The kinds trained beside EAGLE-3 (each its own drafter_<kind>/ and measurements)."""
        return tuple(kind for kind in self.kinds if kind != DEFAULT_KIND)


@dataclass(frozen=True, eq=False, repr=False)
class EvaluationSetSettings(Section):
    SECTION: ClassVar[str] = "evaluation.sets.<name>."
    source: str = UNDECLARED
    split: str = "train"
    subset: str | None = None
    limit: int | None = None
    prompt_field: str | None = None
    category_field: str | None = None


def swept(value: int | list[int] | tuple[int, ...]) -> list[int]:
    """A setting the evaluation sweeps: one value or a list of them, in the config's order."""
    return list(value) if isinstance(value, list | tuple) else [value]


@dataclass(frozen=True, eq=False, repr=False)
class EvaluationSettings(Section):
    SECTION: ClassVar[str] = "evaluation."
    num_speculative_tokens: int | tuple[int, ...]
    max_tokens: int
    concurrency: int | tuple[int, ...]
    sampled: bool
    compare_untrained: bool
    free_methods: tuple[str, ...]
    limit: int | None
    sets: dict[str, EvaluationSetSettings]
    request_timeout_s: float
    max_retries: int

    @property
    def draft_lengths(self) -> list[int]:
        """``num_speculative_tokens`` swept; the first is the default (acceptance.json's top level)."""
        return swept(self.num_speculative_tokens)

    @property
    def concurrencies(self) -> list[int]:
        """``concurrency`` swept; the first is the default (acceptance.json's top level)."""
        return swept(self.concurrency)


@dataclass(frozen=True, eq=False, repr=False)
class RunConfig(Section):
    """The whole config (or a rule's view of it)."""

    results_dir: str
    device: str
    gpu_slot: int
    target: TargetSettings
    layers: tuple[int, ...]
    server: ServerSettings
    questions: QuestionsSettings
    generation: GenerationSettings
    dataset: DatasetSettings
    extraction: ExtractionSettings
    hidden_states: HiddenStatesSettings
    training: TrainingSettings
    evaluation: EvaluationSettings
    # The dict it was built from: the re-run registry (settings.py) fingerprints dotted keys of it.
    source: Mapping[str, Any] = field(init=False, repr=False)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Self:
        run = super().from_dict(values)
        object.__setattr__(run, "source", values)  # frozen: set once, here
        return run

    @property
    def on_cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def trainer_processes(self) -> int:
        """One trainer process per GPU of the slot on cuda (it sets the global batch); 1 on cpu."""
        return self.gpu_slot if self.on_cuda else 1

    @property
    def evaluation_samplings(self) -> list[dict[str, Any]]:
        """Greedy, as vLLM drafts, and with ``evaluation.sampled`` the generation's sampling too."""
        greedy: list[dict[str, Any]] = [{"temperature": 0.0}]
        return greedy + [dict(self.generation.sampling)] if self.evaluation.sampled else greedy

    @property
    def capture_share(self) -> int | None:
        """One pass under a disk budget: the bytes of states each generation shard keeps
        (None while capture is separate, or with no limit)."""
        budget = self.hidden_states.limited_budget
        if not self.hidden_states.during_generation or budget is None:
            return None
        return budget // self.questions.shards

    @property
    def question_prompt_limit(self) -> int:
        """The longest prompt (in the target's tokens) the questions stage keeps: room for
        ``generation.max_tokens`` in ``server.max_model_len``, or ``questions.max_prompt_tokens``
        where that is lower."""
        room = self.server.max_model_len - self.generation.max_tokens
        named = self.questions.max_prompt_tokens
        return room if named is None else min(room, named)

    @property
    def evaluation_prompt_limit(self) -> int:
        """The longest prompt the evaluation asks: room for ``evaluation.max_tokens``."""
        return self.server.max_model_len - self.evaluation.max_tokens


def field_keys(cls: type[Section] = RunConfig, prefix: str = "") -> list[str]:
    """Every settable key, dotted, in field order (a section's fields under its name)."""
    keys = []
    hints = _hints(cls)
    for f in fields(cls):
        if not f.init:
            continue
        hint = hints[f.name]
        if isinstance(hint, type) and issubclass(hint, Section) and hint is not EndpointSettings:
            keys += field_keys(hint, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys
