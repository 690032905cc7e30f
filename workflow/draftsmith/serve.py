"""Serve the target as the evaluation recommends: the last step of a run, one command.

    python -m draftsmith.serve                                  # the demo (results/)
    python -m draftsmith.serve --results-dir results/deepseek-v3-tiny --port 8000
    python -m draftsmith.serve --num-speculative-tokens 1 -- --max-num-seqs 64
    python -m draftsmith.serve --drafter                        # the drafter, whatever won

It reads the finished run's own record (``<results_dir>/.staging/config.json``) and the
recommended serving config (``<results_dir>/drafter_speculative_config.json``: the drafter,
a free method such as n-gram lookup, or ``null`` when the target alone measured fastest),
and starts
vLLM's OpenAI server the way the evaluation did: the module entry point (the CPU build's
``vllm`` console script looks up a distribution named ``vllm`` and fails), the config's
``server`` options and environment, and on a CPU ``VLLM_MLA_DISABLE=1`` for an MLA target
(vLLM's CPU backends share no KV block size with the drafter's attention: serving.py).
Unlike a job's server it listens where the user says and has no API key unless given one.
Ctrl-C (or SIGTERM) stops the server's whole process group.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError
from draftsmith.guard import guarded, stop_process_group, uncapped_environment
from draftsmith.layout import DRAFTER_CONFIG, DRAFTER_WEIGHTS, Layout
from draftsmith.progress import log
from draftsmith.records import EvaluationSummary
from draftsmith.run_config import RunConfig
from draftsmith.server import Endpoint, ServerSpec, wait_until_healthy
from draftsmith.serving import evaluation_attention
from draftsmith.target import read_target_shape


class ServeError(DraftsmithError):
    pass


UNFINISHED = (
    "run the workflow to the end first (snakemake --cores all --resources gpu=8), "
    "or pass --results-dir of a finished run"
)


def existing(path: Path, what: str, fix: str) -> Path:
    if not path.is_file():
        raise ServeError(f"{what} {path} not found: {fix}")
    return path


def read_json(path: Path, what: str, fix: str) -> Any:
    return json.loads(existing(path, what, fix).read_text())


def speculative_config(
    results: Layout, num_speculative_tokens: int | None, drafter: bool = False
) -> dict[str, Any] | None:
    """The recommended serving config (None: the target alone), or the trained drafter at its
    best draft length whatever was recommended; either at another draft length if asked."""
    config = read_json(results.speculative_config, "the recommended serving config", UNFINISHED)
    if drafter:
        summary = EvaluationSummary.read(existing(results.acceptance, "the evaluation's summary", UNFINISHED))
        config = dict(summary.default_recommendation.drafter_speculative_config)
    if config is None:
        if num_speculative_tokens is not None:
            raise ServeError(
                "the evaluation measured the target alone fastest, so there is no draft length to change; "
                "add --drafter to serve the trained drafter anyway"
            )
        return None
    if num_speculative_tokens is not None:
        config["num_speculative_tokens"] = num_speculative_tokens
    if "model" in config:
        check_drafter(Path(config["model"]))
    return config


def check_drafter(drafter: Path) -> None:
    """Before vLLM loads anything: a drafter removed since the evaluation (a forced training
    stopped half way, a deleted folder) would fail there only after the target loaded, with
    an error about a repository id."""
    if not (drafter / DRAFTER_CONFIG).is_file() or not (drafter / DRAFTER_WEIGHTS).is_file():
        raise ServeError(
            f"the drafter {drafter} is missing or incomplete (a stopped training removes it): "
            "rerun the workflow (snakemake --cores all --resources gpu=8) to rebuild it"
        )


def server_command(
    run_config: RunConfig, spec_config: dict[str, Any] | None, host: str, port: int, extra_args: list[str]
) -> tuple[list[str], dict[str, str]]:
    """vLLM's argv and environment for the target (and the speculation), as the evaluation served them."""
    speculation = ["--speculative-config", json.dumps(spec_config)] if spec_config else []
    spec = ServerSpec.from_config(run_config, extra_args=[*speculation, *extra_args])
    argv = spec.command(port)
    argv[argv.index("--host") + 1] = host
    attention = evaluation_attention(read_target_shape(spec.model), run_config.device)
    return argv, {**spec.env, **attention.server_env()}


def serve(args: argparse.Namespace) -> None:
    results = Layout(args.results_dir)
    run_config = RunConfig.from_dict(
        read_json(results.run_config, "the run's config record", "pass --results-dir of a finished run")
    )
    spec_config = speculative_config(results, args.num_speculative_tokens, args.drafter)
    argv, env = server_command(run_config, spec_config, args.host, args.port, args.vllm_args)
    model = argv[argv.index("--served-model-name") + 1]
    endpoint = Endpoint(f"http://{args.host}:{args.port}/v1", args.api_key or "", model)
    extra = {"VLLM_API_KEY": args.api_key} if args.api_key else {}
    log(f"starting vLLM: {shlex.join(argv)}")
    if env:
        log(f"with environment {env}")
    process = subprocess.Popen(guarded(argv), env=uncapped_environment(**env, **extra), start_new_session=True)
    # SIGTERM as Ctrl-C (Python's own handler raises KeyboardInterrupt): both end in the
    # finally below, which stops the whole group.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        wait_until_healthy(process, endpoint, None, float(run_config.server.startup_timeout_s))
        log(
            f"serving {model} {speculation_text(spec_config)} at {endpoint.base_url}; "
            f"metrics at {endpoint.root_url}/metrics; Ctrl-C stops it"
        )
        process.wait()
        raise ServeError(f"vLLM exited with code {process.returncode}; its output is above")
    except KeyboardInterrupt:
        log("stopping vLLM")
    finally:
        stop_process_group(process)


def speculation_text(spec_config: dict[str, Any] | None) -> str:
    if spec_config is None:
        return "alone (the evaluation measured no speculation faster: eval/tables.html; --drafter overrides)"
    drafter = spec_config.get("model")
    what = f"drafter {drafter}" if drafter else spec_config["method"]
    return f"with {what} (k={spec_config['num_speculative_tokens']})"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", type=Path, default=Path("results"), help="a finished run's results_dir")
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="draft length (default: the recommended one)"
    )
    parser.add_argument(
        "--drafter", action="store_true", help="serve the trained drafter even where the evaluation chose otherwise"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require this key (default: none)")
    parser.add_argument("vllm_args", nargs="*", help="after --: more `vllm serve` options")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    serve(parse_args(argv))


if __name__ == "__main__":
    from draftsmith.cli import run_main

    try:
        run_main(main)
    except KeyboardInterrupt:
        sys.exit(130)
