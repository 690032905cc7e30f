"""The skeleton of a job that owns a vLLM server: generate, extract and evaluate.

Each of these jobs does the same things in the same order; only the bracketed parts are
the stage's own:

1. check the GPU slot it was granted against TP x DP (``slot``);
2. open its staging directory under the fingerprint of the settings that shape its items
   (``staging``; a measurement job keeps no work in progress and has none);
3. work out what is left [the stage's resume rule];
4. load one server for all of it [the stage's server flags], warming its client imports
   meanwhile;
5. send every item [the stage's request for one item] under one policy from its config
   section: ``concurrency`` at a time, ``request_timeout_s`` per request, ``max_retries``
   with exponential back-off for transient failures and none for deterministic ones, and a
   stop when a long run of items fails in a row (the server is gone);
6. fail when more than ``max_error_fraction`` of the items failed, naming the first errors
   and where finished work is kept; otherwise publish whole [the stage's output].
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from draftsmith.errors import DraftsmithError
from draftsmith.progress import Progress, log
from draftsmith.run_config import EvaluationSettings, ExtractionSettings, GenerationSettings, RunConfig
from draftsmith.server import Endpoint, ServerSpec, import_in_background, managed_server
from draftsmith.settings import item_settings
from draftsmith.slot import check_gpu_slot
from draftsmith.staging import open_staging

Item = TypeVar("Item", int, str)  # row indices or question ids: sortable
# One item's request; it may return extra counts for the progress line (e.g. truncated=1).
Request = Callable[[Item], Awaitable[dict[str, int] | None]]

MAX_BACKOFF_S = 30.0
SHOW_FIRST = 5
# Third-party names this module uses; the preflight checks each exists (preflight.declared).
THIRD_PARTY = [
    ("speculators.data_generation.vllm_client", "InvalidResponseError"),
    ("openai", "BadRequestError"),
    ("openai", "AuthenticationError"),
]


class StageError(DraftsmithError):
    """A server stage could not finish its work; the message says what failed and what to do."""


@dataclass(frozen=True)
class RequestPolicy:
    """How a stage sends its requests: one config section's keys."""

    concurrency: int
    timeout_s: float
    max_retries: int
    max_error_fraction: float = 0.0  # the share of items that may fail without failing the job

    def allows(self, failed: int, total: int) -> bool:
        """Whether ``failed`` of ``total`` items are within the error budget."""
        return failed <= self.max_error_fraction * total

    @classmethod
    def from_section(
        cls, section: GenerationSettings | ExtractionSettings | EvaluationSettings, concurrency: int | None = None
    ) -> RequestPolicy:
        return cls(
            concurrency=concurrency or section.concurrency,  # type: ignore[arg-type]  # evaluation's is swept
            timeout_s=section.request_timeout_s,
            max_retries=section.max_retries,
            max_error_fraction=getattr(section, "max_error_fraction", 0.0),
        )


def not_retried() -> tuple[type[Exception], ...]:
    """Deterministic failures (a bad request, a wrong key, token ids the server rejects):
    retrying cannot help. Everything else (5xx, 408, 429, timeouts, dropped connections)
    is retried. speculators is imported here, not at module load (it takes seconds).

    One policy for all three stages is why this is ours: speculators' ``with_retries``
    covers its own client only, and has no error budget or dead-server stop."""
    import openai
    from speculators.data_generation.vllm_client import InvalidResponseError

    return (openai.BadRequestError, openai.AuthenticationError, InvalidResponseError)


def first_errors(failures: Mapping[Item, str], name: Callable[[Item], str] = str) -> str:
    """The first failures in item order, each as its name and reason, and how many more."""
    shown = [f"{name(item)}: {failures[item]}" for item in sorted(failures)[:SHOW_FIRST]]
    more = len(failures) - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more else "")


@dataclass
class ServerStage(Generic[Item]):
    """One job of a server-backed stage. ``rule`` names its settings (settings.item_settings);
    ``noun`` is what its items are called in messages ("questions", "rows", "requests")."""

    rule: str
    settings: RunConfig
    policy: RequestPolicy
    noun: str
    name: Callable[[Item], str] = str  # an item as messages name it
    error: type[StageError] = StageError  # the stage's own error class
    # Attempts sent again. A request that timed out here may have run on the server all the
    # same: a check against the server's own counters must allow for it (evaluate).
    retried: int = field(default=0, init=False)
    # What each staged item depends on (settings.item_settings), worked out once by ``begin``.
    items: dict[str, Any] = field(default_factory=dict, init=False)

    def begin(self, granted_gpus: int | None, staging: Path | None = None) -> None:
        """Steps 1 and 2: refuse a slot too small for the server; open the staging."""
        check_gpu_slot(self.settings, granted_gpus)
        if staging is not None:
            self.items = item_settings(self.settings.source, self.rule)
            open_staging(staging, self.items)

    @contextmanager
    def server(self, spec: ServerSpec, *imports: str, external: Endpoint | None = None) -> Iterator[Endpoint]:
        """Step 4: one server for the job's whole work; ``imports`` load while it does."""
        import_in_background(*imports)
        with managed_server(spec, external=external) as endpoint:
            yield endpoint

    async def request_all(
        self,
        items: Sequence[Item],
        request: Request[Item],
        progress: Progress,
        *,
        concurrency: int | None = None,
        admitted: int | None = None,
    ) -> dict[Item, str]:
        """Step 5: every item through ``request``; returns item -> last error of those that
        failed. At most ``concurrency`` (the policy's by default) are in progress at once,
        or ``admitted`` for a stage whose item outlives its request (extraction waits for
        the file after the response) and that bounds the request itself."""
        in_progress = asyncio.Semaphore(admitted or concurrency or self.policy.concurrency)
        give_up_after = max(2 * (concurrency or self.policy.concurrency), 8)
        failures: dict[Item, str] = {}
        consecutive = 0

        async def one(item: Item) -> None:
            nonlocal consecutive
            async with in_progress:
                counts, reason = await self._with_retries(item, request)
            if reason is None:
                consecutive = 0
                progress.advance(ok=1, **(counts or {}))
                return
            failures[item] = reason
            consecutive += 1
            progress.advance(failed=1)
            if consecutive >= give_up_after:
                raise self.error(
                    f"{consecutive} {self.noun} in a row failed (last: {self.name(item)}: {reason}); "
                    "the server is likely down or misconfigured, see its log"
                )

        try:
            async with asyncio.TaskGroup() as group:
                for item in items:
                    group.create_task(one(item))
        except* (StageError, OSError) as group_error:  # OSError: a full disk (_with_retries)
            raise group_error.exceptions[0] from None
        return failures

    async def _with_retries(self, item: Item, request: Request[Item]) -> tuple[dict[str, int] | None, str | None]:
        attempts, number = self.policy.max_retries + 1, 0
        while True:
            number += 1
            try:
                return await request(item), None
            except Exception as error:  # noqa: BLE001 - request, network, file: each is counted
                if isinstance(error, OSError) and error.errno == errno.ENOSPC:
                    raise  # this machine's full disk, not the request's fault: the stage stops
                reason = f"{type(error).__name__}: {error}"[:300]
                if number >= attempts or isinstance(error, not_retried()):
                    return None, reason
                log(f"{self.name(item)}: attempt {number}/{attempts} failed ({reason}); retrying")
                self.retried += 1
                await asyncio.sleep(min(2.0**number, MAX_BACKOFF_S))

    def check_failures(self, failures: Mapping[Item, str], total: int, kept: str) -> None:
        """Step 6: fail when more of the ``total`` items failed than the policy allows.
        ``failures`` is item -> reason (``request_all``'s result, or the stage's own count);
        ``kept`` says where finished work is kept."""
        if self.policy.allows(len(failures), total):
            return
        fraction = self.policy.max_error_fraction
        budget = f" (more than max_error_fraction={fraction})" if fraction else ""
        first = first_errors(failures, self.name)
        raise self.error(f"{len(failures)} of {total} {self.noun} failed{budget}: {first}. {kept}")
