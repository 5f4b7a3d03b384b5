"""A stand-in for a user relay's OpenAI endpoint, for tests of what a verifier does with the answers a
model node gives: a real HTTP server on a free port whose answers the test sets, streamed as the
OpenAI API streams them when the request asks for it."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web


class FakeRelayAnswers:
    """A real HTTP server on a free port whose answer to /v1/completions and /v1/chat/completions the test
    sets; it records each request's path and body."""

    def __init__(self) -> None:
        self.status, self.body, self.delay = 200, {}, 0.0
        self.headers: dict[str, str] = {}
        """Set on every answer: a relay says whose words an answer is (`challenge.ANSWERED_BY`)."""
        """`body`: a dict answered as JSON (or streamed as events), or bytes answered as they are."""
        self.first: list[tuple[int, dict]] = []
        """(status, body) answered before the standing ones, in order."""
        self.received: list[dict] = []
        self.port = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10), "the relay stand-in did not start"

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def completions(request: web.Request) -> web.Response:
            asked = await request.json()
            self.received.append({"path": request.path, **asked})
            await asyncio.sleep(self.delay)
            status, body = self.first.pop(0) if self.first else (self.status, self.body)
            if isinstance(body, bytes):  # as it is, JSON or not
                kind = "text/event-stream" if status == 200 and asked.get("stream") else "application/json"
                return web.Response(body=body, status=status, content_type=kind, headers=self.headers)
            if status == 200 and asked.get("stream"):
                return web.Response(text=streamed(body), content_type="text/event-stream", headers=self.headers)
            return web.json_response(body, status=status, headers=self.headers)

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/v1/chat/completions", completions)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        self.port = runner.addresses[0][1]
        started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())
        self.loop.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def streamed(body: dict) -> str:
    """`body` as server-sent events: each choice's text in two chunks (as deltas for a chat), and the
    `planetserve` extension on the last chunk."""
    chunks = []
    for choice in body.get("choices", []):
        text = choice["message"]["content"] if "message" in choice else choice.get("text", "")
        for part in (text[: len(text) // 2], text[len(text) // 2:]) if isinstance(text, str) else (text,):
            chunks.append({"choices": [{"delta": {"content": part}} if "message" in choice else {"text": part}]})
    chunks.append({"choices": [], **({"planetserve": body["planetserve"]} if "planetserve" in body else {})})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


@pytest.fixture
def relay() -> Iterator[FakeRelayAnswers]:
    server = FakeRelayAnswers()
    yield server
    server.close()
