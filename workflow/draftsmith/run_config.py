"""The run config as types: one frozen dataclass per section of ``config.yaml``, and on each
field the one declaration of its key (``setting``).

A key is declared once, here: its type (the field's), default, bounds, meaning, and which rules
it shapes, extends or merely reads. Everything else is generated from that declaration:

- the JSON schema Snakemake validates with (``workflow/schemas/config.schema.yaml``,
  ``config_schema.py``), which also fills in the defaults;
- the rules' key lists that decide what a change re-runs (``settings.STAGES``);
- config/README.md's tables.

``make generated`` rewrites the generated files; a test fails while one is stale.

The config is built once, at a job's entry point, from the validated dict; the stages read
attributes, never dict keys. A job sees only the keys its rule declares
(``settings.stage_view``), so a section may be built from a partial dict: the settings its
rule left out hold ``UNDECLARED``, and reading one raises :class:`UndeclaredSetting` naming the
key and where to declare it. A stage therefore cannot depend on a setting its rule does not
account for.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import Field, dataclass, field, fields
from typing import Any, ClassVar, Self

from draftsmith.disk_budget import StoredRowFormat, parse_budget
from draftsmith.drafter_kinds import DEFAULT_KIND, FREE_METHODS, KINDS
from draftsmith.rule_groups import EVALUATIONS, PLANNERS, TARGET_READERS, TRAINERS
from draftsmith.target import TargetShape


class UndeclaredSetting(KeyError):
    """A job read a setting its rule does not declare (its ``setting(shapes=..., reads=...)``)."""

    def __str__(self) -> str:
        return str(self.args[0])


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


UNDECLARED: Any = _Marker("<undeclared>")
REQUIRED: Any = _Marker("required")  # a key with no default: the config must give it


@dataclass(frozen=True)
class Declaration:
    """Everything about one config key but its type (the field's annotation).

    ``shapes``: rules whose every output item it shapes: tracked, a change re-runs them and
    staged work made under another value is set aside. ``extent``: rules where it says how much
    work there is (shards, epochs): tracked, but finished items are reused. ``reads``: rules that
    only read it (how fast, how patient, where): never tracked, a change re-runs nothing.
    """

    doc: str  # config/README.md's "meaning", and the schema's description
    default: Any
    constraints: Mapping[str, Any]  # JSON-schema keywords beyond what the type says
    shapes: tuple[str, ...]
    extent: tuple[str, ...]
    reads: tuple[str, ...]
    # A key added after runs exist: at its default it is left out of the rules' params, so
    # those runs are not re-run by the upgrade (as a derived mode that is off: settings.off).
    added_later: bool = False


_DECLARATION = "draftsmith.declaration"


def setting(
    doc: str,
    *,
    default: Any = REQUIRED,
    shapes: tuple[str, ...] = (),
    extent: tuple[str, ...] = (),
    reads: tuple[str, ...] = (),
    added_later: bool = False,
    **constraints: Any,
) -> Any:
    """A field that declares its config key (``Declaration``)."""
    declared = Declaration(doc, default, constraints, shapes, extent, reads, added_later)
    return field(metadata={_DECLARATION: declared})


def declaration(f: Field[Any]) -> Declaration:
    return f.metadata[_DECLARATION]


# The values of the keys that name a choice, for the code that branches on them.
CPU, CUDA = "cpu", "cuda"  # device
FIRST, ALL = "first", "all"  # questions.turns
SERVED, FP8 = "served", "fp8"  # hidden_states.stored_dtype
SEPARATE, DURING_GENERATION = "separate", "during_generation"  # hidden_states.capture

# The kinds that take arguments of their own (training.kind_args): those trained beside EAGLE-3
# that some device serves.
KINDS_WITH_OWN_ARGS = [name for name, kind in KINDS.items() if name != DEFAULT_KIND and kind.devices]

# One value, or a list the evaluation sweeps (the first is the default).
SWEPT_INT = [
    {"type": "integer", "minimum": 1},
    {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1, "uniqueItems": True},
]


@dataclass(frozen=True, eq=False)
class Section:
    """A typed section; ``SECTION`` is its dotted prefix in the config (messages name keys by it)."""

    SECTION: ClassVar[str] = ""

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if value is UNDECLARED:
            key = f"{type(self).SECTION}{name}"
            raise UndeclaredSetting(
                f"{key} is not among the settings this job's rule declares; name the rule in the key's "
                "declaration, workflow/draftsmith/run_config.py"
            )
        return value

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={object.__getattribute__(self, f.name)!r}" for f in fields(self) if f.repr)
        return f"{type(self).__name__}({shown})"

    # False where Snakemake's validate cannot fill in the defaults (inside a set or an
    # endpoint): from_dict does.
    SCHEMA_FILLS_DEFAULTS: ClassVar[bool] = True

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Self:
        """The section from its config dict; keys absent from it are ``UNDECLARED``, except
        those whose default the schema cannot fill in."""
        hints = _hints(cls)
        return cls(
            **{
                f.name: _typed(hints[f.name], values[f.name]) if f.name in values else cls._absent(f)
                for f in fields(cls)
                if f.init
            }
        )

    @classmethod
    def _absent(cls, f: Field[Any]) -> Any:
        if cls.SCHEMA_FILLS_DEFAULTS or _DECLARATION not in f.metadata:  # a key, or a whole section
            return UNDECLARED
        default = declaration(f).default
        return UNDECLARED if default is REQUIRED else default


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


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class TargetSettings(Section):
    SECTION: ClassVar[str] = "target."
    model: str = setting(
        "Local path (or hub id) of the target model. The server is started with this path as its served name.",
        shapes=("demo_model", "gguf_target", *TARGET_READERS),
        reads=PLANNERS,
        minLength=1,
    )
    build_demo: bool = setting(
        "Build the demo's tiny target at `target.model` (demo config only).",
        default=False,
        extent=TARGET_READERS,
    )
    gguf: str | None = setting(
        "A GGUF file (llama.cpp's format) that rule `gguf_target` turns into the checkpoint folder at "
        "`target.model`: transformers dequantizes it (the `gguf` package) and saves the weights as safetensors "
        "with the tokenizer and chat template from the file. Not with `build_demo`. `make real-data` fetches "
        "SmolLM2-135M-Instruct as one.",
        default=None,
        shapes=("gguf_target",),
        minLength=1,
    )
    gguf_dtype: str = setting(
        "dtype of the checkpoint made from `target.gguf`: `bfloat16`, `float16` or `float32`.",
        default="bfloat16",
        shapes=("gguf_target",),
        enum=["bfloat16", "float16", "float32"],
    )
    demo_architecture: str = setting(
        "Architecture of the built demo target: `llama`, or `deepseek_v3` (the production family: MLA at "
        "DeepSeek's latent geometry, MoE with routed and shared experts; `config/deepseek-v3-tiny.yaml`).",
        default="llama",
        shapes=("demo_model",),
        enum=["llama", "deepseek_v3"],
    )
    demo_train_steps: int = setting(
        "Optimizer steps the demo target trains on its synthetic language (about a minute on 2 cores; a step "
        "count keeps rebuilds identical).",
        default=500,
        shapes=("demo_model",),
        minimum=1,
    )
    trust_remote_code: bool = setting(
        "Allow code from the model repository (needed for Kimi's tokenizer). Off unless set.",
        default=False,
        reads=tuple(rule for rule in TARGET_READERS if rule != "start_drafter"),  # it reads no tokenizer
    )


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class ServerSettings(Section):
    SECTION: ClassVar[str] = "server."
    tensor_parallel_size: int = setting(
        "vLLM TP for every server the workflow starts.",
        default=1,
        shapes=EVALUATIONS,
        reads=("generate", "extract", *TRAINERS, "untrained_drafter", *PLANNERS),
        minimum=1,
    )
    data_parallel_size: int = setting(
        "vLLM DP.",
        default=1,
        shapes=EVALUATIONS,
        reads=("generate", "extract", *TRAINERS, "untrained_drafter", *PLANNERS),
        minimum=1,
    )
    max_model_len: int = setting(
        "vLLM `--max-model-len`; must exceed `dataset.seq_length`. Prompts that leave no room for their answer "
        "(`generation.max_tokens`, `evaluation.max_tokens`) are dropped and counted where they enter: the "
        "questions stage and the evaluation sets (`eval/sets.json`).",
        default=8192,
        reads=("generate", "extract", *TRAINERS, *EVALUATIONS),
        minimum=1,
    )
    startup_timeout_s: float = setting(
        "How long a job waits for its server to load (a 1T model takes 20+ minutes). A server that dies fails "
        "the job at once, with its last log lines.",
        default=3600,
        reads=("generate", "extract", *TRAINERS, *EVALUATIONS),
        exclusiveMinimum=0,
    )
    extra_args: tuple[str, ...] = setting(
        "Extra vLLM server arguments, passed as a list (never through a shell).",
        default=[],
        reads=PLANNERS,
    )
    env: dict[str, str | float] = setting(
        "Extra environment for the server (e.g. `VLLM_CPU_KVCACHE_SPACE`).",
        default={},
    )

    @property
    def gpus(self) -> int:
        """TP x DP: the GPUs one server takes."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def requested_dtype(self) -> str | None:
        """The ``--dtype`` asked of vLLM in ``extra_args``, if any."""
        return flag_value(self.extra_args, "--dtype")


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class QuestionsSettings(Section):
    SECTION: ClassVar[str] = "questions."
    source: str = setting(
        "Hugging Face dataset id, or a local `.jsonl` / `.json` / `.parquet` file. Rows hold `messages` "
        "(role/content), `conversations` (from/value) or `prompt`.",
        shapes=("questions",),
        reads=PLANNERS,
        minLength=1,
    )
    split: str = setting(
        "Dataset split (hub datasets).",
        default="train",
        shapes=("questions",),
        reads=PLANNERS,
    )
    subset: str | None = setting(
        "Dataset configuration name (hub datasets).",
        default=None,
        shapes=("questions",),
        reads=PLANNERS,
    )
    limit: int | None = setting(
        "Keep the first N unique questions (after dedup).",
        default=None,
        shapes=("questions",),
        reads=PLANNERS,
        minimum=1,
    )
    heldout: int = setting(
        "Questions kept out of training for evaluation (chosen by hash: deterministic).",
        default=200,
        shapes=("questions",),
        reads=PLANNERS,
        minimum=1,
    )
    shards: int = setting(
        "Generation shards; each shard job loads the server once.",
        default=1,
        shapes=("questions",),
        reads=PLANNERS,
        minimum=1,
    )
    seed: int = setting(
        "Seed of the held-out choice and the shard assignment.",
        default=0,
        shapes=("questions",),
        reads=PLANNERS,
    )
    max_prompt_tokens: int | None = setting(
        "Drop questions whose prompt (chat template included, in the target's tokens) is longer than this. "
        "Unset, the limit is what leaves room for the answer: `server.max_model_len` − `generation.max_tokens`. "
        "Dropped prompts are bad rows with their reason in `questions/summary.json`. A conversation's later "
        "turns are asked while their prompt (the earlier answers included) is within the same limit.",
        default=None,
        reads=PLANNERS,
        minimum=1,
    )
    turns: str = setting(
        "Which user turns the target answers. `all`: every user turn in order, each answer the target's own and "
        "in the context of the next, while the next prompt leaves room for `generation.max_tokens` in "
        "`server.max_model_len`; one training row per conversation, its loss mask on every answer. `first`: the "
        "first user turn only. Either way a conversation that starts with assistant turns keeps the rest from "
        "its first user turn (counted as `leading_assistant_turns_skipped` in `questions/summary.json`). The "
        "held-out split and `evaluation.sets` (MT-Bench's list of user turns, for instance) are read the same "
        "way, and every turn is measured. Cost: README.md, multi-turn conversations.",
        default="all",
        shapes=("questions", "evaluation_sets"),
        reads=PLANNERS,
        enum=[FIRST, ALL],
    )


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class EndpointSettings(Section):
    SECTION: ClassVar[str] = "generation.endpoint."
    SCHEMA_FILLS_DEFAULTS: ClassVar[bool] = False
    base_url: str = setting("The server's OpenAI API root.", pattern="^https?://.*/v1$")
    api_key_env: str | None = setting(
        "Environment variable holding its API key (DRAFTSMITH_ENDPOINT_API_KEY if unset).", default=None
    )
    model: str | None = setting("The served model's name (the target's path if unset).", default=None)


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class GenerationSettings(Section):
    SECTION: ClassVar[str] = "generation."
    concurrency: int = setting(
        "Requests in flight per shard.",
        default=64,
        reads=("generate",),
        minimum=1,
    )
    max_tokens: int = setting(
        "Completion budget per answer; answers cut there are counted as truncated.",
        default=8192,
        shapes=("generate",),
        reads=PLANNERS,
        minimum=1,
    )
    sampling: dict[str, Any] = setting(
        "Merged into every chat-completion request.",
        default={"temperature": 0.6, "top_p": 0.95},
        shapes=("generate", "diagnose_gap"),
    )
    max_error_fraction: float = setting(
        "The stage fails when more questions than this fraction failed (after retries); answered ones are kept "
        "for the rerun.",
        default=0.02,
        reads=("generate",),
        minimum=0,
        maximum=1,
    )
    request_timeout_s: float = setting(
        "Per request.",
        default=3600,
        reads=("generate",),
        exclusiveMinimum=0,
    )
    max_retries: int = setting(
        "Retries of transient errors (5xx, 408, 429, network).",
        default=3,
        reads=("generate",),
        minimum=0,
    )
    endpoint: EndpointSettings | None = setting(
        "`{base_url: http://host:port/v1, api_key_env: VAR, model: NAME}`: use a running server for generation "
        "instead of starting one. The key is read from the environment variable `api_key_env` (default "
        "`DRAFTSMITH_ENDPOINT_API_KEY`).",
        default=None,
        shapes=("generate",),
        reads=PLANNERS,
    )


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class DatasetSettings(Section):
    SECTION: ClassVar[str] = "dataset."
    seq_length: int = setting(
        "Rows are truncated to this many tokens (`speculators prepare-data --seq-length`).",
        default=8192,
        shapes=("dataset", "diagnose_gap"),
        reads=PLANNERS,
        minimum=1,
    )
    min_trainable_tokens: int = setting(
        "Rows with fewer trainable tokens are dropped.",
        default=1,
        shapes=("dataset",),
        minimum=1,
    )


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class ExtractionSettings(Section):
    SECTION: ClassVar[str] = "extraction."
    shards: int = setting(
        "Hidden-state shards; each shard job loads the model once.",
        default=1,
        extent=("extract",),
        reads=PLANNERS,
        minimum=1,
    )
    concurrency: int = setting(
        "Extraction requests in flight.",
        default=32,
        reads=("extract",),
        minimum=1,
    )
    request_timeout_s: float = setting(
        "Per request.",
        default=600,
        reads=("extract",),
        exclusiveMinimum=0,
    )
    max_retries: int = setting(
        "Per request.",
        default=3,
        reads=("extract",),
        minimum=0,
    )


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class HiddenStatesSettings(Section):
    SECTION: ClassVar[str] = "hidden_states."
    disk_budget: int | str = setting(
        "Bytes of hidden states stored on disk: `all` (every row, offline), `0` (none: no extraction stage, "
        'every row captured while training), or a size such as `"500 GB"` / `"2 TiB"`. Rows are stored in '
        "dataset order while they fit; training captures the rest on demand from a capture server in its own "
        "slot, in every epoch. A smaller budget deletes the staged rows past it; `snakemake plan` shows what "
        "each choice costs.",
        default="all",
        reads=("untrained_drafter", *PLANNERS),
        oneOf=[
            {"type": "integer", "minimum": 0},
            {"type": "string", "pattern": "^(all|\\s*[0-9]+(\\.[0-9]+)?\\s*([kKmMgGtTpP][iI]?)?[bB]?\\s*)$"},
        ],
    )
    stored_dtype: str = setting(
        "How stored rows hold their states: `served` (the dtype the target is served in, bf16) or `fp8` (float8 "
        "e4m3 with a float32 scale per token, speculators' `fp8` backend: about half the bytes, so a budget "
        "stores about twice the rows). Rows captured while training use it too; the trainer dequantizes both to "
        "bf16 as it loads them.",
        default="served",
        reads=("untrained_drafter", *PLANNERS),
        enum=[SERVED, FP8],
    )
    capture: str = setting(
        "When the stored rows' states are computed. `separate`: the extraction stage loads the target again and "
        "prefills every row. `during_generation` (one pass): the generation server runs in extraction mode and "
        "saves each answer's states as it writes it, so the extraction stage only adopts those files (hard "
        "links) and prefills just the rows whose files are missing or whose ids differ, counted by reason in "
        "each shard's `manifest.json`. In this mode a training row ends one token earlier: the final answer "
        "token is sampled and never fed back, so the target never computes its state; the row loses only the "
        "prediction of what would follow the answer. Under a disk budget each generation shard keeps its share "
        "of the budget and the dataset puts the captured rows first, so the budget stores exactly those. Needs "
        "the workflow's own generation server (not `generation.endpoint`) and a budget above 0. Refused on CUDA "
        "with vLLM 0.26, where its states failed parity against Hugging Face ([docs/gpu.md](../docs/gpu.md)); "
        "unmeasured on newer CUDA releases.",
        default="separate",
        reads=("diagnose_gap", *PLANNERS),  # the diagnosis names one pass where it explains a gap
        enum=[SEPARATE, DURING_GENERATION],
    )
    capture_memory_fraction: float = setting(
        "On cuda, the GPU memory share of the capture server that runs beside the trainer (its `--gpu-memory-"
        "utilization`); the trainer has the rest.",
        default=0.5,
        reads=TRAINERS,
        exclusiveMinimum=0,
        exclusiveMaximum=1,
    )

    @property
    def limited_budget(self) -> int | None:
        """``disk_budget`` in bytes; None for "all" (every row stored)."""
        return parse_budget(self.disk_budget)

    @property
    def fp8(self) -> bool:
        """``stored_dtype: fp8``: stored and captured rows hold fp8 states."""
        return self.stored_dtype == FP8

    @property
    def during_generation(self) -> bool:
        """``capture: during_generation``: the generation server saves the stored rows' states."""
        return self.capture == DURING_GENERATION


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class TrainingSettings(Section):
    SECTION: ClassVar[str] = "training."
    epochs: int = setting(
        "`speculators train --epochs`.",
        default=10,
        extent=TRAINERS,
        reads=("untrained_drafter", *PLANNERS),
        minimum=1,
    )
    lr: float = setting(
        "Learning rate.",
        default=0.0001,
        shapes=TRAINERS,
        reads=("untrained_drafter",),
        exclusiveMinimum=0,
    )
    draft_vocab_size: int = setting(
        "Draft vocabulary, built from token frequencies; must not exceed the target's vocabulary.",
        default=32000,
        shapes=(*TRAINERS, "untrained_drafter"),
        minimum=1,
    )
    total_seq_len: int = setting(
        "Tokens packed per training step.",
        default=8192,
        shapes=TRAINERS,
        reads=("untrained_drafter", *PLANNERS),
        minimum=1,
    )
    num_layers: int = setting(
        "Drafter decoder layers.",
        default=1,
        shapes=(*TRAINERS, "untrained_drafter"),
        minimum=1,
    )
    seed: int = setting(
        "Training seed.",
        default=0,
        shapes=(*TRAINERS, "untrained_drafter"),
    )
    stall_timeout_s: float = setting(
        "The trainer is stopped (and the stage fails) when it writes nothing to its log for this long: a worker "
        "that crashed under torchrun, e.g. out of GPU memory, can hang instead of exiting. On CUDA the first "
        "step is quiet for minutes while the drafter compiles.",
        default=1800,
        reads=(*TRAINERS, "untrained_drafter"),
        exclusiveMinimum=0,
    )
    extra_args: tuple[str, ...] = setting(
        "Extra `speculators train` arguments.",
        default=[],
        shapes=(*TRAINERS, "untrained_drafter"),
        reads=PLANNERS,
    )
    kinds: tuple[str, ...] = setting(
        "The kinds of drafter to train from the same rows and hidden states, one job each (speculators' "
        "`--speculator-type`). `eagle3` must be among them: it is `drafter/`, the headline and the untrained "
        "comparison; each other kind trains into `drafter_<kind>/`, is measured at every draft length beside it "
        "(`eval/<kind>_k<k>.json`), and the recommendation chooses among them all. On a CPU vLLM 0.32 serves "
        "`eagle3`, `dflash`, `peagle`; `dflash2`, `dspark` only on CUDA; `xpress`, `mtp` nowhere (the config "
        "check refuses those, with vLLM's reason).",
        default=[DEFAULT_KIND],
        shapes=("evaluate",),
        reads=("train_kind", "evaluate_kind", *PLANNERS),
        items={"enum": list(KINDS)},
        minItems=1,
        uniqueItems=True,
    )
    kind_args: dict[str, list[str]] = setting(
        "Extra `speculators train` arguments of one kind only, after `training.extra_args` (which every kind "
        'gets), e.g. `{dflash: [--block-size, "4"], peagle: [--num-depths, "3"]}`: DFlash trains blocks of 16 '
        "and P-EAGLE 8 depths by default, sized for long drafts; at the demo's draft lengths of at most 3, the "
        "smaller values train many times faster. A change re-trains that kind's job only.",
        default={},
        shapes=("train_kind",),
        propertyNames={"enum": KINDS_WITH_OWN_ARGS},
    )
    validation_fraction: float = setting(
        "Share of the training rows (the last ones) the trainer keeps out of training to validate on. Its "
        'per-position accuracy is what the evaluation\'s "validation predicts" column shows beside served '
        "acceptance, so a larger share narrows that prediction's noise band, at the cost of training rows. "
        "`speculators train --train-data-ratio` is one minus this.",
        default=0.1,
        shapes=TRAINERS,
        reads=("untrained_drafter",),  # a dry run: never trained, never validated
        added_later=True,
        exclusiveMinimum=0,
        exclusiveMaximum=1,
    )
    from_pretrained: str | None = setting(
        "A published drafter to fine-tune instead of training from scratch: a local directory in speculators' "
        "format (copied) or a research EAGLE-3 checkpoint, the `LlamaForCausalLMEagle3` layout of the EAGLE "
        "authors and SpecForge (converted by `speculators convert`), in rule `start_drafter`. Tracked by "
        "content: a copy elsewhere or a new mtime re-runs nothing, one changed byte re-trains. The preflight "
        "checks it against the target and the config in seconds (hidden size, vocabulary, aux layers against "
        "`layers`, `training.draft_vocab_size`, kind). Training keeps its vocabulary map, and the evaluation "
        'measures it as the method `start` ("before your data") beside the fine-tuned drafter. An earlier run\'s '
        "`results/drafter` works too: a second batch continues from the first.",
        default=None,
        reads=PLANNERS,
    )
    fine_tune_lr: float | None = setting(
        "The learning rate when training starts from `training.from_pretrained`; `null` uses `training.lr`. On "
        "the demo, a drafter trained on half the data and fine-tuned on the other half did best at the from-"
        "scratch rate (2.20 at 0.003, 2.02 at 0.001, 1.95 at 0.0003: `bench/results/from_pretrained.json`); a "
        "converged published drafter may want a smaller one.",
        default=None,
        shapes=("train",),
        exclusiveMinimum=0,
    )

    @property
    def other_kinds(self) -> tuple[str, ...]:
        """The kinds trained beside EAGLE-3 (each its own drafter_<kind>/ and measurements)."""
        return tuple(kind for kind in self.kinds if kind != DEFAULT_KIND)


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class EvaluationSetSettings(Section):
    SECTION: ClassVar[str] = "evaluation.sets.<name>."
    SCHEMA_FILLS_DEFAULTS: ClassVar[bool] = False
    source: str = setting("Read like `questions.source`.", minLength=1)
    split: str = setting("Dataset split (hub datasets).", default="train")
    subset: str | None = setting("Dataset configuration name (hub datasets).", default=None)
    limit: int | None = setting("Measure the first N prompts.", default=None, minimum=1)
    prompt_field: str | None = setting(
        "The field holding the question when it is not messages/conversations/prompt.", default=None
    )
    category_field: str | None = setting("The field whose values split the set's results.", default=None)


def swept(value: int | list[int] | tuple[int, ...]) -> list[int]:
    """A setting the evaluation sweeps: one value or a list of them, in the config's order."""
    return list(value) if isinstance(value, list | tuple) else [value]


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class EvaluationSettings(Section):
    SECTION: ClassVar[str] = "evaluation."
    num_speculative_tokens: int | tuple[int, ...] = setting(
        "Draft tokens per step when serving target + drafter. A list (e.g. `[3, 1, 2, 4]`) sweeps them: one job "
        "and one model load per value, so adding a value runs only its job. The first is the default: "
        "acceptance.json's top level and the untrained comparison use it.",
        default=3,
        shapes=("evaluate",),
        reads=(
            "evaluate_drafter",
            "evaluate_kind",
            "evaluate_untrained",
            "evaluate_start",
            "evaluate_free_method",
            *PLANNERS,
        ),
        oneOf=SWEPT_INT,
    )
    max_tokens: int = setting(
        "Completion budget per held-out question.",
        default=512,
        shapes=EVALUATIONS,
        minimum=1,
    )
    concurrency: int | tuple[int, ...] = setting(
        "Requests in flight. A list (e.g. `[32, 1, 8]`) measures each in every job; the first is the default, "
        "and `drafter_speculative_config.json` holds what is recommended there (`null`: the target alone).",
        default=16,
        shapes=(*EVALUATIONS, "evaluate"),
        oneOf=SWEPT_INT,
    )
    sampled: bool = setting(
        "Also measure at `generation.sampling` (temperature, top_p, seed). vLLM drafts greedily, so acceptance "
        "differs from temperature 0.",
        default=False,
    )
    compare_untrained: bool = setting(
        "Also serve an untrained drafter of the same shape (speculators' `--dry-run` initialization) and report "
        "its acceptance: training must clearly beat it. One more model load.",
        default=False,
        shapes=("evaluate",),
        reads=PLANNERS,
    )
    free_methods: tuple[str, ...] = setting(
        "Speculative methods that need no training, measured beside the drafter at the same draft lengths, "
        "sets, concurrencies and samplings: `ngram` (vLLM's prompt lookup, 2 to 4 tokens) and `suffix` (suffix "
        "decoding; needs the `arctic-inference` package, which the preflight checks). One job and one model "
        "load per method and draft length. The recommendation then chooses among the target alone, these and "
        "the drafter, and `drafter_speculative_config.json` follows it.",
        default=[],
        shapes=("evaluate",),
        reads=("evaluate_free_method", *PLANNERS),
        items={"enum": list(FREE_METHODS)},
        uniqueItems=True,
    )
    limit: int | None = setting(
        "Evaluate only the first N held-out questions (each set has its own `limit`).",
        default=None,
        shapes=("evaluation_sets",),
        minimum=1,
    )
    sets: dict[str, EvaluationSetSettings] = setting(
        "Named prompt sets measured besides the held-out split (always the set `heldout`): `name: {source, "
        "split, subset, limit, prompt_field, category_field}`. `source` is read like `questions.source` (a "
        "local file or a hub id); `prompt_field` names the field holding the question when it is not "
        "messages/conversations/prompt; `category_field` splits the set's results.",
        default={},
        shapes=("evaluation_sets",),
        propertyNames={"not": {"const": "heldout"}},
    )
    request_timeout_s: float = setting(
        "Seconds one evaluation request may take.",
        default=3600,
        reads=EVALUATIONS,
        exclusiveMinimum=0,
    )
    max_retries: int = setting(
        "Retries of a failed evaluation request (5xx, 408, 429, network) before the job fails.",
        default=2,
        reads=EVALUATIONS,
        minimum=0,
    )

    @property
    def draft_lengths(self) -> list[int]:
        """``num_speculative_tokens`` swept; the first is the default (acceptance.json's top level)."""
        return swept(self.num_speculative_tokens)

    @property
    def concurrencies(self) -> list[int]:
        """``concurrency`` swept; the first is the default (acceptance.json's top level)."""
        return swept(self.concurrency)


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class RunConfig(Section):
    """The whole config (or a rule's view of it)."""

    results_dir: str = setting(
        "Outputs, staging (`.staging/`) and logs (`logs/`) of this config. Give each config its own, so two "
        "configs never share results.",
        default="results",
        minLength=1,
    )
    device: str = setting(
        "`cpu` runs the heavy stages on the vLLM CPU build (demo, tests); `cuda` on GPUs.",
        default="cuda",
        shapes=(*TRAINERS, "untrained_drafter", *EVALUATIONS),
        reads=("generate", "extract", *PLANNERS),
        enum=[CPU, CUDA],
    )
    gpu_slot: int = setting(
        "GPUs one heavy job (a vLLM server or the trainer) holds. Run with `--resources gpu=N`, N ≥ this, so "
        "heavy jobs run one at a time. A job refuses to start when its grant is below TP × DP.",
        default=8,
        reads=("generate", "extract", *TRAINERS, "untrained_drafter", *EVALUATIONS, *PLANNERS),
        minimum=1,
    )
    target: TargetSettings
    layers: tuple[int, ...] = setting(
        "See the layer convention above.",
        shapes=("extract", "start_drafter", *TRAINERS, "untrained_drafter", "diagnose_gap"),
        reads=PLANNERS,
        items={"type": "integer", "minimum": 0},
        minItems=2,
    )
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
        return self.device == CUDA

    @property
    def trainer_processes(self) -> int:
        """One trainer process per GPU of the slot on cuda (it sets the global batch); 1 on cpu."""
        return self.gpu_slot if self.on_cuda else 1

    def stored_row(self, target: TargetShape) -> StoredRowFormat:
        """What one row of ``target``'s hidden states holds on disk: every configured layer, in
        the served dtype (``server.extra_args`` may ask for another) or fp8."""
        return StoredRowFormat.of(target, len(self.layers), self.server.requested_dtype, self.hidden_states.fp8)

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


def declarations(cls: type[Section] = RunConfig, prefix: str = "") -> dict[str, Declaration]:
    """Every settable key, dotted, in field order (a section's fields under its name), with its
    declaration. An endpoint is one key, and so is each evaluation set."""
    found: dict[str, Declaration] = {}
    hints = _hints(cls)
    for f in fields(cls):
        if not f.init:
            continue
        hint = hints[f.name]
        if isinstance(hint, type) and issubclass(hint, Section):
            found |= declarations(hint, f"{prefix}{f.name}.")
        else:
            found[prefix + f.name] = declaration(f)
    return found


def field_keys() -> list[str]:
    return list(declarations())
