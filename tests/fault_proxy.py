"""A fault-injecting proxy in front of a real vLLM server, speaking its OpenAI protocol.

A real server cannot be told to fail the 7th request or to hang on the 12th; this
proxy can. It forwards every request unchanged (with the upstream's key) and, where
its plan says so, answers instead with vLLM's own error body, holds the request past
the client's timeout, or drops the connection. Faults are keyed by the request's
messages, so "the first attempt of this question fails" is exact whatever the
concurrency, and attempts per question are counted for the tests to check.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import Counter
from collections.abc import Callable

import aiohttp
from aiohttp import web

from draftsmith.server import Endpoint

# (question key, attempt number from 1) -> "error" | "hang" | "drop" | None (forward)
FaultPlan = Callable[[str, int], str | None]
HANG_S = 600.0


def question_key(payload: dict) -> str:
    """The last user turn: what identifies a question across retries."""
    users = [m["content"] for m in payload.get("messages", []) if m.get("role") == "user"]
    return users[-1] if users else ""


def error_body(status: int, message: str) -> dict:
    """vLLM's ErrorResponse shape."""
    return {"error": {"message": message, "type": "InternalServerError", "param": None, "code": status}}


class FaultProxy:
    def __init__(self, upstream: Endpoint, api_key: str):
        self.upstream = upstream
        self.api_key = api_key
        self.plan: FaultPlan = lambda key, attempt: None
        self.attempts: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self.port = 0

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(f"http://127.0.0.1:{self.port}/v1", self.api_key, self.upstream.model)

    def reset(self, plan: FaultPlan) -> None:
        self.plan = plan
        self.attempts.clear()
        self.faults.clear()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response(error_body(401, "Unauthorized"), status=401)
        payload = await request.json()
        key = question_key(payload)
        self.attempts[key] += 1
        fault = self.plan(key, self.attempts[key])
        if fault:
            self.faults[fault] += 1
        if fault == "error":
            return web.json_response(error_body(500, "injected fault"), status=500)
        if fault == "hang":
            await asyncio.sleep(HANG_S)
        if fault == "drop":
            request.transport.abort()  # the client sees the connection reset mid-request
            return web.Response()
        async with self._session.post(
            f"{self.upstream.base_url}/chat/completions", json=payload, headers=self.upstream.headers()
        ) as upstream:
            return web.Response(body=await upstream.read(), status=upstream.status, content_type="application/json")

    async def _serve(self) -> None:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        # A hung handler is cancelled when its client gives up, as in a real server.
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)
        await self._runner.setup()
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        self.port = listener.getsockname()[1]
        await web.SockSite(self._runner, listener).start()
        self._started.set()

    def __enter__(self) -> FaultProxy:
        thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        assert self._started.wait(10), "fault proxy did not start"
        return self

    def __exit__(self, *exc) -> None:
        async def close():
            await self._runner.cleanup()
            await self._session.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
