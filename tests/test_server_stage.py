"""The policy every server stage sends its requests under (server_stage), without a server:
the request for one item is a stand-in that fails as a server or network would."""

import asyncio
import errno

import httpx
import openai
import pytest
from speculators.data_generation.vllm_client import InvalidResponseError

from draftsmith import server_stage
from draftsmith.progress import Progress
from draftsmith.run_config import EvaluationSettings, GenerationSettings
from draftsmith.server_stage import RequestPolicy, ServerStage, StageError


class Failing(StageError):
    pass


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    slept, real_sleep = [], asyncio.sleep

    async def sleep(seconds):
        if seconds:
            slept.append(seconds)
        await real_sleep(0)  # yields, as a real wait does

    monkeypatch.setattr(server_stage.asyncio, "sleep", sleep)
    return slept


def stage(max_retries=2, max_error_fraction=0.0, concurrency=2) -> ServerStage[int]:
    policy = RequestPolicy(concurrency, 10.0, max_retries, max_error_fraction)
    return ServerStage("generate", {}, policy, "rows", name=lambda row: f"row {row}", error=Failing)


def send(stage, items, request):
    progress = Progress("test", len(items))
    return asyncio.run(stage.request_all(items, request, progress)), progress


def test_transient_failures_are_retried_with_back_off_up_to_max_retries(no_backoff):
    attempts = {}

    async def request(row):
        attempts[row] = attempts.get(row, 0) + 1
        if row == 0 or attempts[row] == 1:  # row 0 always fails; the others once
            raise RuntimeError("HTTP 503: overloaded")
        return {"truncated": row % 2}

    retrying = stage(max_retries=2)
    failures, progress = send(retrying, list(range(4)), request)
    assert attempts == {0: 3, 1: 2, 2: 2, 3: 2}  # 1 + max_retries for the one that never passes
    assert retrying.retried == 5  # counted for the evaluation's check against the server
    assert failures == {0: "RuntimeError: HTTP 503: overloaded"}
    assert sorted(no_backoff) == [2.0] * 4 + [4.0]  # 2 s, then 4 s: exponential
    assert progress.counts == {"ok": 3, "failed": 1, "truncated": 2}


REJECTED = httpx.Response(400, request=httpx.Request("POST", "http://127.0.0.1/v1/completions"))


@pytest.mark.parametrize(
    "error",
    [
        InvalidResponseError("HTTP 400: bad request"),
        openai.BadRequestError("token id out of range", response=REJECTED, body=None),
    ],
)
def test_deterministic_failures_are_not_retried(error):
    attempts = []

    async def request(row):
        attempts.append(row)
        raise error

    rejecting = stage(max_retries=3)
    failures, _ = send(rejecting, [7], request)
    assert attempts == [7] and list(failures) == [7] and rejecting.retried == 0


def test_a_long_run_of_failures_stops_the_stage_as_a_dead_server():
    asked = []

    async def request(row):
        asked.append(row)
        await asyncio.sleep(0)  # the connection attempt
        raise ConnectionRefusedError("connection refused")

    with pytest.raises(Failing, match=r"8 rows in a row failed \(last: row \d+: ConnectionRefusedError"):
        send(stage(max_retries=0, concurrency=2), list(range(100)), request)
    assert len(asked) < 20  # it stopped, rather than churn through the shard


def test_a_full_disk_stops_the_stage_at_once_rather_than_count_as_a_failed_request():
    """Staging a finished item is part of its request (per turn, in generation), but a full
    disk is this machine's: not retried, not counted, raised as itself for the one-line error."""
    asked = []

    async def request(row):
        asked.append(row)
        await asyncio.sleep(0)
        raise OSError(errno.ENOSPC, "short write", "staging/records.jsonl")

    with pytest.raises(OSError) as raised:
        send(stage(max_retries=3, concurrency=1), list(range(10)), request)
    assert raised.value.errno == errno.ENOSPC and len(asked) <= 2  # stopped, not one try per row


def test_the_error_budget_names_the_first_failures_and_where_work_is_kept():
    failing = stage(max_error_fraction=0.25)
    failing.check_failures({1: "HTTP 500", 2: "HTTP 500"}, 8, "Kept in staging")  # 2 of 8: within
    with pytest.raises(Failing) as raised:  # failures as they finished: named in row order
        failing.check_failures({row: f"HTTP 50{row % 2}" for row in reversed(range(7))}, 8, "Kept in staging")
    assert str(raised.value) == (
        "7 of 8 rows failed (more than max_error_fraction=0.25): row 0: HTTP 500; row 1: HTTP 501; "
        "row 2: HTTP 500; row 3: HTTP 501; row 4: HTTP 500; and 2 more. Kept in staging"
    )
    with pytest.raises(Failing, match=r"^1 of 8 rows failed: row 0: HTTP 500\. Kept"):  # no budget: any failure
        stage().check_failures({0: "HTTP 500"}, 8, "Kept")


def test_the_policy_comes_from_a_config_section():
    section = EvaluationSettings.from_dict({"concurrency": [8, 4], "request_timeout_s": 30, "max_retries": 1})
    assert RequestPolicy.from_section(section, concurrency=8) == RequestPolicy(8, 30, 1, 0.0)
    generation = GenerationSettings.from_dict(
        {"concurrency": 16, "request_timeout_s": 300, "max_retries": 3, "max_error_fraction": 0.02}
    )
    assert RequestPolicy.from_section(generation) == RequestPolicy(16, 300, 3, 0.02)
