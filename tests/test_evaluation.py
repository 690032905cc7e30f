"""The evaluation's arithmetic and bookkeeping, on hand-made records (fast tier).

The sweep's real runs (vLLM CPU build) are in tests/test_workflow.py; here: the prompt
sets as read, acceptance from vLLM's per-request histograms, the recommendation, the
top-level keys acceptance.json keeps, and the check against the server's counters.
"""

import json

import pytest
import yaml
from conftest import ROOT
from snakemake.utils import validate

from draftsmith import evaluation_sets
from draftsmith.evaluate import EvaluationError, check_against_server
from draftsmith.evaluation_report import tables_html
from draftsmith.evaluation_summary import by_method_and_length, per_position, run, summarize, tokens_per_step
from draftsmith.records import (
    EvaluationSummary,
    Measurement,
    Phase,
    RecordError,
    Tally,
    acceptance_length,
    read_prompts,
    relative_spread,
)
from draftsmith.run_config import RunConfig
from draftsmith.settings import tracked_settings

SCHEMA = str(ROOT / "workflow/schemas/config.schema.yaml")


def response(tokens: int, histogram: list[int] | None = None) -> dict:
    """A chat completion as vLLM returns it with --per-request-spec-decode-metrics summary."""
    body = {"usage": {"completion_tokens": tokens}}
    if histogram is not None:
        k = len(histogram) - 1
        body["metrics"] = {
            "speculative_decoding": {
                "acceptance_histogram": histogram,
                "num_spec_steps": sum(histogram),
                "num_accepted_draft_tokens": sum(j * n for j, n in enumerate(histogram)),
                "num_draft_tokens": k * sum(histogram),
                "num_spec_tokens": k,
            }
        }
    return body


def test_acceptance_comes_from_the_summed_histograms():
    tally = Tally()
    tally.add(response(10, [1, 0, 1]), 0.5)  # steps: none accepted, both accepted
    tally.add(response(6, [1, 1, 0]), 0.5)
    assert tally.histogram == [2, 1, 1]
    assert acceptance_length(tally) == pytest.approx(1 + (1 + 2) / 4)
    assert per_position(tally, 2) == [0.5, 0.25]
    assert tally.draft_tokens == 8 and tally.completion_tokens == 16


def test_the_baseline_has_no_acceptance_record():
    tally = Tally()
    tally.add(response(10), 1.0)
    assert tally.histogram == [] and acceptance_length(tally) == 1.0


def test_records_that_disagree_with_the_server_counters_stop_the_job():
    phase = Phase("heldout", 8, {"temperature": 0.0})
    phase.categories["all"].add(response(10, [1, 0, 3]), 1.0)
    check_against_server([phase], {"drafts": 4, "accepted_tokens": 6}, ROOT)
    with pytest.raises(EvaluationError, match="disagree with the server's counters.*pin the tested vLLM"):
        check_against_server([phase], {"drafts": 5, "accepted_tokens": 6}, ROOT)
    # After a retry the likelier cause is an attempt the server ran but never answered.
    with pytest.raises(EvaluationError, match=r"after 1 retried request\(s\).*raise evaluation.request_timeout_s"):
        check_against_server([phase], {"drafts": 5, "accepted_tokens": 6}, ROOT, retried=1)
    with pytest.raises(EvaluationError, match="drafter was not used"):
        check_against_server([phase], {"drafts": 0, "accepted_tokens": 0}, "drafter, k=2")
    # n-gram lookup drafts only where it finds a match: none at all is a result, not a fault.
    silent = Phase("heldout", 8, {"temperature": 0.0})
    silent.categories["all"].add(response(10), 1.0)
    check_against_server([silent], {"drafts": 0, "accepted_tokens": 0}, "ngram, k=3", drafts_expected=False)


def test_tokens_per_step_count_the_steps_that_drafted_nothing():
    """16 tokens, 3 of them accepted draft tokens: 13 target steps. Per draft, the drafted
    steps alone (4 of them) accepted 1.75."""
    tally = Tally()
    tally.add(response(10, [1, 0, 1]), 0.5)
    tally.add(response(6, [1, 1, 0]), 0.5)
    assert tokens_per_step(tally) == pytest.approx(16 / 13, abs=1e-4)
    assert acceptance_length(tally) == pytest.approx(1.75)
    assert tokens_per_step(Tally()) == 1.0


def phase(name: str, concurrency: int, temperature: float, seconds: float, categories: dict) -> dict:
    """A phase as evaluate.py writes it: category -> (requests, tokens, latency, histogram)."""
    return {
        "set": name,
        "concurrency": concurrency,
        "sampling": {"temperature": temperature},
        "seconds": seconds,
        "categories": {
            category: {
                "requests": requests,
                "completion_tokens": tokens,
                "request_seconds": latency,
                "histogram": histogram,
                "draft_tokens": (len(histogram) - 1) * sum(histogram),
            }
            for category, (requests, tokens, latency, histogram) in categories.items()
        },
    }


def job(k, seconds_by_concurrency: dict, histogram=None, untrained=False) -> Measurement:
    """One measurement job: held-out and a two-category set, greedy, at each concurrency."""
    histogram = histogram or ([] if k is None else [1] * (k + 1))
    phases = []
    for concurrency, seconds in seconds_by_concurrency.items():
        phases.append(phase("heldout", concurrency, 0.0, seconds, {"all": (10, 100, seconds * 4, histogram)}))
        phases.append(
            phase(
                "code",
                concurrency,
                0.0,
                seconds,
                {"py": (5, 50, seconds * 2, histogram), "sql": (5, 50, seconds * 3, histogram)},
            )
        )
    record = {"num_speculative_tokens": k, "phases": phases, "mla_disabled": False, "drafter": "x"}
    return Measurement.from_json(json.dumps(record | {"server_counters": {}}))


def settings(ks, concurrency, untrained=False) -> RunConfig:
    return RunConfig.from_dict(
        {"evaluation": {"num_speculative_tokens": ks, "concurrency": concurrency, "compare_untrained": untrained}}
    )


def test_the_recommendation_is_the_fastest_draft_length_at_each_concurrency(tmp_path):
    """k=1 wins at concurrency 16 and k=3 at concurrency 1; the serving config follows the
    first concurrency listed."""
    baseline = job(None, {1: 2.0, 16: 1.0})
    drafters = {3: job(3, {1: 1.0, 16: 1.5}), 1: job(1, {1: 1.5, 16: 0.5})}
    result = summarize(settings([3, 1], [16, 1]), baseline, drafters, None)
    best = {row.concurrency: row for row in result.recommendation}
    assert best[1].num_speculative_tokens == 3 and best[1].speedup == pytest.approx(2.0)
    assert best[16].num_speculative_tokens == 1 and best[16].speedup == pytest.approx(2.0)
    assert best[16].speculative_config["num_speculative_tokens"] == 1
    # The top level: held-out, the first draft length (3) and the first concurrency (16).
    assert result.num_speculative_tokens == 3 and result.concurrency == 16
    assert result.max_acceptance_length == 4
    assert result.speedup == pytest.approx(1.0 / 1.5, abs=1e-3)
    assert result.with_drafter.drafts == 4 and result.with_drafter.accepted_per_position == [3, 2, 1]


def test_every_set_and_category_gets_a_row(tmp_path):
    baseline = job(None, {8: 1.0})
    result = summarize(settings(2, 8), baseline, {2: job(2, {8: 1.0}, histogram=[0, 1, 3])}, None)
    rows = {(r.set, r.category): r for r in result.results}
    assert set(rows) == {("heldout", "*"), ("code", "*"), ("code", "py"), ("code", "sql")}
    assert rows[("code", "py")].acceptance_length == pytest.approx(1 + 7 / 4)
    assert rows[("code", "py")].acceptance_per_position == [1.0, 0.75]
    # A category's speed is per request: py's requests took 2 s, sql's 3 s, for 50 tokens each.
    assert rows[("code", "py")].request_tokens_per_s_with_drafter == 25.0
    assert rows[("code", "sql")].request_tokens_per_s_with_drafter == pytest.approx(16.67)


def summary_outputs(tmp_path) -> dict:
    outputs = {name: tmp_path / f"{name}.out" for name in ("acceptance", "spec_config", "tables")}
    return outputs | {name: tmp_path / f"{name}.png" for name in ("acceptance_plot", "speedup_plot")}


def summarized(tmp_path) -> dict:
    """The summary stage's files, as it writes them, for two draft lengths at two
    concurrencies, a two-category set and the untrained comparison."""
    jobs = {
        "baseline": job(None, {8: 1.0, 1: 2.0}),
        "k2": job(2, {8: 0.8, 1: 1.5}, histogram=[0, 1, 3]),
        "k1": job(1, {8: 0.9, 1: 1.8}),
        "untrained": job(2, {8: 2.0, 1: 3.0}, histogram=[4, 0, 0]),
    }
    for name, record in jobs.items():
        (tmp_path / f"{name}.json").write_text(record.to_json())
    outputs = summary_outputs(tmp_path)
    drafters = [tmp_path / "k2.json", tmp_path / "k1.json"]
    run(
        settings([2, 1], [8, 1], untrained=True),
        tmp_path / "baseline.json",
        drafters,
        tmp_path / "untrained.json",
        outputs,
    )
    return outputs


def test_the_summary_writes_the_report_files_and_the_untrained_comparison(tmp_path):
    outputs = summarized(tmp_path)
    result = EvaluationSummary.read(outputs["acceptance"])
    assert result.untrained_acceptance_length == 1.0 and result.acceptance_length == pytest.approx(2.75)
    assert json.loads(outputs["spec_config"].read_text())["num_speculative_tokens"] == 2
    assert outputs["acceptance_plot"].stat().st_size > 10_000 and outputs["speedup_plot"].stat().st_size > 10_000
    html = outputs["tables"].read_text()
    assert "What to serve per concurrency" in html and "<td>sql</td>" in html


def test_the_summary_record_reads_back_the_file_it_wrote(tmp_path):
    """The record is a typed view of acceptance.json: reading and writing again changes no byte."""
    path = summarized(tmp_path)["acceptance"]
    summary = EvaluationSummary.read(path)
    assert summary.to_json() == path.read_text()
    assert {type(row).__name__ for row in summary.results} == {"SetResult", "CategoryResult"}
    assert summary.default_recommendation.concurrency == 8 and summary.default_recommendation.temperature == 0.0
    # What only some runs have is left out, not written as null.
    assert "mla_disabled_because" not in json.loads(path.read_text())


@pytest.mark.parametrize("where", ["top", "recommendation", "option"])
def test_a_summary_missing_a_key_is_one_line_naming_the_file_and_the_fix(tmp_path, where):
    path = summarized(tmp_path)["acceptance"]
    values = json.loads(path.read_text())
    if where == "top":
        del values["recommendation"]
    elif where == "recommendation":
        del values["recommendation"][1]["serve"]
    else:
        del values["recommendation"][0]["options"]["target alone"]["spread"]
    path.write_text(json.dumps(values))
    with pytest.raises(RecordError) as error:
        EvaluationSummary.read(path)
    message = str(error.value)
    assert "\n" not in message and str(path) in message
    assert {"top": "'recommendation'", "recommendation": "recommendation[1] has no 'serve'"}.get(
        where, "'spread'"
    ) in message
    assert message.endswith(
        "rerun the evaluation's summary (snakemake --forcerun evaluate: it reads the measurements again)"
    )


def test_the_spread_is_two_standard_errors_of_the_requests_mean_speed():
    tally = Tally()
    for tokens in (10, 20, 30):  # 10, 20 and 30 tok/s: mean 20, standard deviation 10
        tally.add(response(tokens), 1.0)
    assert relative_spread(tally) == pytest.approx(2 * 10 / 3**0.5 / 20)
    steady = Tally()
    for _ in range(3):
        steady.add(response(20), 1.0)
    assert relative_spread(steady) == 0.0 and relative_spread(Tally()) == 0.0


def measured_job(k, request_tokens: list[int], seconds: float) -> Measurement:
    """One greedy held-out phase at concurrency 8 whose requests each took 1 s, tallied as
    evaluate.py tallies them; a drafter of length k accepts all its drafts."""
    tally = Tally()
    for tokens in request_tokens:
        tally.add(response(tokens, None if k is None else [0] * k + [1]), 1.0)
    phase = Phase("heldout", 8, {"temperature": 0.0}, seconds, {"all": tally})
    return Measurement(f"drafter-{k}", k, [phase], {}, mla_disabled=False)


@pytest.mark.parametrize(
    "request_tokens, chosen, chosen_by",
    [
        # Requests from 40 to 120 tok/s: k=1's 5% lead is well inside the spread (±24%).
        ([40, 60, 80, 100, 120] * 2, 3, "tokens per step"),
        # Every request at 80 tok/s: no spread, and the faster k=1 wins.
        ([80] * 10, 1, "throughput"),
    ],
)
def test_a_lead_within_the_spread_leaves_the_choice_to_acceptance(request_tokens, chosen, chosen_by):
    baseline = measured_job(None, request_tokens, 2.0)
    drafters = {k: measured_job(k, request_tokens, seconds) for k, seconds in ((1, 1.0), (3, 1.05))}
    result = summarize(settings([3, 1], 8), baseline, drafters, None)
    (row,) = result.recommendation
    assert row.tokens_per_s_by_draft_length == {"1": 800.0, "3": pytest.approx(761.9)}
    assert (row.num_speculative_tokens, row.chosen_by) == (chosen, chosen_by)
    assert row.within_noise == ([1, 3] if chosen_by == "tokens per step" else [1])
    assert row.acceptance_length_by_draft_length == {"1": 2.0, "3": 4.0}
    assert row.speculative_config["num_speculative_tokens"] == chosen
    html = tables_html(result)
    if chosen_by == "tokens per step":
        assert row.spread_by_draft_length["1"] == pytest.approx(800 * 0.2357, abs=0.5)
        assert "k=1, k=3 within noise: most tokens per step" in html and "800 ± 188" in html
    else:
        assert row.spread_by_draft_length == {"1": 0.0, "3": 0.0} and "fastest beyond noise" in html


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def sets_config(model, sets, max_model_len=512, max_tokens=64, limit=None, turns="first") -> RunConfig:
    return RunConfig.from_dict(
        {
            "target": {"model": str(model), "trust_remote_code": False},
            "server": {"max_model_len": max_model_len},
            "questions": {"turns": turns},
            "evaluation": {"limit": limit, "max_tokens": max_tokens, "sets": sets},
        }
    )


def test_sets_read_prompt_fields_categories_and_limits(tmp_path, tiny_tokenizer):
    heldout = tmp_path / "heldout.jsonl"
    write_jsonl(heldout, [{"id": "h1", "messages": [{"role": "user", "content": "hi"}]}])
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": f"what is {n}+1?"} for n in range(5)])
    mt = write_jsonl(
        tmp_path / "mt.jsonl",
        [
            {"prompt": ["write a poem", "now shorter"], "category": "writing"},
            {"prompt": ["prove it"], "category": "math"},
            {"prompt": ["write a poem", "again"], "category": "writing"},  # same first turn: a duplicate
        ],
    )
    sets = {
        "gsm8k": {"source": gsm, "prompt_field": "question", "limit": 3},
        "mt_bench": {"source": mt, "category_field": "category"},
    }
    output = tmp_path / "prompts.jsonl"
    sizes = evaluation_sets.run(sets_config(tiny_tokenizer, sets), heldout, output, tmp_path / "sets.json")
    prompts = read_prompts(output)
    assert {name: sum(c.values()) for name, c in sizes.items()} == {"heldout": 1, "gsm8k": 3, "mt_bench": 2}
    assert [p["category"] for p in prompts if p["set"] == "mt_bench"] == ["writing", "math"]
    assert prompts[1]["messages"] == [{"role": "user", "content": "what is 0+1?"}]
    assert prompts[0] == {"set": "heldout", "category": "all", "id": "h1", **prompts[0]}


def test_multi_turn_sets_keep_the_later_turns_that_fit_with_every_answer_at_max_tokens(tmp_path, tiny_tokenizer):
    """MT-Bench's shape under questions.turns all: each user turn is kept while it fits with
    every earlier answer at evaluation.max_tokens; the turns cut are counted per set."""
    heldout = tmp_path / "heldout.jsonl"
    write_jsonl(heldout, [{"id": "h1", "messages": user("hi") + user("ho")}])
    mt = write_jsonl(
        tmp_path / "mt.jsonl",
        [
            {"prompt": ["write a poem", "now shorter"]},
            {"prompt": ["write a poem", "again"]},  # same first turn: another conversation now
            {"prompt": ["prove it", "word " * 40, "and again"]},  # its second turn leaves no room
        ],
    )
    config = sets_config(tiny_tokenizer, {"mt": {"source": mt}}, max_model_len=100, max_tokens=30, turns="all")
    evaluation_sets.run(config, heldout, tmp_path / "prompts.jsonl", tmp_path / "sets.json")
    prompts = {p["messages"][-1]["content"]: p for p in read_prompts(tmp_path / "prompts.jsonl")}
    assert [m["content"] for m in prompts["now shorter"]["messages"]] == ["write a poem", "now shorter"]
    assert "again" in prompts and [m["content"] for m in prompts["prove it"]["messages"]] == ["prove it"]
    assert [m["content"] for m in prompts["ho"]["messages"]] == ["hi", "ho"]  # the held-out split too
    counts = json.loads((tmp_path / "sets.json").read_text())["sets"]
    assert (counts["mt"]["turns"], counts["mt"]["later_turns_dropped"], counts["mt"]["prompts"]) == (5, 2, 3)
    assert (counts["heldout"]["turns"], counts["heldout"]["later_turns_dropped"]) == (2, 0)


def test_every_turn_of_a_conversation_is_asked_after_the_targets_answer_and_measured(monkeypatch):
    """One request per user turn, each holding the target's answers so far; the phase tallies
    every turn's acceptance, once, even when the conversation was retried."""
    import asyncio

    from draftsmith import evaluate, server_stage
    from draftsmith.server import Endpoint
    from draftsmith.server_stage import RequestPolicy, ServerStage

    asked: list[list[dict]] = []
    failed_once: set[str] = set()

    def fake_poster(session, endpoint):
        async def post(payload):
            asked.append(payload["messages"])
            turn = sum(m["role"] == "assistant" for m in payload["messages"])
            if payload["messages"][0]["content"] == "b" and turn == 1 and "b" not in failed_once:
                failed_once.add("b")
                raise RuntimeError("HTTP 503: a transient failure")
            return response(10, [1, 2, 3]) | {"choices": [{"message": {"content": f"answer {turn}"}}]}

        return post

    monkeypatch.setattr(evaluate, "chat_poster", fake_poster)
    monkeypatch.setattr(server_stage, "MAX_BACKOFF_S", 0.0)  # retry at once
    prompts = [
        {"set": "mt", "category": "all", "id": "a", "messages": user("a") + user("a2") + user("a3")},
        {"set": "mt", "category": "all", "id": "b", "messages": user("b") + user("b2")},
    ]
    config = RunConfig.from_dict({"evaluation": {"max_tokens": 16}})
    stage = ServerStage("evaluate", config, RequestPolicy(concurrency=1, timeout_s=10, max_retries=1), "requests")
    phase = Phase("mt", 1, {"temperature": 0.0})
    asyncio.run(evaluate.run_phase(stage, Endpoint("http://127.0.0.1:9/v1", "key", "m"), prompts, phase, "test"))
    assert asked[1] == [*user("a"), {"role": "assistant", "content": "answer 0"}, *user("a2")]
    assert asked[2] == [*asked[1], {"role": "assistant", "content": "answer 1"}, *user("a3")]
    tally = phase.categories["all"]
    assert tally.requests == 5 and tally.histogram == [5, 10, 15]  # three turns of a, two of b, once each


def test_a_set_with_no_usable_prompt_is_named(tmp_path, tiny_tokenizer):
    heldout = write_jsonl(tmp_path / "heldout.jsonl", [{"id": "h1", "messages": [{"role": "user", "content": "x"}]}])
    empty = write_jsonl(tmp_path / "bad.jsonl", [{"text": "no prompt here"}])
    config = sets_config(tiny_tokenizer, {"code": {"source": empty}})
    with pytest.raises(evaluation_sets.EvaluationSetError, match="evaluation.sets.code .* holds no usable prompt"):
        evaluation_sets.run(config, tmp_path / "heldout.jsonl", tmp_path / "out.jsonl", tmp_path / "sets.json")
    assert heldout and not (tmp_path / "out.jsonl").exists()


def user(text):
    return [{"role": "user", "content": text}]


def test_prompts_with_no_room_for_the_answer_are_dropped_and_counted_per_set(tmp_path, tiny_tokenizer):
    """At max_model_len 100 and max_tokens 40, a prompt may hold 60 tokens (chat template
    included): longer ones never reach a server, in the held-out split or in a set."""
    long_text = "word " * 80  # 83 tokens with the template; "hi" is 4
    heldout = tmp_path / "heldout.jsonl"
    write_jsonl(heldout, [{"id": "h1", "messages": user("hi")}, {"id": "h2", "messages": user(long_text)}])
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": long_text}, {"prompt": "hi"}, {"prompt": "ho"}])
    config = sets_config(tiny_tokenizer, {"chat": {"source": chat}}, max_model_len=100, max_tokens=40, limit=1)
    output, summary = tmp_path / "prompts.jsonl", tmp_path / "sets.json"
    sizes = evaluation_sets.run(config, heldout, output, summary)
    assert {name: sum(c.values()) for name, c in sizes.items()} == {"heldout": 1, "chat": 2}
    assert [p["id"] for p in read_prompts(output)][0] == "h1"
    reason = "prompt over 60 tokens (no room for evaluation.max_tokens 40 in server.max_model_len 100)"
    record = json.loads(summary.read_text())
    assert record["max_prompt_tokens"] == 60
    assert record["sets"]["heldout"] | {"by_category": None} == {
        "rows_read": 2,
        "duplicates": 0,
        "dropped": {reason: 1},
        "turns": 1,
        "later_turns_dropped": 0,
        "prompts": 1,
        "by_category": None,
    }
    assert record["sets"]["chat"]["dropped"] == {reason: 1} and record["sets"]["chat"]["prompts"] == 2
    # A held-out split with nothing that fits says which setting to change, before any server.
    config = sets_config(tiny_tokenizer, {}, max_model_len=100, max_tokens=99)
    with pytest.raises(evaluation_sets.EvaluationSetError, match="lower evaluation.max_tokens or raise"):
        evaluation_sets.run(config, heldout, output, summary)


def demo() -> dict:
    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    validate(config, SCHEMA)
    return config


def test_the_sweep_settings_accept_one_value_or_a_list():
    config = demo()
    run = RunConfig.from_dict(config)
    assert run.evaluation.draft_lengths == [3, 1] and run.evaluation.concurrencies == [8, 4]
    assert run.evaluation_samplings == [{"temperature": 0.0}, {"temperature": 0.7, "top_p": 1.0, "seed": 0}]
    config["evaluation"].update(num_speculative_tokens=4, concurrency=2, sampled=False)
    run = RunConfig.from_dict(config)
    assert run.evaluation.draft_lengths == [4] and run.evaluation.concurrencies == [2]
    assert run.evaluation_samplings == [{"temperature": 0.0}]


def test_a_draft_length_is_not_a_setting_of_the_measurement_jobs():
    """Adding a draft length must leave the finished jobs' params as they are."""
    config = demo()
    longer = demo()
    longer["evaluation"]["num_speculative_tokens"] = [3, 1, 2]
    for rule in ("evaluation_sets", "evaluate_baseline", "evaluate_drafter", "evaluate_untrained"):
        assert tracked_settings(config, rule) == tracked_settings(longer, rule), rule
    assert tracked_settings(config, "evaluate") != tracked_settings(longer, "evaluate")
    # The generation's sampling is measured only when evaluation.sampled says so.
    hotter = demo()
    hotter["generation"]["sampling"]["temperature"] = 0.9
    assert tracked_settings(config, "evaluate_drafter") != tracked_settings(hotter, "evaluate_drafter")
    hotter["evaluation"]["sampled"] = config["evaluation"]["sampled"] = False
    assert tracked_settings(config, "evaluate_drafter") == tracked_settings(hotter, "evaluate_drafter")


@pytest.mark.parametrize(
    "evaluation, message",
    [
        ({"num_speculative_tokens": [3, 3]}, "non-unique"),
        ({"concurrency": []}, "is not valid under any of the given schemas"),
        ({"sets": {"heldout": {"source": "x.jsonl"}}}, "should not be valid"),
        ({"sets": {"code": {"path": "x.jsonl"}}}, "'source' is a required property"),
    ],
)
def test_bad_evaluation_settings_are_refused_by_the_schema(evaluation, message):
    from draftsmith.config_check import config_problem

    config = demo()
    config["evaluation"].update(evaluation)
    problem = config_problem(config, SCHEMA)
    assert problem is not None and problem.startswith("config evaluation"), problem


def test_counters_are_summed_over_engines_and_labels():
    """vLLM's /metrics page has a sample per engine (and per label); a total adds them all."""
    from draftsmith.evaluate import spec_decode_counters
    from draftsmith.server import counter_totals

    page = "\n".join(
        [
            "# TYPE vllm:spec_decode_num_drafts counter",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0',
            "# TYPE vllm:spec_decode_num_draft_tokens counter",
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0',
            "# TYPE vllm:spec_decode_num_accepted_tokens counter",
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 21.0',
            "# TYPE vllm:request_success counter",
            'vllm:request_success_total{engine="0",finished_reason="length"} 7.0',
            'vllm:request_success_total{engine="0",finished_reason="stop"} 2.0',
            "",
        ]
    )
    assert spec_decode_counters(page) == {"drafts": 15, "draft_tokens": 30, "accepted_tokens": 21, "per_position": {}}
    assert counter_totals(page, ["vllm:request_success_total", "absent"]) == {
        "vllm:request_success_total": 9,
        "absent": 0,
    }


def free_job(method: str, k: int, request_tokens: list[int], seconds: float, histogram: list[int]) -> Measurement:
    """A free method's job like ``measured_job``'s: each request drafted ``histogram``'s steps."""
    tally = Tally()
    for tokens in request_tokens:
        tally.add(response(tokens, histogram), 1.0)
    phase = Phase("heldout", 8, {"temperature": 0.0}, seconds, {"all": tally})
    return Measurement(None, k, [phase], {}, mla_disabled=False, method=method)


def test_a_drafter_slower_than_the_target_alone_is_not_served(tmp_path):
    """The issue's real-model case: the drafter accepts little and costs more than it saves.
    The target alone is faster beyond noise, so nothing speculative is served, and the serving
    config says so with null."""
    steady = [80] * 10  # no spread: every difference is beyond noise
    baseline = measured_job(None, steady, 1.0)
    drafters = {3: measured_job(3, steady, 1.45)}
    for name, record in {"baseline": baseline, "k3": drafters[3]}.items():
        (tmp_path / f"{name}.json").write_text(record.to_json())
    outputs = summary_outputs(tmp_path)
    result = run(settings([3], 8), tmp_path / "baseline.json", [tmp_path / "k3.json"], None, outputs)
    (row,) = result.recommendation
    assert row.serve == "target alone" and row.serve_speedup == 1.0
    assert row.speculative_config is None and row.speedup == pytest.approx(0.69, abs=0.01)
    assert json.loads(outputs["spec_config"].read_text()) is None
    assert "<td>target alone</td>" in outputs["tables"].read_text()


def test_n_gram_is_served_where_it_beats_the_drafter_and_compared_per_step(tmp_path):
    """n-gram drafts on one step in four here and accepts everything it drafts: 4.0 per draft,
    yet fewer tokens per step than a drafter accepting 2 of 3 at every step. It is served only
    when it is the fastest."""
    steady = [80] * 10
    baseline = measured_job(None, steady, 2.0)
    drafter = Tally()
    for _ in range(10):
        drafter.add(response(80, [0, 0, 26, 0]), 1.0)  # 26 steps of 3 tokens, 2 steps of 1
    drafter_job = Measurement("d", 3, [Phase("heldout", 8, {"temperature": 0.0}, 1.2, {"all": drafter})], {}, False)
    ngram = {3: free_job("ngram", 3, steady, 1.0, [0, 0, 0, 5]), 1: free_job("ngram", 1, steady, 1.5, [0, 5])}
    result = summarize(settings([3, 1], 8), baseline, {3: drafter_job}, None, {"ngram": ngram})
    (row,) = result.recommendation
    assert row.serve == "ngram k=3" and row.serve_chosen_by == "throughput"
    assert row.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    options = row.options
    assert set(options) == {"target alone", "drafter k=3", "ngram k=3"}
    assert options["ngram k=3"].acceptance_length == 4.0
    assert options["ngram k=3"].tokens_per_step == pytest.approx(80 / 65, abs=1e-4)  # 15 accepted of 80
    assert options["drafter k=3"].tokens_per_step == pytest.approx(80 / 28, abs=1e-4)
    assert options["ngram k=3"].speedup == 2.0 and options["target alone"].speedup == 1.0
    ngram_rows = [r for r in result.results if r.method == "ngram"]
    assert {r.num_speculative_tokens for r in ngram_rows} == {3, 1}
    assert all(r.tokens_per_step >= 1.0 for r in result.results)
    html = tables_html(result)
    assert "<td>ngram k=3</td>" in html and "<td>ngram</td>" in html
    # Slower n-gram: the drafter is served, and n-gram stays in the table as an option.
    slow = {3: free_job("ngram", 3, steady, 1.5, [0, 0, 0, 5]), 1: free_job("ngram", 1, steady, 1.6, [0, 5])}
    (row,) = summarize(settings([3, 1], 8), baseline, {3: drafter_job}, None, {"ngram": slow}).recommendation
    assert row.serve == "drafter k=3" and row.speculative_config["method"] == "eagle3"
    assert row.speculative_config == row.drafter_speculative_config


def test_a_tie_with_the_target_alone_goes_to_the_most_tokens_per_step():
    """Within noise of each other, the option that does more per target step is served: on a
    busier machine the target alone would not pull ahead of it."""
    noisy = [40, 60, 80, 100, 120] * 2
    baseline = measured_job(None, noisy, 1.0)
    drafters = {3: measured_job(3, noisy, 1.05)}
    (row,) = summarize(settings([3], 8), baseline, drafters, None).recommendation
    assert row.serve == "drafter k=3" and row.serve_chosen_by == "tokens per step"
    assert row.serve_within_noise == ["target alone", "drafter k=3"]


def kind_job(kind: str, k: int, seconds: float, histogram: list[int]) -> Measurement:
    """Another kind's drafter job: a drafter directory, served by its kind's method."""
    tally = Tally()
    for tokens in [80] * 10:
        tally.add(response(tokens, histogram), 1.0)
    phase = Phase("heldout", 8, {"temperature": 0.0}, seconds, {"all": tally})
    method = "eagle3" if kind == "peagle" else kind
    return Measurement(f"/run/drafter_{kind}", k, [phase], {}, mla_disabled=False, method=method, kind=kind)


def test_other_kinds_are_options_beside_eagle3_and_served_with_their_own_method(tmp_path):
    """P-EAGLE (vLLM's eagle3 method plus parallel drafting) and DFlash are measured like the
    EAGLE-3 drafter; the fastest beyond noise is served with its kind's config, and the
    results name each row's kind (P-EAGLE's method alone would read eagle3)."""
    steady = [80] * 10
    baseline = measured_job(None, steady, 2.0)
    eagle3 = {3: measured_job(3, steady, 1.2)}
    kinds = {
        "peagle": {3: kind_job("peagle", 3, 0.9, [0, 0, 0, 20]), 1: kind_job("peagle", 1, 1.3, [0, 40])},
        "dflash": {3: kind_job("dflash", 3, 1.5, [0, 10, 10, 0]), 1: kind_job("dflash", 1, 1.6, [10, 30])},
    }
    for name, by_length in kinds.items():  # through the files the jobs write
        for k, record in by_length.items():
            (tmp_path / f"{name}_k{k}.json").write_text(record.to_json())
    kinds = by_method_and_length([Measurement.read(path) for path in sorted(tmp_path.glob("*_k*.json"))])
    (row,) = summarize(settings([3, 1], 8), baseline, eagle3, None, None, kinds).recommendation
    assert set(row.options) == {"target alone", "drafter k=3", "peagle k=3", "dflash k=3"}
    assert row.serve == "peagle k=3" and row.serve_chosen_by == "throughput"
    assert row.speculative_config == {
        "model": "/run/drafter_peagle",
        "method": "eagle3",
        "parallel_drafting": True,
        "num_speculative_tokens": 3,
    }
    assert row.drafter_speculative_config["method"] == "eagle3"  # EAGLE-3's own best length
    rows = summarize(settings([3, 1], 8), baseline, eagle3, None, None, kinds).results
    assert {(r.method, r.num_speculative_tokens) for r in rows} >= {("peagle", 3), ("peagle", 1), ("dflash", 1)}
    # Within noise of each other both are candidates, EAGLE-3 first (it breaks an exact tie).
    close = {"peagle": {3: kind_job("peagle", 3, 1.2, [0, 0, 0, 20])}}
    (row,) = summarize(settings([3], 8), baseline, eagle3, None, None, close).recommendation
    assert row.serve_within_noise[-2:] == ["drafter k=3", "peagle k=3"]


def per_position_page(drafts: int, accepted_by_position: list[int]) -> str:
    lines = ["# TYPE vllm:spec_decode_num_drafts counter", f'vllm:spec_decode_num_drafts_total{{engine="0"}} {drafts}']
    lines += ["# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter"]
    lines += [
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{p}"}} {n}'
        for p, n in enumerate(accepted_by_position)
    ]
    return "\n".join([*lines, ""])


def test_a_vllm_without_per_request_metrics_gives_the_histogram_from_its_counters():
    """vLLM 0.26 has no per-request acceptance: the steps between two readings of its
    per-position counters give the same histogram (steps that accepted exactly j tokens)."""
    from draftsmith.evaluate import histogram_between, spec_decode_counters
    from draftsmith.records import Tally

    before = spec_decode_counters(per_position_page(4, [3, 2, 1]))
    # 10 more steps at k=3: 2 accepted none, 3 accepted one, 1 two, 4 all three.
    after = spec_decode_counters(per_position_page(14, [3 + 8, 2 + 5, 1 + 4]))
    assert after["per_position"] == {0: 11, 1: 7, 2: 5}
    histogram = histogram_between(before, after)
    assert histogram == [2, 3, 1, 4]
    assert acceptance_length(Tally(histogram=histogram)) == 1 + (3 + 2 + 12) / 10
    assert histogram_between(after, after) == []  # no drafts (n-gram found no match): no steps
