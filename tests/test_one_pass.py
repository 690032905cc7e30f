"""One pass (hidden_states.capture: during_generation) against the real vLLM CPU build: the
generation server saves each answer's states, the dataset and the extraction adopt them
without a server, and they equal what a separate extraction's prefill stores. Two of the
conversations have two turns: the last turn's states cover the whole conversation."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import heavy_processes_after, server_settings
from safetensors.torch import load_file, save_file
from test_generate import GENERATION, write_questions

from draftsmith import dataset, extract, generate
from draftsmith.layout import CAPTURES, hidden_state_file
from draftsmith.one_pass import (
    ADOPTED,
    CUT,
    IDS_DIFFER,
    NOT_CAPTURED,
    CaptureSpool,
    adopt_captures,
    captured_state_file,
)
from draftsmith.records import CapturedRows, RowIds, ShardManifest
from draftsmith.run_config import RunConfig
from draftsmith.shard_gate import BadSample

LAYERS = [1, 2, 4, 5]  # the demo config's
QUESTIONS = 8
MULTI_TURN = 2  # of them, with a second user turn
# Decode and prefill states of the same token: relative to the largest value (bf16 serving).
TOLERANCE = 0.05


def one_pass_settings(model: Path, capture: str = "during_generation", budget: str = "all") -> dict:
    settings = server_settings(model)
    settings["hidden_states"] |= {"capture": capture, "disk_budget": budget}
    return settings | {
        "layers": LAYERS,
        "questions": {"shards": 1, "max_prompt_tokens": None},
        "generation": GENERATION | {"max_tokens": 24},
        "dataset": {"seq_length": 448, "min_trainable_tokens": 1},
        "extraction": {"concurrency": 4, "request_timeout_s": 120, "max_retries": 1},
    }


def write_conversations(path: Path) -> None:
    """QUESTIONS demo questions, the first MULTI_TURN of them with a second user turn."""
    rows = write_questions(path, QUESTIONS + MULTI_TURN)
    questions = [{"id": row["id"], "messages": row["messages"]} for row in rows[:QUESTIONS]]
    for question, second in zip(questions, rows[QUESTIONS:], strict=False):
        question["messages"] = question["messages"] + second["messages"]
    path.write_text("".join(json.dumps(question) + "\n" for question in questions))


def kill_generation_after(answers: int, settings: dict, work: Path, staging: Path) -> int:
    """SIGKILL the generation stage (its whole group) once ``answers`` conversations are
    finished; the server's guard stops the server. Returns how many were finished by then."""
    records = staging / "records.jsonl"
    command = [sys.executable, "-m", "draftsmith.generate", "--settings", json.dumps(settings)]
    command += ["--questions", str(work / "q.jsonl"), "--staging", str(staging), "--output", str(work / "x.jsonl")]
    process = subprocess.Popen(command, start_new_session=True, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while sum(map(generate.finished, generate.read_records(records).values())) < answers:
        assert process.poll() is None and time.monotonic() < deadline, "the generation ended before the kill"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert heavy_processes_after(20) == []
    return sum(map(generate.finished, generate.read_records(records).values()))


@pytest.fixture(scope="module")
def one_pass_run(demo_target, tmp_path_factory):
    """Generation in one pass (one server load), the dataset, then the extraction of the
    same rows twice: adopting the captures (no server) and, for reference, by prefill as a
    separate extraction does."""
    work = tmp_path_factory.mktemp("one_pass")
    write_conversations(work / "q.jsonl")
    settings = RunConfig.from_dict(one_pass_settings(demo_target))
    generation = work / "generation"
    killed_after = kill_generation_after(3, one_pass_settings(demo_target), work, generation)
    generate.run(settings, work / "q.jsonl", generation, work / "completions.jsonl", None)
    (work / "killed_after.json").write_text(json.dumps(killed_after))
    dataset.run(settings, [work / "completions.jsonl"], work / "dataset_staging", work / "dataset")
    started = time.monotonic()
    adopted = extract.run(settings, work / "dataset", 0, 1, work / "hs_staging", work / "hs", captures=[generation])
    adopt_seconds = time.monotonic() - started
    separate = RunConfig.from_dict(one_pass_settings(demo_target, capture="separate"))
    extract.run(separate, work / "dataset", 0, 1, work / "prefill_staging", work / "prefill")
    return work, adopted, adopt_seconds


@pytest.mark.vllm
def test_generation_saves_every_answer_with_its_states(one_pass_run):
    work, _, _ = one_pass_run
    records = [json.loads(line) for line in (work / "completions.jsonl").read_text().splitlines()]
    assert len(records) == QUESTIONS and all(record["captured"] for record in records)
    assert sorted(record["turns"] for record in records) == [1] * (QUESTIONS - MULTI_TURN) + [2] * MULTI_TURN
    for record in records:
        states = load_file(captured_state_file(work / "generation", record["id"]))
        # Every token fed to the model: the prompt and the answer but its final token.
        assert states["token_ids"].tolist() == record["input_ids"][:-1]
        assert list(states["hidden_states"].shape[1:]) == [len(LAYERS), 128]  # the demo is 128 wide
    summary = json.loads((work / "generation/summary.json").read_text())
    assert summary["states_captured"]["answers"] == QUESTIONS
    assert not (work / "generation/vllm").exists()  # the connector's spool is cleaned up


@pytest.mark.vllm
def test_the_extraction_adopts_every_row_without_a_server(one_pass_run, demo_target):
    work, adopted, seconds = one_pass_run
    rows = RowIds.read(work / "dataset").ids
    assert CapturedRows.read(work / "dataset") == CapturedRows(captured=len(rows), rows=len(rows))
    assert adopted.requested == []  # nothing asked of a server: no model load
    manifest = ShardManifest.read(work / "hs")
    assert manifest.captured_during_generation == {ADOPTED: len(rows)}
    print(f"one pass: {len(rows)} rows adopted in {seconds:.1f}s")
    for row, question in enumerate(rows):
        published = hidden_state_file(work / "hs", row)
        assert published.samefile(captured_state_file(work / "generation", question))  # linked, not copied


@pytest.mark.vllm
def test_captured_states_equal_the_prefill_extraction_at_every_layer(one_pass_run):
    """Decode kernels wrote the one-pass states, prefill kernels the separate extraction's."""
    work, _, _ = one_pass_run
    worst = 0.0
    for path in sorted((work / "prefill").glob("hs_*.safetensors")):
        prefill, captured = load_file(path), load_file(work / "hs" / path.name)
        assert captured["token_ids"].tolist() == prefill["token_ids"].tolist()
        for layer in range(len(LAYERS)):
            want = prefill["hidden_states"][:, layer].float()
            got = captured["hidden_states"][:, layer].float()
            error = ((got - want).abs().max() / want.abs().max()).item()
            assert error < TOLERANCE, f"{path.name} layer {LAYERS[layer]}: {error:.4f}"
            worst = max(worst, error)
    print(f"decode vs prefill, worst relative error over every layer: {worst:.2e}")


@pytest.mark.vllm
def test_a_killed_generation_keeps_its_answers_and_their_states(one_pass_run):
    """Killed mid-generation, the rerun asked only for the rest, and every answer has its
    states exactly once (a file staged before its record was written is dropped, and its
    question asked again)."""
    work, _, _ = one_pass_run
    killed_after = json.loads((work / "killed_after.json").read_text())
    summary = json.loads((work / "generation/summary.json").read_text())
    assert 3 <= killed_after < QUESTIONS and summary["asked_this_run"] == QUESTIONS - killed_after
    records = (work / "generation/records.jsonl").read_text().splitlines()
    assert len(records) == QUESTIONS + MULTI_TURN == summary["turns_answered"]  # a line per turn, none asked twice
    assert len(list((work / "generation" / CAPTURES).iterdir())) == QUESTIONS


@pytest.mark.vllm
def test_a_finished_shard_is_rerun_without_asking_or_capturing_again(one_pass_run, demo_target, capfd):
    work, _, _ = one_pass_run
    before = sorted(p.stat().st_ino for p in (work / "generation" / CAPTURES).iterdir())
    settings = RunConfig.from_dict(one_pass_settings(demo_target))
    generate.run(settings, work / "q.jsonl", work / "generation", work / "again.jsonl", None)
    assert "starting vLLM" not in capfd.readouterr().err
    assert sorted(p.stat().st_ino for p in (work / "generation" / CAPTURES).iterdir()) == before
    assert not (work / "generation/vllm").exists()
    assert (work / "again.jsonl").read_text() == (work / "completions.jsonl").read_text()


# --- the pieces, without a server ------------------------------------------------------------


def write_states(path: Path, token_ids: list[int], layers: int = 2, hidden: int = 4) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    states = torch.randn(len(token_ids), layers, hidden, dtype=torch.bfloat16)
    save_file({"hidden_states": states, "token_ids": torch.tensor(token_ids)}, path)
    return path


def gate(path: Path, token_ids) -> None:
    if load_file(path)["token_ids"].tolist() != list(token_ids):
        raise BadSample(f"{path}: token ids differ")


def test_the_spool_keeps_good_files_within_the_share_and_resumes(tmp_path):
    spool = CaptureSpool(tmp_path / "gen", share=None, check=gate)
    vllm = tmp_path / "gen" / "vllm"
    first = write_states(vllm / "a.safetensors", [1, 2, 3])
    size = first.stat().st_size
    assert asyncio.run(spool.keep("q-a", str(first), [1, 2, 3]))
    bad = write_states(vllm / "b.safetensors", [1, 2, 3])
    assert not asyncio.run(spool.keep("q-b", str(bad), [1, 2, 4]))  # ids differ: deleted
    assert not bad.exists() and not captured_state_file(tmp_path / "gen", "q-b").exists()
    assert not asyncio.run(spool.keep("q-c", None, [1]))
    assert spool.kept == 1 and spool.bytes == size and sum(spool.skipped.values()) == 2

    # A budget's share holds whole files only.
    small = CaptureSpool(tmp_path / "small", share=size + size // 2, check=gate)
    for question in ("q-1", "q-2"):
        path = write_states(tmp_path / "small" / "vllm" / f"{question}.safetensors", [1, 2, 3])
        asyncio.run(small.keep(question, str(path), [1, 2, 3]))
    assert small.kept == 1 and not any((tmp_path / "small" / "vllm").iterdir())

    # Answers finish together: while one is being gated, the others count its bytes.
    together = CaptureSpool(tmp_path / "together", share=size + size // 2, check=gate)
    paths = [write_states(tmp_path / "together" / "vllm" / f"{n}.safetensors", [1, 2, 3]) for n in range(4)]

    async def finish_together():
        return await asyncio.gather(*(together.keep(f"q-{n}", str(p), [1, 2, 3]) for n, p in enumerate(paths)))

    assert sorted(asyncio.run(finish_together())) == [False, False, False, True]
    assert together.bytes == size and len(list((tmp_path / "together" / CAPTURES).iterdir())) == 1

    # Resume: a file whose answer was never recorded goes; a shrunken share drops the rest.
    orphan = write_states(captured_state_file(tmp_path / "gen", "q-x"), [5])
    resumed = CaptureSpool(tmp_path / "gen", share=None, check=gate)
    resumed.resume({"q-a": {}})
    assert not orphan.exists() and resumed.kept == 1 and resumed.bytes == size
    CaptureSpool(tmp_path / "gen", share=size - 1, check=gate).resume({"q-a": {}})
    assert not captured_state_file(tmp_path / "gen", "q-a").exists()


def test_rows_adopt_matching_captures_and_name_why_the_others_need_a_prefill(tmp_path):
    generation = tmp_path / "generation"
    write_states(captured_state_file(generation, "same"), [1, 2, 3])
    write_states(captured_state_file(generation, "longer"), [1, 2, 3, 4, 5])
    write_states(captured_state_file(generation, "other"), [1, 9, 3])
    rows = {0: [1, 2, 3], 1: [1, 2, 3], 2: [1, 2, 3], 3: [7]}
    staging = tmp_path / "staging"
    staging.mkdir()
    outcomes = adopt_captures(staging, rows, ["same", "longer", "other", "missing"], [tmp_path / "none", generation])
    assert outcomes == {0: ADOPTED, 1: CUT, 2: IDS_DIFFER, 3: NOT_CAPTURED}
    assert hidden_state_file(staging, 0).samefile(captured_state_file(generation, "same"))
    cut = load_file(hidden_state_file(staging, 1))
    whole = load_file(captured_state_file(generation, "longer"))
    assert cut["token_ids"].tolist() == [1, 2, 3] and torch.equal(cut["hidden_states"], whole["hidden_states"][:3])
    assert not hidden_state_file(staging, 2).exists() and not hidden_state_file(staging, 3).exists()
    assert adopt_captures(staging, {0: [1, 2, 3]}, ["same"], [generation]) == {}  # staged already
