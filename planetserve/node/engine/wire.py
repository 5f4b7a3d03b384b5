"""The OpenAI-compatible wire format as both ends of an HTTP engine speak it: server-sent events
(written by the API's servers, read by `RemoteEngine`), error bodies in OpenAI's and older vLLM's
shapes, and the largest token id a request may carry."""

from __future__ import annotations

import json
from typing import Any

MAX_TOKEN_ID = (1 << 31) - 1


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def error_message(body: Any) -> tuple[str, str | None, Any]:
    """(message, type, code) from an error body: OpenAI's {"error": {...}} or older vLLM's flat
    {"object": "error", "message": ...}."""
    inner = body.get("error") if isinstance(body, dict) else None
    if isinstance(inner, dict):
        body = inner
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        kind = body.get("type")
        return body["message"][:500], kind if isinstance(kind, str) else None, body.get("code")
    if isinstance(inner, str):
        return inner[:500], None, None
    return "unrecognised error body", None, None


class SSEError(ValueError):
    pass


class SSEDecoder:
    """Splits a byte stream into server-sent events' data, holding at most `max_event_bytes`."""

    def __init__(self, max_event_bytes: int = 8 << 20) -> None:
        self.max_event_bytes = max_event_bytes
        self._buffer = bytearray()
        self._data: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            end = self._buffer.find(b"\n")
            if end < 0:
                break
            line = bytes(self._buffer[:end]).rstrip(b"\r")
            del self._buffer[: end + 1]
            if not line:
                if self._data:
                    events.append(self._take())
                continue
            name, _, value = line.partition(b":")
            if name == b"data":
                value = value[1:] if value.startswith(b" ") else value
                self._size += len(value) + 1
                self._data.append(value)
            if self._size > self.max_event_bytes:
                raise SSEError(f"a server-sent event exceeds {self.max_event_bytes} bytes")
        if len(self._buffer) + self._size > self.max_event_bytes:
            raise SSEError(f"a server-sent event exceeds {self.max_event_bytes} bytes")
        return events

    @property
    def pending(self) -> bool:
        """Whether a partial event is buffered (a stream that ends here was cut off)."""
        return bool(self._buffer.strip() or self._data)

    def _take(self) -> str:
        data = b"\n".join(self._data)
        self._data.clear()
        self._size = 0
        try:
            return data.decode()
        except UnicodeDecodeError as exc:
            raise SSEError("a server-sent event is not UTF-8") from exc
