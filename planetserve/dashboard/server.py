"""The dashboard's HTTP server (aiohttp): the page and its JSON API.

    GET  /                 the page (static/index.html; app.js and style.css under /static/)
    GET  /api/state        one snapshot of the system (`collect.Collector`), at most MIN_INTERVAL old;
                           concurrent requests share one collection
    POST /api/chat         {"prompt": str, "max_tokens"?: int, "model"?: str}: sent through the user
                           relay's OpenAI-compatible /v1/chat/completions; answers
                           {"answer", "node", "node_name", "served_by", "signature_valid", "model",
                           "seconds", "attempts"} or {"error": {"message", "code"}} with a 4xx/5xx status
    GET  /api/health       {"ok": true}

Every route is behind the browser guard (`browserguard.py`): a Host the dashboard does not answer
to (a page re-pointing its DNS name here), another site's Origin or `Sec-Fetch-Site: cross-site` get 403,
and a POST that is not application/json gets 415, all as {"error": {"message", "code"}}, so no other
page in the user's browser can send a prompt or read the state.

Everything the page needs is served from the package (no external assets; a Content-Security-Policy
of 'self' enforces it in the browser).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from importlib import resources
from typing import Any

import httpx
from aiohttp import web

from planetserve.browserguard import BrowserGuard
from planetserve.chain.challenge import ResponseFormatError, response_from_extension, response_valid
from planetserve.dashboard import HEALTH_PATH
from planetserve.dashboard.collect import Collector, Settings, error_text
from planetserve.registry import codec

log = logging.getLogger(__name__)

MIN_INTERVAL = 1.0
"""Seconds a snapshot is reused (the page polls every 2 s; several pages share snapshots)."""
MAX_CHAT_BODY = 64 << 10
MAX_PROMPT_CHARS = 4000
DEFAULT_MAX_TOKENS = 64
MAX_TOKENS = 256
MAX_ANSWER_BYTES = 1 << 20
"""The most a relay's answer (or /v1/models) may hold."""
MAX_ANSWER_VALUES = 1 << 16
"""JSON values a chat answer may build: its text is one string, and the chat asks for no log-probabilities."""
MAX_REQUEST_VALUES = 1 << 10
"""JSON values a chat request may build: a prompt and a few options."""
CHAT_TIMEOUT = 90.0
CHAT_ATTEMPTS = 3
"""A relay's 502 and 503 (a path that just broke, a node its proxies cannot reach yet) are retried."""
RETRY_PAUSE = 2.0
MAX_CONCURRENT_CHATS = 4
STATIC = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                               "script-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'self'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


class ChatError(Exception):
    def __init__(self, status: int, message: str, code: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra

    def response(self) -> web.Response:
        return _json({"error": {"message": self.message, "code": self.code, **self.extra}}, self.status)


def _refused(status: int, code: str, message: str) -> web.Response:
    """The browser guard's refusals, shaped as the chat's errors."""
    return ChatError(status, message, code).response()


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, content_type="application/json",
                        headers=SECURITY_HEADERS)


def static_file(name: str) -> bytes:
    return resources.files("planetserve.dashboard").joinpath("static", name).read_bytes()


class Dashboard:
    def __init__(self, settings: Settings, *, chat_timeout: float = CHAT_TIMEOUT) -> None:
        self.settings = settings
        self.collector = Collector(settings)
        self.chat_timeout = chat_timeout
        self.files = {name: static_file(name) for name in STATIC}
        self._snapshot: dict[str, Any] | None = None
        self._taken = 0.0
        self._collecting = asyncio.Lock()
        self._chats = asyncio.Semaphore(MAX_CONCURRENT_CHATS)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(chat_timeout, connect=5.0), trust_env=False)
        self.counters = {"chats": 0, "answered": 0, "failed": 0}
        self.guard = BrowserGuard(refuse=_refused)
        self.app = web.Application(client_max_size=MAX_CHAT_BODY, middlewares=[self.guard.middleware])
        self.app.router.add_get("/", self._index)
        self.app.router.add_get("/static/{name}", self._static)
        self.app.router.add_get("/api/state", self._state)
        self.app.router.add_post("/api/chat", self._chat)
        self.app.router.add_get(HEALTH_PATH, self._health)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> None:
        self.guard.bind(host)
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self._http.aclose()
        self.collector.close()

    # -- pages -------------------------------------------------------------------------------------

    async def _index(self, _: web.Request) -> web.Response:
        return web.Response(body=self.files["index.html"], content_type="text/html", charset="utf-8",
                            headers=SECURITY_HEADERS)

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC or name == "index.html":
            raise web.HTTPNotFound(text=f"no file {name[:80]!r}")
        return web.Response(body=self.files[name], content_type=STATIC[name], charset="utf-8",
                            headers=SECURITY_HEADERS)

    async def _health(self, _: web.Request) -> web.Response:
        return _json({"ok": True})

    # -- state -------------------------------------------------------------------------------------

    async def state(self) -> dict[str, Any]:
        async with self._collecting:
            if self._snapshot is None or time.monotonic() - self._taken >= MIN_INTERVAL:
                try:
                    snapshot = await asyncio.to_thread(self.collector.collect)
                except Exception as exc:  # a bug in collecting: say so rather than answer nothing
                    log.exception("collecting the dashboard's state failed")
                    snapshot = {"time": round(time.time(), 3), "error": error_text(exc)}
                self._snapshot, self._taken = snapshot, time.monotonic()
            return {**self._snapshot, "chat": dict(self.counters)}

    async def _state(self, _: web.Request) -> web.Response:
        return _json(await self.state())

    # -- chat --------------------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            prompt, max_tokens, model = await self._chat_request(request)
            if self._chats.locked():
                raise ChatError(429, f"{MAX_CONCURRENT_CHATS} prompts are already on their way; wait for an "
                                     "answer", "busy")
            async with self._chats:
                self.counters["chats"] += 1
                try:
                    answer = await self.chat(prompt, max_tokens, model)
                except ChatError:
                    self.counters["failed"] += 1
                    raise
                self.counters["answered"] += 1
        except ChatError as exc:
            return exc.response()
        return _json(answer)

    async def _chat_request(self, request: web.Request) -> tuple[str, int, str | None]:
        try:
            raw = await request.read()  # refused beyond the application's client_max_size
        except web.HTTPRequestEntityTooLarge:
            raise ChatError(413, f"the request is larger than {MAX_CHAT_BODY} bytes", "too_large") from None
        try:
            body = codec.json_loads_bounded(raw, MAX_REQUEST_VALUES)
        except codec.CodecError:  # LimitExceeded too: a chat request is a few values
            raise ChatError(400, 'the request must be JSON: {"prompt": "..."}', "invalid_json") from None
        if not isinstance(body, dict):
            raise ChatError(400, 'the request must be a JSON object: {"prompt": "..."}', "invalid_json")
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ChatError(400, "the prompt is empty: type a question", "empty_prompt")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise ChatError(413, f"the prompt has {len(prompt)} characters; at most {MAX_PROMPT_CHARS} are "
                                 "accepted", "prompt_too_long")
        max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
        if type(max_tokens) is not int or not 0 < max_tokens <= MAX_TOKENS:  # bool is not an int here
            raise ChatError(400, f"max_tokens must be an integer from 1 to {MAX_TOKENS}",
                            "invalid_max_tokens")
        model = body.get("model")
        if model is not None and (not isinstance(model, str) or not 0 < len(model) <= 128):
            raise ChatError(400, "model must be a model id (a non-empty string)", "invalid_model")
        return prompt, max_tokens, model

    async def chat(self, prompt: str, max_tokens: int, model: str | None = None) -> dict[str, Any]:
        """Send `prompt` through the relay's anonymous endpoint; the answer and who signed it."""
        relay = self.settings.relay
        if relay is None:
            raise ChatError(503, "this dashboard has no user relay (start it with --relay)", "no_relay")
        model = model or self.settings.model or await self._first_model(relay)
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
        began = time.monotonic()
        deadline = began + self.chat_timeout
        attempts = 0
        while True:
            attempts += 1
            left = deadline - time.monotonic()
            try:
                status, answer = await asyncio.wait_for(
                    self._post(f"{relay}/v1/chat/completions", body), left)
            except TimeoutError:
                raise ChatError(504, f"no answer through the relay within {self.chat_timeout:g} s",
                                "timeout") from None
            if status == 200:
                break
            message, code = _relay_error(answer)
            retry = status in (502, 503) and attempts < CHAT_ATTEMPTS
            if not retry or time.monotonic() + RETRY_PAUSE > deadline:
                raise ChatError(status if 400 <= status < 600 else 502,
                                f"the relay answered {status}: {message}", code or "relay_error",
                                relay_status=status)
            await asyncio.sleep(RETRY_PAUSE)
        return self._answer(answer, model, time.monotonic() - began, attempts)

    def _answer(self, answer: Any, model: str, seconds: float, attempts: int) -> dict[str, Any]:
        try:
            text = answer["choices"][0]["message"]["content"]
            extension = answer.get("planetserve")
            if not isinstance(text, str):
                raise TypeError("the answer's content is not text")
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ChatError(502, f"the relay's answer is not a chat completion ({exc})",
                            "bad_answer") from None
        node = served_by = None
        valid = False
        try:
            signed = response_from_extension(extension, text)
            node, valid = signed.node.hex(), response_valid(signed)
        except ResponseFormatError as exc:
            log.warning("an answer without a well-formed signature: %s", exc)
        if isinstance(extension, dict) and isinstance(extension.get("served_by"), str):
            served_by = extension["served_by"][:64] or None
        labels = self.settings.labels
        return {"answer": text, "node": node, "node_name": labels.get(node) if node else None,
                "served_by": served_by, "served_by_name": labels.get(served_by) if served_by else None,
                "signature_valid": valid, "model": model, "seconds": round(seconds, 2), "attempts": attempts,
                "finish_reason": answer["choices"][0].get("finish_reason")}

    async def _first_model(self, relay: str) -> str:
        status, body = await self._get(f"{relay}/v1/models")
        try:
            if status != 200:
                raise ValueError(f"HTTP {status}")
            return str(body["data"][0]["id"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ChatError(502, f"the relay lists no model to ask ({error_text(exc)})", "no_model") from None

    async def _get(self, url: str) -> tuple[int, Any]:
        return await self._request("GET", url, None)

    async def _post(self, url: str, body: dict[str, Any]) -> tuple[int, Any]:
        return await self._request("POST", url, body)

    async def _request(self, method: str, url: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        """The relay's status and JSON answer, read up to MAX_ANSWER_BYTES."""
        try:
            async with self._http.stream(method, url, json=body) as reply:
                size, chunks = 0, []
                async for chunk in reply.aiter_bytes():
                    size += len(chunk)
                    if size > MAX_ANSWER_BYTES:
                        raise ChatError(502, f"the relay's answer is larger than {MAX_ANSWER_BYTES} bytes",
                                        "answer_too_large")
                    chunks.append(chunk)
        except httpx.TimeoutException:
            raise ChatError(504, f"no answer from the relay within {self.chat_timeout:g} s",
                            "timeout") from None
        except httpx.HTTPError as exc:
            raise ChatError(502, f"the relay at {self.settings.relay} cannot be reached: {error_text(exc)}",
                            "relay_unreachable") from None
        try:  # the model node's words: nested past the recursion limit, or built to be many objects
            return reply.status_code, codec.json_loads_bounded(b"".join(chunks), MAX_ANSWER_VALUES)
        except codec.LimitExceeded as exc:
            raise ChatError(502, f"the relay's answer holds {exc}, more than an answer needs",
                            "bad_answer") from None
        except codec.CodecError:
            raise ChatError(502, f"the relay answered {reply.status_code} with something that is not JSON",
                            "bad_answer") from None


def _relay_error(answer: Any) -> tuple[str, str | None]:
    """An OpenAI-shaped error's message and code."""
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict):
        code = error.get("code")
        return str(error.get("message", ""))[:500], str(code)[:64] if code else None
    return "(no error message)", None


async def run_dashboard(settings: Settings, host: str, port: int, on_ready: Any = None) -> None:
    """Serve until SIGINT/SIGTERM; `on_ready(dashboard)` once it listens."""
    import signal

    dashboard = Dashboard(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await dashboard.start(host, port)
        if on_ready is not None:
            on_ready(dashboard)
        await stop.wait()
    finally:
        await dashboard.close()
