"""The vLLM plugin that corrects the CPU build's sampled speculative decoding.

End to end, the demo's evaluation at the generation's temperature shows the effect
(tests/test_workflow.py: sampled acceptance close to greedy); these tests pin the
mechanism in seconds."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch

from draftsmith import vllm_cpu_sampling

pytestmark = pytest.mark.vllm


def test_vllm_finds_the_plugin_through_the_installed_entry_point():
    plugins = {entry.name: entry.value for entry in entry_points(group="vllm.general_plugins")}
    assert plugins.get("draftsmith_cpu_sampling") == "draftsmith.vllm_cpu_sampling:register"


def test_the_sampler_expands_float_temperatures_per_request():
    """Three requests with 2, 0 and 3 draft tokens; greedy (-1) becomes 1, as vLLM asks."""
    from vllm.v1.sample import rejection_sampler

    vllm_cpu_sampling.register()
    temperatures = torch.tensor([0.7, 0.3, -1.0])
    ends = torch.tensor([2, 2, 5])
    expanded = rejection_sampler.expand_batch_to_tokens(temperatures, ends, 5, replace_from=-1, replace_to=1)
    torch.testing.assert_close(expanded, torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0]))
    top_k = rejection_sampler.expand_batch_to_tokens(torch.tensor([5, 9, 2], dtype=torch.int32), ends, 5)
    assert top_k.tolist() == [5, 5, 2, 2, 2] and top_k.dtype == torch.int32


def test_registering_twice_replaces_once_and_only_a_wrong_kernel():
    from vllm.v1.sample import rejection_sampler

    vllm_cpu_sampling.register()
    before = rejection_sampler.expand_batch_to_tokens
    vllm_cpu_sampling.register()
    assert rejection_sampler.expand_batch_to_tokens is before
    # On this CPU build the kernel is wrong, so the replacement must be in place.
    assert vllm_cpu_sampling.cpu_kernel_loses_floats() == getattr(before, "draftsmith_in_torch", False)
