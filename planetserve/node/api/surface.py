"""The one aiohttp surface of the OpenAI-compatible API, whatever produces its answers: a model node's
engine and forwarding (`EngineServer`, and the model node's server over it) or a user relay's overlay
(`UserRelay`).

The HTTP handling is all here: the routes (/health, /v1/models, /v1/models/{id}, /v1/completions,
/v1/chat/completions, and the GET routes of JSON documents an owner adds, such as /load or
/v1/planetserve/status), the browser guard in front of them (`browserguard.py`: a Host this server
does not answer to or another site's Origin is refused with 403, a body that is not application/json
with 415), reading a body under its limit (413 past it), and writing an answer as one JSON document or
as server-sent events while they are produced (a client that goes away closes the answer). Every error,
an unknown path (404) or method (405) and the guard's refusals included, is in OpenAI's shape. What to
answer is the `Answerer`'s; an answer is a `Reply`, which the overlay carries as well as HTTP does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from planetserve.browserguard import BrowserGuard
from planetserve.node.api.openai import (
    ApiError,
    Endpoint,
    method_not_allowed,
    model_not_found,
    path_not_found,
    too_large,
)

log = logging.getLogger(__name__)

JSON = "application/json"
EVENT_STREAM = "text/event-stream"

Document = Callable[[], dict[str, Any]]
STREAMING = web.RequestKey("streaming", bool)
"""Set on a request whose streamed answer has begun: an error then can no longer become a response."""


@dataclass(frozen=True)
class Reply:
    """An API answer independent of its carrier: a status, a content type, and the body in parts (one
    JSON document, or server-sent events as they are produced)."""

    status: int
    content_type: str
    parts: AsyncIterator[bytes]
    headers: Mapping[str, str] = field(default_factory=dict)
    """Set by whoever made the reply, over HTTP only: an answer carried over the overlay takes none."""

    @classmethod
    def json(cls, body: dict[str, Any], status: int = 200, headers: Mapping[str, str] | None = None) -> Reply:
        return cls(status, JSON, single_part(json.dumps(body).encode()), headers or {})

    @property
    def streamed(self) -> bool:
        return self.content_type == EVENT_STREAM


async def single_part(body: bytes) -> AsyncIterator[bytes]:
    yield body


async def close_stream(stream: AsyncIterator[Any]) -> None:
    """End an async iterator that may not have been read to its end (its `finally` blocks run now)."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `limit`."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(f"Request body of {request.content_length} bytes exceeds the limit of {limit}.")
    body = bytearray()
    while chunk := await request.content.readany():
        body += chunk
        if len(body) > limit:
            raise too_large(f"Request body exceeds the limit of {limit} bytes.")
    return bytes(body)


async def send_reply(http: web.Request, reply: Reply) -> web.StreamResponse:
    """Write a Reply as the HTTP response; a client that goes away ends (and closes) the reply."""
    if not reply.streamed:
        body = b"".join([part async for part in reply.parts])
        return web.Response(body=body, status=reply.status, content_type=reply.content_type,
                            headers=reply.headers)
    response = web.StreamResponse(status=reply.status, headers={
        **reply.headers, "Content-Type": EVENT_STREAM, "Cache-Control": "no-cache"})
    http[STREAMING] = True
    await response.prepare(http)
    try:
        async for part in reply.parts:
            await response.write(part)
    except ConnectionResetError:
        log.debug("client went away mid-stream")
        return response
    finally:
        await close_stream(reply.parts)
    await response.write_eof()
    return response


def _json(body: dict[str, Any], status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(body=json.dumps(body).encode(), status=status, content_type=JSON, headers=headers)


def _refused(status: int, code: str, message: str) -> web.Response:
    """The browser guard's refusals in OpenAI's shape."""
    return _json(ApiError(status, message, code=code).body(), status)


def _http_error(http: web.Request, exc: web.HTTPException) -> ApiError:
    if isinstance(exc, web.HTTPNotFound):
        return path_not_found(http.path)
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return method_not_allowed(http.method, http.path, exc.allowed_methods)
    kind = "server_error" if exc.status >= 500 else "invalid_request_error"
    return ApiError(exc.status, exc.reason, type=kind)


@web.middleware
async def openai_errors(http: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """Errors that arise outside an Answerer (routing, a failure in this server) in OpenAI's shape too,
    so that clients parse one error format everywhere."""
    try:
        return await handler(http)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = _http_error(http, exc)
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _json(error.body(), error.status, allow)
    except Exception:
        if http.get(STREAMING):
            raise
        log.exception("%s %s failed", http.method, http.path)
        return _json(ApiError(500, "The server failed to answer.", type="server_error").body(), 500)


class Answerer(Protocol):
    """What produces a surface's answers."""

    def health(self) -> tuple[int, dict[str, Any] | None]:
        """/health's status, and its JSON body (None: an empty body, as vLLM answers)."""
        ...

    def models(self) -> dict[str, Any]:
        """/v1/models' body."""
        ...

    async def respond(self, endpoint: Endpoint, raw: bytes) -> Reply:
        """The answer to one request body (at most the surface's body limit); an error is a Reply too."""
        ...


class ApiServer:
    """An aiohttp app serving an `Answerer`'s answers, with `documents`: more GET routes, each answered
    with the JSON document its callable returns. `hosts`: the names it answers to besides loopback ones
    and the host it listens on (its owner's configured addresses, host:port or bare)."""

    def __init__(self, answerer: Answerer, *, max_body_bytes: int,
                 documents: Mapping[str, Document] | None = None, hosts: Iterable[str] = ()) -> None:
        self.answerer = answerer
        self.max_body_bytes = max_body_bytes
        self.guard = BrowserGuard(hosts, refuse=_refused)
        self.app = web.Application(client_max_size=max_body_bytes,
                                   middlewares=[self.guard.middleware, openai_errors])
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/v1/models/{model:.+}", self._model)
        self.app.router.add_post("/v1/completions", self._completions)
        self.app.router.add_post("/v1/chat/completions", self._chat)
        for path, document in (documents or {}).items():
            self.app.router.add_get(path, self._document(document))
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen; returns the base URL (with the port chosen when `port` is 0)."""
        self.guard.bind(host)
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        return f"http://{host}:{self._runner.addresses[0][1]}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, _: web.Request) -> web.Response:
        status, body = self.answerer.health()
        return web.Response(status=status) if body is None else _json(body, status)

    async def _models(self, _: web.Request) -> web.Response:
        return _json(self.answerer.models())

    async def _model(self, http: web.Request) -> web.Response:
        """One model object of /v1/models (ids may hold "/", sent as is or as %2F)."""
        name = http.match_info["model"]
        card = next((m for m in self.answerer.models()["data"] if m["id"] == name), None)
        if card is None:
            error = model_not_found(name)
            return _json(error.body(), error.status)
        return _json(card)

    @staticmethod
    def _document(document: Document) -> Callable[[web.Request], Any]:
        async def handle(_: web.Request) -> web.Response:
            return _json(document())

        return handle

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _serve(self, http: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        try:
            raw = await read_body(http, self.max_body_bytes)
        except ApiError as exc:
            return _json(exc.body(), exc.status)
        return await send_reply(http, await self.answerer.respond(endpoint, raw))
