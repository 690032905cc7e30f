"""Requests that fail, hang or drop, injected by a proxy in front of the real vLLM server
(speaking its protocol): the generation stage retries a bounded number of times, fails
clearly over its error budget without publishing, and a rerun asks only for the rest."""

import json
import zlib

import pytest
from conftest import server_settings
from fault_proxy import FaultProxy, question_key
from test_generate import GENERATION, assert_complete_and_well_formed, write_questions

from draftsmith import generate
from draftsmith.run_config import RunConfig
from draftsmith.server import ServerSpec, managed_server

pytestmark = pytest.mark.vllm
PROXY_KEY_ENV = "DRAFTSMITH_FAULT_PROXY_KEY"


@pytest.fixture(scope="module")
def proxy(demo_target, tmp_path_factory):
    """One real vLLM server for the module, behind the proxy."""
    spec = ServerSpec.from_config(RunConfig.from_dict(server_settings(demo_target)))
    log = tmp_path_factory.mktemp("proxied") / "server.log"
    with managed_server(spec, log_path=log) as upstream, FaultProxy(upstream, "proxy-key") as proxy:
        yield proxy


@pytest.fixture
def settings_via_proxy(proxy, demo_target, monkeypatch):
    monkeypatch.setenv(PROXY_KEY_ENV, proxy.api_key)
    endpoint = {"base_url": proxy.endpoint.base_url, "model": str(demo_target), "api_key_env": PROXY_KEY_ENV}
    # A hung request is abandoned after 8 s; two retries with speculators' back-off (2 s, 4 s).
    return server_settings(demo_target) | {
        "generation": GENERATION | {"endpoint": endpoint, "request_timeout_s": 8, "max_retries": 2}
    }


def test_errors_hangs_and_dropped_connections_are_retried_to_a_complete_shard(proxy, settings_via_proxy, tmp_path):
    questions = write_questions(tmp_path / "q.jsonl", 18)
    kinds = ["error", "hang", "drop"]
    # Every question's first attempt fails, one of three ways; the second goes through.
    proxy.reset(lambda key, attempt: kinds[zlib.crc32(key.encode()) % 3] if attempt == 1 else None)

    tally = generate.run(
        RunConfig.from_dict(settings_via_proxy),
        tmp_path / "q.jsonl",
        tmp_path / "staging",
        tmp_path / "out.jsonl",
        None,
    )

    assert tally.ok == 18 and not tally.errors
    assert set(proxy.faults) == set(kinds) and sum(proxy.faults.values()) == 18
    assert sorted(proxy.attempts.values()) == [2] * 18  # one fault, one success: bounded
    assert_complete_and_well_formed(tmp_path / "out.jsonl", questions)


def test_persistent_failures_over_the_budget_fail_clearly_then_a_rerun_asks_only_for_them(
    proxy, settings_via_proxy, tmp_path
):
    questions = write_questions(tmp_path / "q.jsonl", 20)
    doomed = {question_key({"messages": questions[i]["messages"]}) for i in (2, 6, 11, 15, 19)}
    proxy.reset(lambda key, attempt: "error" if key in doomed else None)
    settings = settings_via_proxy | {"generation": settings_via_proxy["generation"] | {"max_error_fraction": 0.1}}
    staging, output = tmp_path / "staging", tmp_path / "out.jsonl"

    with pytest.raises(generate.GenerationError, match=r"5 of 20 questions failed .*HTTP 500.*injected fault"):
        generate.run(RunConfig.from_dict(settings), tmp_path / "q.jsonl", staging, output, None)
    assert not output.exists(), "a shard over its error budget must not be published"
    assert all(proxy.attempts[key] == 3 for key in doomed)  # 1 + max_retries, no more
    assert len(generate.load_records(staging / generate.RECORDS)) == 15

    proxy.reset(lambda key, attempt: None)  # the outage is over
    generate.run(RunConfig.from_dict(settings), tmp_path / "q.jsonl", staging, output, None)
    assert sorted(proxy.attempts) == sorted(doomed)  # only the five missing were asked
    assert json.loads((staging / "summary.json").read_text())["asked_this_run"] == 5
    assert_complete_and_well_formed(output, questions)
