"""HTTP client pieces shared by the stages that talk to a vLLM server."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from draftsmith.server import Endpoint

# speculators is imported where it is used: the stages warm that import while their
# server loads (server.import_in_background).
SPECULATORS_CLIENT = "speculators.data_generation.vllm_client"
# Third-party names this module uses; the preflight checks each exists (preflight.declared).
THIRD_PARTY = [("speculators.data_generation.vllm_client", "InvalidResponseError")]

Poster = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
RETRYABLE_STATUSES = {408, 429}


def open_session(endpoint: Endpoint, concurrency: int, timeout_s: float) -> aiohttp.ClientSession:
    """A session that carries the server's API key on every request."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        connector=aiohttp.TCPConnector(limit=concurrency),
        headers=endpoint.headers(),
    )


def chat_poster(session: aiohttp.ClientSession, endpoint: Endpoint) -> Poster:
    """POST to /chat/completions. A transient error (5xx, 408, 429) raises RuntimeError and
    is retried by the stage (server_stage); any other 4xx raises speculators'
    InvalidResponseError, which is not."""
    from speculators.data_generation.vllm_client import InvalidResponseError

    url = f"{endpoint.base_url}/chat/completions"

    async def post(payload: dict[str, Any]) -> dict[str, Any]:
        async with session.post(url, json=payload) as response:
            if response.ok:
                return await response.json()
            body = (await response.text())[:300]
            if response.status >= 500 or response.status in RETRYABLE_STATUSES:
                raise RuntimeError(f"HTTP {response.status}: {body}")
            raise InvalidResponseError(f"HTTP {response.status}: {body}")

    return post
