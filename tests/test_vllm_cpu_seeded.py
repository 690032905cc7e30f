"""The vLLM plugin that lets the CPU build sample seeded requests whose prompt is prefilled in
chunks (draftsmith.vllm_cpu_seeded): without it the engine raises "CPU Generator does not
use offset" at the first such request and every request after it fails."""

from __future__ import annotations

import json
import urllib.request
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from conftest import server_settings
from test_extract import VOCAB, build_tiny_target

from draftsmith import vllm_cpu_seeded
from draftsmith.run_config import RunConfig
from draftsmith.server import Endpoint, ServerSpec, managed_server

pytestmark = pytest.mark.vllm
# A step takes at most 64 tokens: a 300-token prompt is prefilled in 5 chunks. Once its first
# whole blocks are in the prefix cache, the rest fits in one step.
CHUNKING = ["--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--enable-prefix-caching"]
PROMPT_TOKENS = 300


def test_vllm_finds_the_plugin_through_the_installed_entry_point():
    plugins = {entry.name: entry.value for entry in entry_points(group="vllm.general_plugins")}
    assert plugins.get("draftsmith_cpu_seeded") == "draftsmith.vllm_cpu_seeded:register"


def test_only_the_cpu_runner_is_patched_and_only_once():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert vllm_cpu_seeded.cpu_generators_lack_offsets()  # torch's CPU generator: the cause
    vllm_cpu_seeded.register()
    patched = CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync
    vllm_cpu_seeded.register()
    assert (CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync) == patched
    assert all(hasattr(method, "__wrapped__") for method in patched)
    assert not hasattr(GPUModelRunner._sample, "__wrapped__")  # the CUDA runner is vLLM's own
    assert not hasattr(GPUModelRunner._bookkeeping_sync, "__wrapped__")


def complete(endpoint: Endpoint, prompt: list[int], seed: int) -> list[int]:
    body = {
        "model": endpoint.model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": seed,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{endpoint.base_url}/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **endpoint.headers()},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["token_ids"]


def test_a_seeded_prompt_prefilled_in_chunks_samples_as_from_the_prefix_cache(tmp_path: Path):
    """The first request prefills in chunks (vLLM samples and discards at each chunk); the
    same request again finds its prefix cached and prefills in one step. The seed must give
    the same tokens both times: the plugin rewinds the generator exactly. A random target
    samples nearly uniformly, so a generator off by even one draw would answer otherwise."""
    model = tmp_path / "model"
    build_tiny_target(model)
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, VOCAB, (PROMPT_TOKENS,), generator=generator).tolist()
    settings = server_settings(model, extra_args=["--enforce-eager", "--dtype", "bfloat16", *CHUNKING])
    log = tmp_path / "server.log"
    with managed_server(ServerSpec.from_config(RunConfig.from_dict(settings)), log_path=log) as endpoint:
        chunked = complete(endpoint, prompt, seed=11)
        cached = complete(endpoint, prompt, seed=11)
        other_seed = complete(endpoint, prompt, seed=12)
    assert len(chunked) == 8 and chunked == cached, (chunked, cached)
    assert other_seed != chunked  # the seed, not the model alone, decides the tokens
    # Patched in the worker alone: the API server and the engine core never import the
    # runner, and importing it for them would add about 0.7 s to each of their starts.
    assert log.read_text().count("rewinding them by state instead") == 1
