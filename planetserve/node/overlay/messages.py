"""The end-to-end messages of the anonymous overlay, carried inside S-IDA cloves: a prompt from a user
to a model node, and the parts of the node's answer.

Every message is padded to one of a few sizes before it is split, so cloves tell relays nothing but a
size bucket: a committee's challenge prompt and a user's prompt of similar length look the same.
Decoding is strict (field types and sizes), because a model node decodes what anyone can send it.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from planetserve.node.overlay import sida
from planetserve.registry.codec import CodecError, Limits, unpack_bounded

BUCKETS = (1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, sida.DEFAULT_MAX_MESSAGE)
MAX_MESSAGE = BUCKETS[-1]
MAX_PROXIES = 16
ENDPOINTS = ("chat", "completions")
_LENGTH = struct.Struct(">I")
KEY_SIZE = 32
ID_SIZE = 16
MESSAGE_LIMITS = Limits(max_objects=128, max_depth=3, max_len=MAX_PROXIES, max_str=512, max_bin=MAX_MESSAGE)
"""A prompt is [kind, id, node, endpoint, body, [[proxy, reply id, reply key] × ≤16], k, sent] (74 values,
depth 3), a part seven scalars: anything past these limits is refused before it is built."""
SENT_STEP = 10
"""A prompt's `sent` is its user's clock rounded down to this many seconds: enough for a node to refuse a
prompt replayed after its window, too coarse to tell users apart by their clocks' offsets."""
MAX_SENT = 2**40


class MessageError(Exception):
    """A recovered message that is not a well-formed prompt or reply part."""


def bucket(size: int) -> int:
    """The padded size of a message body of `size` bytes."""
    for limit in BUCKETS:
        if size + _LENGTH.size <= limit:
            return limit
    raise MessageError(f"message of {size} bytes exceeds the {MAX_MESSAGE - _LENGTH.size}-byte limit")


def pad(body: bytes) -> bytes:
    return _LENGTH.pack(len(body)) + body + bytes(bucket(len(body)) - len(body) - _LENGTH.size)


def unpad(data: bytes) -> bytes:
    if len(data) not in BUCKETS:
        raise MessageError(f"message of {len(data)} bytes is not of a padded size")
    (length,) = _LENGTH.unpack_from(data)
    if length > len(data) - _LENGTH.size:
        raise MessageError("message length exceeds its padding")
    return data[_LENGTH.size:_LENGTH.size + length]


def _bytes(value: Any, size: int, name: str) -> bytes:
    if type(value) is not bytes or len(value) != size:
        raise MessageError(f"{name} must be {size} bytes")
    return value


@dataclass(frozen=True)
class Prompt:
    """An API request for one model node. Nothing names the user: answers go to its proxies."""

    request_id: bytes
    node: bytes
    endpoint: str
    body: bytes
    """The OpenAI-compatible request body, as the user's program sent it."""
    reply_to: tuple[tuple[bytes, bytes, bytes], ...]
    """(proxy key, reply id, reply key) per path; the answer's clove i goes to entry i, sealed under
    its reply key."""
    k: int
    """How many of the answer's cloves recover each part: the user's own threshold, so the answer is
    split as the prompt was (1 <= k <= len(reply_to))."""
    sent: int
    """When the user sent it (Unix seconds, a multiple of `SENT_STEP`): a node answers a prompt once,
    and only within a window of this time (`gateway.py`)."""

    def seal(self) -> bytes:
        return pad(msgpack.packb(["prompt", self.request_id, self.node, self.endpoint, self.body,
                                  [list(r) for r in self.reply_to], self.k, self.sent], use_bin_type=True))


@dataclass(frozen=True)
class Part:
    """One part of an answer, in order: the HTTP status and content type, and bytes of the body."""

    request_id: bytes
    seq: int
    status: int
    content_type: str
    data: bytes
    last: bool

    def seal(self) -> bytes:
        return pad(msgpack.packb(["part", self.request_id, self.seq, self.status, self.content_type,
                                  self.data, self.last], use_bin_type=True))


def open_message(data: bytes) -> Prompt | Part:
    """The message in a recovered clove set, checked field by field."""
    try:
        fields = unpack_bounded(unpad(data), MESSAGE_LIMITS)
    except CodecError as exc:
        raise MessageError(f"undecodable message: {exc}") from exc
    if not isinstance(fields, list) or not fields:
        raise MessageError("message is not a list")
    kind = fields[0]
    if kind == "prompt" and len(fields) == 8:
        return _prompt(fields)
    if kind == "part" and len(fields) == 7:
        return _part(fields)
    raise MessageError(f"unknown message kind {kind!r} with {len(fields)} fields")


def _prompt(fields: list) -> Prompt:
    _, request_id, node, endpoint, body, reply_to, k, sent = fields
    if endpoint not in ENDPOINTS:
        raise MessageError(f"unknown endpoint {endpoint!r}")
    if type(body) is not bytes:
        raise MessageError("prompt body must be bytes")
    if not isinstance(reply_to, list) or not 1 <= len(reply_to) <= MAX_PROXIES:
        raise MessageError(f"a prompt names 1..{MAX_PROXIES} proxies")
    proxies = []
    for entry in reply_to:
        if not isinstance(entry, list) or len(entry) != 3:
            raise MessageError("a proxy entry is [key, reply id, reply key]")
        proxies.append((_bytes(entry[0], KEY_SIZE, "proxy key"), _bytes(entry[1], ID_SIZE, "reply id"),
                        _bytes(entry[2], KEY_SIZE, "reply key")))
    if type(k) is not int or not 1 <= k <= len(proxies):
        raise MessageError(f"a prompt's answer threshold must lie in 1..{len(proxies)} (its proxies)")
    if type(sent) is not int or not 0 <= sent < MAX_SENT:
        raise MessageError("a prompt's sent time must be Unix seconds")
    return Prompt(_bytes(request_id, ID_SIZE, "request id"), _bytes(node, KEY_SIZE, "node key"), endpoint,
                  body, tuple(proxies), k, sent)


def _part(fields: list) -> Part:
    _, request_id, seq, status, content_type, data, last = fields
    if type(seq) is not int or seq < 0 or type(status) is not int or not 100 <= status <= 599:
        raise MessageError("part sequence or status is malformed")
    if not isinstance(content_type, str) or len(content_type) > 128:
        raise MessageError("part content type is malformed")
    if type(data) is not bytes or type(last) is not bool:
        raise MessageError("part data or end flag is malformed")
    return Part(_bytes(request_id, ID_SIZE, "request id"), seq, status, content_type, data, last)


def sent_now(clock: Callable[[], float] = time.time) -> int:
    """A prompt's `sent` for now: the clock rounded down to `SENT_STEP` seconds."""
    return int(clock()) // SENT_STEP * SENT_STEP
