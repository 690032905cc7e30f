"""A vLLM plugin that lets the CPU build's engine processes sleep between steps instead of spinning.

vLLM's engine core hands each step to its workers, and the workers hand their outputs back,
through shared-memory queues. A reader of such a queue spins (``sched_yield`` in a loop) for
a whole second after every message before it sleeps on the queue's socket, so that a GPU
host's next step starts without a wake-up. On a CPU the spin takes a core from the model
itself and from whatever runs beside the server. The worst case is the training job's capture
server, which answers a request every step or two: its worker and engine core never slept,
and the trainer beside them ran on what they left.

``register`` shortens the spin to 2 ms on CPU, which still covers the gap between two steps
of a busy server, so a loaded server runs as before. After it the reader sleeps on the socket,
but for at most 10 ms at a time before it looks at the queue again: with no spin and no such
limit a request hung here, its reader asleep although the message had been written. The
writer notifies with every message, but its socket has a send high-water mark of 1, so a
notification sent while the previous one is in flight can be dropped (the likely cause);
vLLM's one-second spin hides that. A lost notification now costs at most 10 ms, and an idle
reader wakes 100 times a second instead of spinning.
"""

from __future__ import annotations

# How vLLM finds this plugin (pyproject.toml's entry point); the preflight checks it.
PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "draftsmith_cpu_idle"
PLUGIN_VALUE = f"{__name__}:register"
# Third-party names this module uses; the preflight checks each exists (preflight.declared).
THIRD_PARTY = [("vllm.distributed.device_communicators.shm_broadcast", "SpinCondition")]
SPIN_AFTER_READ_S = 0.002  # vLLM's: 1 s
SLEEP_AT_MOST_MS = 10  # vLLM's: until notified


def register() -> None:
    """vLLM's plugin hook: on CPU, queue readers spin 2 ms after a read, then sleep in 10 ms polls."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.distributed.device_communicators import shm_broadcast

    condition = shm_broadcast.SpinCondition
    if getattr(condition, "draftsmith_sleeps_when_idle", False):  # vLLM may load plugins twice
        return
    spinning_init, spinning_wait = condition.__init__, condition.wait

    def init(self, *args, **kwargs) -> None:
        spinning_init(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = SPIN_AFTER_READ_S

    def wait(self, timeout_ms: int | None = None) -> None:
        capped = SLEEP_AT_MOST_MS if timeout_ms is None else min(timeout_ms, SLEEP_AT_MOST_MS)
        spinning_wait(self, timeout_ms=capped)

    condition.__init__ = init
    condition.wait = wait
    condition.draftsmith_sleeps_when_idle = True
