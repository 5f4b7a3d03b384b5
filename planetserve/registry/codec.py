"""Canonical msgpack: the one byte encoding of everything that is signed or stored in state.

Canonical means: maps with string keys in sorted order, the shortest integer forms, no floats, and
bytes distinct from strings. Decoding re-encodes and compares, so a value has exactly one accepted
encoding and a signature cannot be replayed under a different spelling of the same message.
"""

from __future__ import annotations

from typing import Any

import msgpack

MAX_DEPTH = 8
_UNDECODABLE = (msgpack.UnpackException, ValueError, TypeError)
"""What msgpack raises for bad bytes; anything else (memory) is not the bytes' fault and propagates."""


class CodecError(ValueError):
    """Bytes that are not the canonical encoding of an allowed value."""


def _canonical(value: Any, depth: int = 0) -> Any:
    kind = type(value)
    if kind is str or kind is bytes or kind is bool or value is None:
        return value
    if kind is int:
        if not -(2**63) <= value < 2**64:
            raise CodecError("integer out of range")
        return value
    if depth >= MAX_DEPTH:
        raise CodecError("nesting too deep")
    if kind is list or kind is tuple:
        return [_canonical(item, depth + 1) for item in value]
    if kind is dict:
        if not all(type(k) is str for k in value):
            raise CodecError("map keys must be strings")
        return {k: _canonical(value[k], depth + 1) for k in sorted(value)}
    raise CodecError(f"type {kind.__name__} is not allowed (no floats)")


def pack(value: Any) -> bytes:
    """Encode canonically; raises CodecError for values outside the allowed types."""
    return msgpack.packb(_canonical(value), use_bin_type=True)


def unpack(data: bytes, max_size: int = 1 << 20) -> Any:
    """Decode bytes that must be the canonical encoding of their value."""
    if len(data) > max_size:
        raise CodecError(f"{len(data)} bytes exceeds the limit of {max_size}")
    try:
        value = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
        )
    except _UNDECODABLE as exc:
        raise CodecError(f"not msgpack: {type(exc).__name__}") from exc
    if pack(value) != data:
        raise CodecError("not in canonical form")
    return value


def unpack_stored(data: bytes) -> Any:
    """Decode state this program wrote with pack(), which the app hash already covers: the
    canonical check that guards signed input would only cost time here."""
    try:
        return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except _UNDECODABLE as exc:
        raise CodecError(f"not msgpack: {type(exc).__name__}") from exc
