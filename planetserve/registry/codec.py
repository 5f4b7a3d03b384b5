"""Canonical msgpack: the one byte encoding of everything that is signed or stored in state.

Canonical means: maps with string keys in sorted order, the shortest integer forms, no floats, and
bytes distinct from strings. Decoding re-encodes and compares, so a value has exactly one accepted
encoding and a signature cannot be replayed under a different spelling of the same message.

Also the one bounded decoder of untrusted msgpack (`unpack_bounded`, used by every decoder of network
input): a size limit alone does not bound memory, since one byte of msgpack (an empty array) becomes
a 56-byte Python list, so a 4 MiB frame of empty arrays would be about 256 MiB of objects. The decoder
counts every value it builds and the nesting of every container as msgpack builds them (bottom up,
through its hooks), and refuses past the stated limits before building much more; per-container
lengths are refused from the header, before anything is allocated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import msgpack

MAX_DEPTH = 8
_UNDECODABLE = (msgpack.UnpackException, ValueError, TypeError)
"""What msgpack raises for bad bytes; anything else (memory) is not the bytes' fault and propagates."""


class CodecError(ValueError):
    """Bytes that are not the canonical encoding of an allowed value."""


class LimitExceeded(CodecError):
    """Bytes that decode to more values, deeper nesting or longer items than the decoder allows."""


@dataclass(frozen=True)
class Limits:
    """What one decode may build. `max_objects` counts every value once (the root, each array item,
    each map key and each map value); `max_depth` counts nested containers (a scalar is depth 0, `[]`
    depth 1, `[[]]` depth 2); `max_len` bounds each array and map; `max_str` and `max_bin` bound each
    string and byte string, in bytes. Extension types are always refused."""

    max_objects: int
    max_depth: int
    max_len: int | None = None
    """Items per array or pairs per map; None: `max_objects`."""
    max_map: int | None = None
    """Pairs per map, where fewer than `max_len`; None: `max_len`."""
    max_str: int = 1 << 20
    max_bin: int = 4 << 20

    def worst_case_objects(self) -> int:
        """An upper bound on the values alive when a decode is refused: the counted ones, plus the
        uncounted items of the containers still being built (one per level)."""
        return self.max_objects + self.max_depth * (self.max_len or self.max_objects)


_CONTAINERS = (list, tuple, dict)


class _Budget:
    """msgpack's hooks see each container once it is complete, children before parents: each
    completed container's items are charged, and its depth is one more than its deepest child's."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.left = limits.max_objects - 1  # the root
        self.depths: dict[int, int] = {}

    def _charge(self, container: Any, count: int, children: Any) -> Any:
        self.left -= count
        if self.left < 0:
            raise LimitExceeded(f"more than {self.limits.max_objects} values")
        depth = 1
        if count:
            depths = self.depths
            for child in children:
                if type(child) in _CONTAINERS:
                    # an empty tuple is a shared singleton (use_list=False): its depth is always 1
                    child_depth = depths.pop(id(child), 1) + 1
                    if child_depth > depth:
                        depth = child_depth
            if depth > self.limits.max_depth:
                raise LimitExceeded(f"nesting deeper than {self.limits.max_depth}")
        elif self.limits.max_depth < 1:
            raise LimitExceeded(f"nesting deeper than {self.limits.max_depth}")
        self.depths[id(container)] = depth
        return container

    def array(self, items: Any) -> Any:
        return self._charge(items, len(items), items)

    def map(self, pairs: dict) -> dict:
        return self._charge(pairs, 2 * len(pairs), pairs.values())


def _no_ext(code: int, data: bytes) -> Any:
    raise CodecError(f"extension type {code} is not allowed")


def unpack_bounded(data: bytes, limits: Limits, *, use_list: bool = True) -> Any:
    """Decode untrusted msgpack within `limits`: LimitExceeded past them, CodecError for bytes that
    are not one msgpack value (trailing bytes included). Map keys must be strings or bytes. The
    result is what `msgpack.unpackb(data, raw=False, use_list=use_list)` returns."""
    return unpack_counted(data, limits, use_list=use_list)[0]


def unpack_counted(data: bytes, limits: Limits, *, use_list: bool = True) -> tuple[Any, int]:
    """`unpack_bounded`'s value and how many values it holds, as `Limits.max_objects` counts them: what
    a holder of it charges for the Python objects its bytes became."""
    budget = _Budget(limits)
    max_len = limits.max_objects if limits.max_len is None else limits.max_len
    try:
        value = msgpack.unpackb(
            data,
            raw=False,
            use_list=use_list,
            strict_map_key=True,
            max_array_len=max_len,
            max_map_len=max_len if limits.max_map is None else min(limits.max_map, max_len),
            max_str_len=limits.max_str,
            max_bin_len=limits.max_bin,
            max_ext_len=0,
            list_hook=budget.array,
            object_hook=budget.map,
            ext_hook=_no_ext,
        )
    except CodecError:
        raise
    except _UNDECODABLE as exc:
        if "exceeds max_" in str(exc):  # msgpack's own refusal of a length, from its header
            raise LimitExceeded(str(exc)) from exc
        raise CodecError(f"not msgpack: {type(exc).__name__}") from exc
    return value, limits.max_objects - budget.left


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


_CONTAINER_HEADS = frozenset([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])
"""The first byte of every msgpack array and map (fixmap, fixarray, array 16/32, map 16/32)."""
_NOT_HEADS = bytes(b for b in range(256) if b not in _CONTAINER_HEADS)


class _Containers:
    """msgpack's hook for each array and map it completes: refuses the decode past `limit` of them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def __call__(self, container: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise LimitExceeded(f"more than {self.limit} arrays and maps")
        return container


def unpack(data: bytes, max_size: int = 1 << 20, max_containers: int | None = None) -> Any:
    """Decode bytes that must be the canonical encoding of their value; with `max_containers`, refused
    (LimitExceeded) as soon as more arrays and maps than that are built, before the rest is read."""
    if len(data) > max_size:
        raise CodecError(f"{len(data)} bytes exceeds the limit of {max_size}")
    hooks = {}
    # Bytes with no more container heads than the bound cannot hold more containers: they decode without
    # the hooks (one C pass, where a hook call per container costs a valid transaction a quarter more).
    if max_containers is not None and len(data.translate(None, _NOT_HEADS)) > max_containers:
        count = _Containers(max_containers)
        hooks = {"list_hook": count, "object_hook": count}
    try:
        value = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            **hooks,
        )
    except CodecError:
        raise
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


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def _json_counts(raw: bytes) -> tuple[int, int]:
    """(containers, commas) outside strings."""
    return raw.count(b"[") + raw.count(b"{"), raw.count(b",")


def json_values_bound(raw: bytes) -> tuple[int, int]:
    """Upper bounds on the containers and on all the values `json.loads(raw)` builds, from one scan
    of the bytes with strings set aside: a container of n items holds n - 1 commas, so the values
    are at most 1 + 2 * (commas + containers)."""
    containers, commas = _json_counts(_JSON_STRING.sub(b'""', raw))
    return containers, 1 + 2 * (commas + containers)


def json_loads_bounded(raw: bytes, max_values: int, max_containers: int | None = None) -> Any:
    """`json.loads` for untrusted bytes: LimitExceeded when they could build more than `max_values`
    values or `max_containers` arrays and objects (a size limit alone lets `[[],[],...]` build 21
    bytes of lists per byte), CodecError for bytes that are not JSON or that nest past the
    interpreter's recursion limit."""
    max_containers = max_values if max_containers is None else max_containers
    containers, commas = _json_counts(raw)  # quick, but counts inside strings too: then scan exactly
    if containers > max_containers or 1 + 2 * (commas + containers) > max_values:
        containers, values = json_values_bound(raw)
        if containers > max_containers:
            raise LimitExceeded(f"more than {max_containers} arrays and objects")
        if values > max_values:
            raise LimitExceeded(f"more than {max_values} values")
    try:
        return json.loads(raw)
    except RecursionError:
        raise CodecError("nests too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CodecError(f"is not JSON: {str(exc)[:200]}") from None
