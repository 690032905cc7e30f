"""The vLLM plugin that lets the CPU build's engine queues sleep when idle (draftsmith.vllm_cpu_idle),
on vLLM's own shared-memory queue: a reader stops spinning soon after a read, never sleeps
past a message, and a message wakes it. What it saves is measured in bench/cpu_idle_server.py."""

from __future__ import annotations

import threading
from importlib.metadata import entry_points

import pytest
import zmq

from draftsmith import vllm_cpu_idle

vllm_cpu_idle.register()
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition  # noqa: E402


def test_vllm_finds_the_plugin_through_the_installed_entry_point():
    plugins = {entry.name: entry.value for entry in entry_points(group="vllm.general_plugins")}
    assert plugins.get("draftsmith_cpu_idle") == "draftsmith.vllm_cpu_idle:register"


@pytest.fixture
def queue_sockets(tmp_path):
    """A writer's and a reader's notification sockets, as vLLM's MessageQueue pairs them."""
    context = zmq.Context()
    address = f"ipc://{tmp_path / 'notify'}"
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    yield writer, reader
    context.destroy(linger=0)


def waits_returned(reader: SpinCondition, timeout_ms: int | None, within_s: float = 30.0) -> bool:
    """Whether ``reader.wait(timeout_ms)`` returned within ``within_s`` (it runs in a thread)."""
    waiting = threading.Thread(target=reader.wait, kwargs={"timeout_ms": timeout_ms}, daemon=True)
    waiting.start()
    waiting.join(within_s)
    return not waiting.is_alive()


def test_a_reader_spins_only_briefly_after_a_read_and_is_patched_once(queue_sockets):
    _, reader = queue_sockets
    assert reader.busy_loop_s == vllm_cpu_idle.SPIN_AFTER_READ_S < 1  # vLLM's own: a second
    patched = SpinCondition.wait
    vllm_cpu_idle.register()
    assert SpinCondition.wait is patched


def test_an_idle_reader_never_sleeps_past_a_message_nobody_announced(queue_sockets):
    """vLLM's reader, once idle, waits for the writer's notification with no time limit; with
    its spin turned off and no limit, a request hung (a notification lost on the way, most
    likely). With the plugin it looks at the queue again after 10 ms at most."""
    _, reader = queue_sockets
    reader.last_read = 0.0  # idle: long past its last read
    assert waits_returned(reader, timeout_ms=None)


def test_a_notification_wakes_an_idle_reader(queue_sockets):
    writer, reader = queue_sockets
    reader.last_read = 0.0
    for _ in range(100):  # a PUB socket drops what it sends before its subscriber has joined
        writer.notify()
        if reader.poller.poll(timeout=50):
            break
    assert dict(reader.poller.poll(timeout=0)).get(reader.local_notify_socket) == zmq.POLLIN
    assert waits_returned(reader, timeout_ms=60_000)
    assert not reader.poller.poll(timeout=0)  # the wait took the notification
