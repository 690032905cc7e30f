"""A vLLM plugin that makes the CPU build's speculative decoding sample at the right temperature.

vLLM's rejection sampler spreads each request's temperature, top-k and top-p over its
draft tokens with ``expand_batch_to_tokens``. On a CPU without Triton that runs a C++
kernel which takes int64 tensors only; vLLM 0.32 hands it an int64 copy of the float
output buffer, so the real buffer keeps whatever memory it held. Greedy requests skip
this path. A sampled request divides the target's logits by garbage: on the demo target
at temperature 0.1 the acceptance length fell from 2.4 (greedy) to 1.03, and the answers
were no longer the target's distribution (3.5× longer at temperature 0.7).

``register`` expands two floats with the installed kernel; only if the result is wrong
does it replace ``expand_batch_to_tokens`` with the same expansion in torch
(``repeat_interleave``). A vLLM whose kernel is fixed is left untouched, and CUDA is
never patched.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# How vLLM finds this plugin (pyproject.toml's entry point); the preflight checks it.
PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "draftsmith_cpu_sampling"
PLUGIN_VALUE = f"{__name__}:register"
# Third-party names this module uses; the preflight checks each exists (preflight.declared).
THIRD_PARTY = [
    ("vllm.v1.sample.rejection_sampler", "expand_batch_to_tokens"),
    ("vllm.utils.cpu_triton_utils", "_expand_kernel_impl"),
]


def register() -> None:
    """vLLM's plugin hook: replace the CPU expansion if, and only if, it is wrong."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not cpu_kernel_loses_floats():
        return
    from vllm.v1.sample import rejection_sampler

    if getattr(rejection_sampler.expand_batch_to_tokens, "draftsmith_in_torch", False):
        return
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    log.warning(
        "draftsmith: vLLM's CPU expand kernel drops float values (sampled speculative decoding "
        "would use garbage temperatures); expanding them in torch instead"
    )


def cpu_kernel_loses_floats() -> bool:
    """Expand [0.5, 2.0] over 1 + 2 tokens with the installed CPU kernel."""
    import torch  # here, not at the top: the preflight reads this module's constants only
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    from vllm.utils.cpu_triton_utils import _expand_kernel_impl

    values, ends = torch.tensor([0.5, 2.0]), torch.tensor([1, 3])
    output = torch.full((3,), -1.0)
    _expand_kernel_impl(output, values, ends, -7, -7)
    return not torch.equal(output, expand_batch_to_tokens(values, ends, 3))


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """vLLM's contract: request ``i``'s value repeated over its tokens, ``replace_from``
    values replaced by ``replace_to``; here for every dtype."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


expand_batch_to_tokens.draftsmith_in_torch = True  # type: ignore[attr-defined]  # how register() knows it
