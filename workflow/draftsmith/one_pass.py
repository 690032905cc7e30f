"""One pass (``hidden_states.capture: during_generation``): the generation server saves the
hidden states of the answers it writes, so no second load and prefill of every row.

The generation server runs in extraction mode (vLLM's ``extract_hidden_states`` method and
our connector). Each chat request carries ``kv_transfer_params.include_output_tokens``, and
when it finishes the connector writes the states of every token the model was fed: the
prompt and the answer except its final token, which is sampled and never fed back, so its
state does not exist. In this mode a training row therefore ends one token earlier (the
dataset stage drops the final answer token): the row loses only the prediction of what
would follow the answer (after its end-of-turn token, or past the max_tokens cut).

Two sides:
- generation (``CaptureSpool``): each answer's file is gated (ids, shape, finite, no dead
  layer) and moved to ``<generation staging>/captures/`` before the answer's record is
  appended; a disk budget's share is never exceeded; files of unrecorded answers (a crash
  between the two) are deleted on resume.
- extraction (``adopt_captures``): each stored row takes its question's captured file when
  the ids agree (hard link; a row cut at ``dataset.seq_length`` gets the leading part). Any
  other row is requested by prefill as in a separate extraction, counted by reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.atomic import atomic_write_text
from draftsmith.layout import CAPTURES, hidden_state_file
from draftsmith.progress import log
from draftsmith.shard_gate import BadSample

# Reasons a stored row is requested by prefill instead (the manifest's counts).
NOT_CAPTURED = "not captured during generation"
IDS_DIFFER = "captured token ids differ from the row"
ADOPTED = "adopted"
CUT = "adopted, cut to dataset.seq_length"
LOCK_POLL_S = 0.01
OUTCOMES = "one_pass_rows.json"  # in the extraction staging


def captured_state_file(generation_staging: Path, question_id: str) -> Path:
    """Where a question's captured states are staged (ids may hold any character)."""
    digest = hashlib.sha256(question_id.encode()).hexdigest()[:32]
    return generation_staging / CAPTURES / f"{digest}.safetensors"


def discard_states(path: str | Path) -> None:
    """A connector file and its lock file, if present."""
    for leftover in (Path(path), Path(f"{path}.lock")):
        leftover.unlink(missing_ok=True)


class CaptureSpool:
    """A generation shard's captured states: gated, within the budget's share, resumable."""

    def __init__(self, staging: Path, share: int | None, check: Callable[[Path, Sequence[int]], None]):
        self.staging = staging
        self.share = share  # bytes this shard may keep; None: no limit
        self._check = check  # shard_gate's check of one file against its token ids
        (staging / CAPTURES).mkdir(parents=True, exist_ok=True)
        self.bytes = 0
        self.kept = 0
        self.skipped: Counter[str] = Counter()

    def resume(self, answered: Mapping[str, object]) -> None:
        """Drop files of questions without a record (they will be asked again), and the
        files past a budget that shrank; count what is kept."""
        by_file = {captured_state_file(self.staging, question).name: question for question in answered}
        files = sorted((self.staging / CAPTURES).glob("*.safetensors"))
        orphans = [path for path in files if path.name not in by_file]
        for path in orphans:
            path.unlink()
        kept = sorted((p for p in files if p.name in by_file), key=lambda p: by_file[p.name])
        over = 0
        for path in kept:
            size = path.stat().st_size
            if self.share is not None and self.bytes + size > self.share:
                path.unlink()
                over += 1
                continue
            self.bytes += size
            self.kept += 1
        if orphans or over:
            log(f"one pass: deleted {len(orphans)} states of unrecorded answers, {over} past the budget's share")
        log(f"one pass: {self.kept} answers' states staged ({self.bytes / 1e6:.1f} MB)")

    async def keep(self, question_id: str, vllm_path: str | None, token_ids: Sequence[int]) -> bool:
        """Stage the states of ``question_id``'s answer from the connector's file; False
        (file deleted, reason counted) when it is missing, bad, or past the budget."""
        if vllm_path is None:
            self.skipped["no file from the server"] += 1
            return False
        reserved = 0
        try:
            if os.path.exists(vllm_path + ".lock"):
                from speculators.data_generation.vllm_client import wait_for_lock_async

                await wait_for_lock_async(vllm_path + ".lock", timeout=600, poll_interval=LOCK_POLL_S)
            size = os.path.getsize(vllm_path)
            if self.share is not None and self.bytes + size > self.share:
                self.skipped["past the disk budget's share"] += 1
                return False
            # Reserved before the gate awaits: answers finish concurrently, and each must
            # see the bytes of the others still being gated, or together they pass the share.
            reserved = size
            self.bytes += reserved
            await asyncio.to_thread(self._check, Path(vllm_path), token_ids)
            os.replace(vllm_path, captured_state_file(self.staging, question_id))
        except (BadSample, OSError, TimeoutError) as error:
            self.bytes -= reserved
            self.skipped[type(error).__name__] += 1
            log(f"one pass: states of {question_id} not kept ({error}); a prefill will request them")
            return False
        finally:
            discard_states(vllm_path)  # what is left: the file when it was not kept, its lock file
        self.kept += 1
        return True


def captured(generation_stagings: Sequence[Path], question_id: str) -> Path | None:
    for staging in generation_stagings:
        path = captured_state_file(staging, question_id)
        if path.is_file():
            return path
    return None


def captured_token_ids(path: Path) -> list[int]:
    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor("token_ids").tolist()


def adopt_captures(
    staging: Path,
    rows: Mapping[int, list[int]],
    question_of_row: Sequence[str],
    generation_stagings: Sequence[Path],
) -> dict[int, str]:
    """Give each stored row without a staged file its question's captured states; return
    row -> outcome (``ADOPTED``/``CUT``, or the reason it must be requested by prefill)."""
    outcomes: dict[int, str] = {}
    for row, token_ids in rows.items():
        if hidden_state_file(staging, row).exists():
            continue
        source = captured(generation_stagings, question_of_row[row])
        if source is None:
            outcomes[row] = NOT_CAPTURED
            continue
        ids = captured_token_ids(source)
        if ids[: len(token_ids)] != list(token_ids):
            outcomes[row] = IDS_DIFFER
        elif len(ids) == len(token_ids):
            os.link(source, hidden_state_file(staging, row))  # no bytes copied
            outcomes[row] = ADOPTED
        else:  # prepare-data cut the row at seq_length: the states of its leading tokens
            with safe_open(str(source), framework="pt") as handle:
                tensors = {key: handle.get_tensor(key)[: len(token_ids)].contiguous() for key in handle.keys()}
            save_file(tensors, hidden_state_file(staging, row))
            outcomes[row] = CUT
    counts = Counter(outcomes.values())
    if outcomes:
        log("one pass: " + ", ".join(f"{n} rows {outcome}" for outcome, n in sorted(counts.items())))
    return outcomes


class CaptureOutcomes:
    """Row -> how it got its states, kept in the extraction staging across restarts (a
    resumed shard adopts nothing again but still reports every row)."""

    def __init__(self, staging: Path):
        self.path = staging / OUTCOMES
        self.rows: dict[int, str] = (
            {int(row): outcome for row, outcome in json.loads(self.path.read_text()).items()}
            if self.path.is_file()
            else {}
        )

    def update(self, outcomes: Mapping[int, str]) -> None:
        self.rows.update(outcomes)
        atomic_write_text(self.path, json.dumps({str(row): outcome for row, outcome in sorted(self.rows.items())}))

    def counts(self) -> dict[str, int]:
        """Per outcome, over this shard's rows: adopted, or requested by prefill and why."""
        return {
            outcome if outcome in (ADOPTED, CUT) else f"requested by prefill: {outcome}": n
            for outcome, n in sorted(Counter(self.rows.values()).items())
        }
