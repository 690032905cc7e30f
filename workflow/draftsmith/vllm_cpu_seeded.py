"""A vLLM plugin that lets the CPU build sample seeded requests whose prompt is prefilled in chunks.

While a prompt is prefilled over several steps (chunked prefill: a long prompt, or a step's
token budget shared with other requests), vLLM samples a token for it at every step and
discards it. A seeded request must not lose randomness to those samples, so the model
runner rewinds its generator with ``gen.set_offset(gen.get_offset() - 4)``: the Philox
offset of a CUDA generator. A CPU generator (Mersenne Twister) has no offset, so on a CPU
the first chunked seeded request raises ``RuntimeError: CPU Generator does not use
offset`` inside the engine, and every request after it fails with HTTP 500. The demo
configs sample with ``seed: 0``, and real chat prompts are long.

``register`` asks torch whether a CPU generator has an offset. Only if not does it give
vLLM's CPU model runner the same rewind by state: the generators of requests whose sample
will be discarded are saved before sampling and restored after it, which is exact (the
request then samples as if the chunk had never been sampled). The runner is patched when
its module is imported: only a worker process imports it, and importing it in the API
server and the engine core would add about 0.7 s to each of their starts. CUDA is never
patched.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys
from types import ModuleType

log = logging.getLogger(__name__)

# How vLLM finds this plugin (pyproject.toml's entry point); the preflight checks it.
PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "draftsmith_cpu_seeded"
PLUGIN_VALUE = f"{__name__}:register"
RUNNER_MODULE = "vllm.v1.worker.cpu_model_runner"
# Third-party names this module uses or overrides; the preflight checks each exists (preflight.declared).
THIRD_PARTY = [
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._sample"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._bookkeeping_sync"),
]


def register() -> None:
    """vLLM's plugin hook: rewind seeded CPU generators by state if they have no offset."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not cpu_generators_lack_offsets():
        return
    if RUNNER_MODULE in sys.modules:
        rewind_generators_by_state(sys.modules[RUNNER_MODULE])
    elif not any(isinstance(finder, _PatchRunnerOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchRunnerOnImport())


def cpu_generators_lack_offsets() -> bool:
    import torch  # here, not at the top: the preflight reads this module's constants only

    try:
        torch.Generator().get_offset()
    except RuntimeError:
        return True
    return False


def rewind_generators_by_state(runner_module: ModuleType) -> None:
    runner = runner_module.CPUModelRunner
    if getattr(runner, "draftsmith_rewinds_by_state", False):
        return
    runner._sample = _saving_discarded_generators(runner._sample)
    runner._bookkeeping_sync = _restoring_discarded_generators(runner._bookkeeping_sync)
    runner.draftsmith_rewinds_by_state = True
    log.warning(
        "draftsmith: vLLM's CPU generators have no offset to rewind (seeded sampling of a "
        "prompt prefilled in chunks would crash); rewinding them by state instead"
    )


def _saving_discarded_generators(sample):
    @functools.wraps(sample)
    def saving_then_sample(self, *args, **kwargs):
        generators = self.input_batch.generators
        discarded = map(int, self.discard_request_mask.np[: self.input_batch.num_reqs].nonzero()[0])
        self.draftsmith_saved_generators = {i: generators[i].get_state() for i in discarded if i in generators}
        return sample(self, *args, **kwargs)

    return saving_then_sample


def _restoring_discarded_generators(bookkeeping_sync):
    @functools.wraps(bookkeeping_sync)
    def restoring_instead_of_offsets(self, *args, **kwargs):
        saved = getattr(self, "draftsmith_saved_generators", {})
        generators = self.input_batch.generators
        # Out of the dict while vLLM's own rewind runs, so it skips them.
        held = {i: generators.pop(i) for i in saved if i in generators}
        try:
            return bookkeeping_sync(self, *args, **kwargs)
        finally:
            for i, generator in held.items():
                generator.set_state(saved[i])
                generators[i] = generator
            self.draftsmith_saved_generators = {}

    return restoring_instead_of_offsets


class _PatchRunnerOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when the runner's module is imported, it hands Python the
    module's own spec with a loader that patches the module once it has run."""

    def find_spec(self, name, path, target=None):
        if name != RUNNER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            rewind_generators_by_state(module)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec
