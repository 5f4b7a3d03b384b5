"""Validation of the fields of a transaction body: every value read from the network is checked here."""

from __future__ import annotations

import re
from typing import Any

from planetserve.registry.errors import InvalidField

_IDENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,63}")
_REGION = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
_HOST = re.compile(r"[A-Za-z0-9.-]{1,253}|\[[0-9a-fA-F:]{2,39}\]")
_HARDWARE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._+-]{0,63}")
MAX_LAYERS = 10_000
MAX_MIB = 1 << 30
MAX_GFLOPS = 1 << 40


def check_keys(body: dict[str, Any], required: set[str], optional: frozenset[str] = frozenset()) -> None:
    missing = sorted(required - body.keys())
    if missing:
        raise InvalidField(missing[0], "missing")
    unknown = sorted(body.keys() - required - optional)
    if unknown:
        raise InvalidField(unknown[0], "unknown field")


def ident(body: dict[str, Any], name: str) -> str:
    """Organisation and model identifiers: 1-64 characters, letters, digits and . _ : / -."""
    value = body.get(name)
    if not isinstance(value, str) or not _IDENT.fullmatch(value):
        raise InvalidField(name, "must be 1-64 characters of letters, digits and . _ : / -")
    return value


def region(body: dict[str, Any], name: str = "region") -> str:
    value = body.get(name)
    if not isinstance(value, str) or not _REGION.fullmatch(value):
        raise InvalidField(name, "must be 1-32 lower-case letters, digits or -")
    return value


def address(body: dict[str, Any], name: str = "address") -> str:
    """A reachable peer address, host:port."""
    value = body.get(name)
    if not isinstance(value, str) or len(value) > 260 or ":" not in value:
        raise InvalidField(name, "must be host:port")
    host, _, port = value.rpartition(":")
    if not _HOST.fullmatch(host) or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise InvalidField(name, "must be host:port with a port in 1-65535")
    return value


def text(body: dict[str, Any], name: str, max_len: int) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value.strip() or len(value) > max_len:
        raise InvalidField(name, f"must be non-empty text of at most {max_len} characters")
    if any(ord(ch) < 32 for ch in value):
        raise InvalidField(name, "must not contain control characters")
    return value


def one_line(value: str, max_len: int) -> str:
    """Text from elsewhere (a peer's error message) as one line that `text` takes, but for being empty:
    unprintable characters become spaces, runs of whitespace one space, and it is cut to `max_len`."""
    return " ".join("".join(c if c.isprintable() else " " for c in value).split())[:max_len]


def free_text(body: dict[str, Any], name: str, max_len: int) -> str:
    """Text people write at length, such as a prompt: line breaks and tabs allowed, other control
    characters not."""
    value = body.get(name)
    if not isinstance(value, str) or not value.strip() or len(value) > max_len:
        raise InvalidField(name, f"must be non-empty text of at most {max_len} characters")
    if any(ord(ch) < 32 and ch not in "\t\n\r" for ch in value):
        raise InvalidField(name, "must not contain control characters other than tab and line breaks")
    return value


def hardware(body: dict[str, Any], name: str = "hardware") -> str:
    value = body.get(name)
    if not isinstance(value, str) or not _HARDWARE.fullmatch(value):
        raise InvalidField(name, "must be 1-64 characters naming a hardware class")
    return value


def key32(body: dict[str, Any], name: str) -> bytes:
    value = body.get(name)
    if not isinstance(value, bytes) or len(value) != 32:
        raise InvalidField(name, "must be 32 bytes")
    return value


def sig64(body: dict[str, Any], name: str) -> bytes:
    value = body.get(name)
    if not isinstance(value, bytes) or len(value) != 64:
        raise InvalidField(name, "must be a 64-byte signature")
    return value


def integer(body: dict[str, Any], name: str, low: int, high: int) -> int:
    return within(name, body.get(name), low, high)


def within(name: str, value: Any, low: int, high: int) -> int:
    """An integer in low..high; the chain's parameters narrow some ranges that a message allows."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidField(name, f"must be an integer in {low}..{high}")
    return value


def choice(body: dict[str, Any], name: str, allowed: tuple[str, ...]) -> str:
    value = body.get(name)
    if value not in allowed:
        raise InvalidField(name, f"must be one of {', '.join(allowed)}")
    return value


def flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if not isinstance(value, bool):
        raise InvalidField(name, "must be true or false")
    return value


def model_size(body: dict[str, Any]) -> tuple[int, int]:
    """A model's optional (layers, layer_mib): both or neither, (0, 0) when undeclared."""
    layers = integer(body, "layers", 1, MAX_LAYERS) if "layers" in body else 0
    layer_mib = integer(body, "layer_mib", 1, MAX_MIB) if "layer_mib" in body else 0
    if bool(layers) != bool(layer_mib):
        raise InvalidField("layers", "a model's size needs both layers and layer_mib")
    return layers, layer_mib
