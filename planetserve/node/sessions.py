"""A user relay's conversations: which model node and session id each one's requests go to.

A node keeps a conversation's KV cache under its session id, so every request of one conversation
goes to the same node under the same id; and the id is the relay's own, random, so it says nothing of
who sent the request. What makes two requests one conversation is what the node can also see, and it
must not link conversations a program keeps apart: a follow-up continues the conversation whose answer
this relay delivered (the messages before its last user turn are that conversation, answer included),
and a first turn starts a session of its own. Keyed by the opening messages instead, every
conversation a program opened alike (a canned greeting, an agent's first turn) shared one id, and the
node linked them to one user."""

from __future__ import annotations

import hashlib
import json
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from planetserve.node.api.openai import ApiRequest, ChatMessage
from planetserve.node.api.surface import close_stream
from planetserve.node.engine.wire import SSEDecoder, SSEError

MAX_SESSIONS = 10_000


def new_session_id() -> str:
    return secrets.token_hex(16)


def conversation_key(model: str | None, messages: Sequence[ChatMessage]) -> str:
    """A chat conversation as it stands after `messages`."""
    pairs = [[m.role, m.content] for m in messages]
    return "chat:" + hashlib.sha256(json.dumps([model, pairs]).encode()).hexdigest()


def session_key(request: ApiRequest) -> str | None:
    """The conversation a request continues: the program's own session id, or for a chat follow-up the
    conversation before its last user turn (recorded when this relay delivered its answer); None for a
    first turn or a completion, which start sessions of their own."""
    if request.planetserve.session_id:
        return "id:" + request.planetserve.session_id
    if request.endpoint != "chat":
        return None
    users = [i for i, m in enumerate(request.messages) if m.role == "user"]
    if not users or not any(m.role == "assistant" for m in request.messages[:users[-1]]):
        return None
    return conversation_key(request.model, request.messages[:users[-1]])


class Sessions:
    """Conversation key → (node, session id), the least recently used forgotten past MAX_SESSIONS."""

    def __init__(self, limit: int = MAX_SESSIONS) -> None:
        self.limit = limit
        self._known: OrderedDict[str, tuple[bytes, str]] = OrderedDict()

    def get(self, key: str | None) -> tuple[bytes, str] | None:
        known = self._known.get(key) if key is not None else None
        if known is not None:
            self._known.move_to_end(key)  # type: ignore[arg-type]
        return known

    def keep(self, key: str | None, node: bytes, session: str) -> None:
        if key is None:
            return
        self._known[key] = (node, session)
        self._known.move_to_end(key)
        while len(self._known) > self.limit:
            self._known.popitem(last=False)

    def __len__(self) -> int:
        return len(self._known)


class DeliveredText:
    """The assistant's text of a chat answer as it passes to the program: a JSON body's first message,
    or a stream's first choice's deltas. None when the answer does not read as one (an error, a stream
    cut off): the conversation then has no continuation, and its next turn starts a session."""

    def __init__(self, streamed: bool) -> None:
        self.streamed = streamed
        self._decoder = SSEDecoder()
        self._body = bytearray()
        self._pieces: list[str] = []
        self._broken = False

    def feed(self, data: bytes) -> None:
        if self._broken:
            return
        if not self.streamed:
            self._body += data
            return
        try:
            for event in self._decoder.feed(data):
                if event != "[DONE]":
                    self._pieces.append(_content(json.loads(event), "delta"))
        except (SSEError, ValueError, LookupError, TypeError):
            self._broken = True

    def text(self) -> str | None:
        if self._broken:
            return None
        if self.streamed:
            return None if self._decoder.pending else "".join(self._pieces)
        try:
            return _content(json.loads(self._body), "message")
        except (ValueError, LookupError, TypeError):
            return None


def _content(document: Any, field: str) -> str:
    """The text of `document`'s first choice's `field` (LookupError or TypeError if it has none)."""
    content = document["choices"][0][field].get("content") or ""
    if not isinstance(content, str):
        raise TypeError("content is not text")
    return content


async def remembered(parts: AsyncIterator[bytes], streamed: bool,
                     delivered: Callable[[str], None]) -> AsyncIterator[bytes]:
    """`parts` as they are, calling `delivered(text)` once the whole answer has passed."""
    text = DeliveredText(streamed)
    try:
        async for data in parts:
            text.feed(data)
            yield data
    finally:
        await close_stream(parts)
    if (done := text.text()) is not None:
        delivered(done)
