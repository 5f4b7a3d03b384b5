"""Where a validator's ABCI app listens: `HOST:PORT` on TCP, or `unix:///ABSOLUTE/PATH` on a Unix socket.

Whoever connects to the app drives it: an InitChain of garbage stops it, a FinalizeBlock and Commit of
its own commit a block CometBFT never saw. Any local process can connect to a TCP port; a Unix socket in
a directory that only the validator's user may enter makes that a file permission
(docs/threat-model.md). `chain init`, the network builder, the server and what waits for the app all
read an address here, so that what the CLI accepts the server can bind and CometBFT can dial.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

UNIX_SCHEME = "unix://"
MAX_SOCKET_PATH = 100
"""Bytes a socket's path may take: sun_path holds 108 on Linux and 104 on macOS and the BSDs, with the
terminating NUL; one bound below both keeps a home's address valid on either."""

_TCP = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9.-]+)):(?P<port>[0-9]{1,5})")


class AbciAddressError(ValueError):
    """An address the app cannot listen at: malformed, too long for a socket, or in a directory that
    others could reach."""


@dataclass(frozen=True)
class TcpAddress:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def proxy_app(self) -> str:
        """The address as CometBFT's `proxy_app` takes it."""
        return f"tcp://{self}"


@dataclass(frozen=True)
class UnixAddress:
    path: Path

    def __str__(self) -> str:
        return f"{UNIX_SCHEME}{self.path}"

    @property
    def proxy_app(self) -> str:
        """The address as CometBFT's `proxy_app` takes it: the same form."""
        return str(self)


AbciAddress = TcpAddress | UnixAddress


def parse_abci_address(text: str) -> AbciAddress:
    """`HOST:PORT` (an IPv6 host in brackets) or `unix:///ABSOLUTE/PATH`; AbciAddressError for anything
    else, so that a bad address is refused when a home is made rather than when the app starts."""
    if text.startswith(UNIX_SCHEME):
        return UnixAddress(socket_path(text.removeprefix(UNIX_SCHEME)))
    match = _TCP.fullmatch(text)
    if match is None or not 1 <= int(match["port"]) <= 65535:
        raise AbciAddressError(f"ABCI address {text!r} is neither HOST:PORT nor unix:///ABSOLUTE/PATH")
    return TcpAddress(match["v6"] or match["host"], int(match["port"]))


def socket_path(raw: str) -> Path:
    """`raw` as a socket's path: absolute, naming a file, and short enough for a socket address."""
    if not raw.startswith("/") or raw.endswith("/") or "\0" in raw:
        raise AbciAddressError(f"ABCI address {UNIX_SCHEME}{raw}: a socket needs an absolute file path, "
                               f"as in {UNIX_SCHEME}/srv/ps/abci/app.sock")
    path = Path(raw)
    if not fits_socket(path):
        raise AbciAddressError(f"socket path {raw} is {len(os.fsencode(path))} bytes, more than the "
                               f"{MAX_SOCKET_PATH} a Unix socket's address holds: use a shorter home, or "
                               "HOST:PORT")
    return path


def fits_socket(path: Path) -> bool:
    """Whether `path` is short enough to name a Unix socket."""
    return len(os.fsencode(path)) <= MAX_SOCKET_PATH


def connect(address: AbciAddress, timeout: float) -> socket.socket:
    """A connection to whatever listens at `address`; OSError when nothing accepts one."""
    if isinstance(address, TcpAddress):
        return socket.create_connection((address.host, address.port), timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(str(address.path))
    except OSError:
        sock.close()
        raise
    return sock


def listening(address: AbciAddress, timeout: float = 0.2) -> bool:
    """Whether something accepts connections at `address` now (an app that is up; a socket file
    left by a process that is gone accepts none)."""
    with contextlib.suppress(OSError), connect(address, timeout):
        return True
    return False
