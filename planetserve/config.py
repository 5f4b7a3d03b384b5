"""Role home directories: each role keeps one JSON configuration in its home, loaded strictly so that
a misspelt setting is an error rather than silently ignored."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import ClassVar, Self


class HomeError(Exception):
    """The home directory is missing, incomplete or its configuration is malformed."""


_HOST_PORT = re.compile(r"(?P<host>[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:]+\]):(?P<port>[0-9]{1,5})")
_HTTP_URL = re.compile(r"https?://[^\s/]+(/\S*)?")


def is_host_port(text: str) -> bool:
    """host:port with a port in 0-65535 (0: any free one, where the role listens)."""
    match = _HOST_PORT.fullmatch(text)
    return match is not None and int(match["port"]) <= 65535


def is_http_url(text: str) -> bool:
    return _HTTP_URL.fullmatch(text) is not None


def check_addresses(file: str, config: object, *, host_ports: tuple[str, ...] = (),
                    urls: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> None:
    """HomeError naming the first setting that is not host:port or not an http(s) URL; those named
    in `optional` may also be empty."""
    for name in host_ports:
        value = getattr(config, name)
        if (value or name not in optional) and not is_host_port(value):
            raise HomeError(f"{file}: {name} must be host:port such as 127.0.0.1:9000, got {value!r}")
    for name in urls:
        value = getattr(config, name)
        if (value or name not in optional) and not is_http_url(value):
            raise HomeError(f"{file}: {name} must be an http:// URL such as http://127.0.0.1:26657, "
                            f"got {value!r}")


class HomeConfig:
    """Loading and saving a role's JSON configuration (a dataclass); unknown settings are errors."""

    FILE: ClassVar[str]
    INIT: ClassVar[str]
    """The `planetserve` command that creates the home, for the error a missing one gets."""

    @classmethod
    def load(cls, home: Path) -> Self:
        path = home / cls.FILE
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise HomeError(f"no {cls.FILE} in {home}: run `planetserve {cls.INIT} --home {home}`") from exc
        except json.JSONDecodeError as exc:
            raise HomeError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise HomeError(f"{path} must hold a JSON object")
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})  # type: ignore[arg-type]
        if unknown:
            raise HomeError(f"{path}: unknown settings {', '.join(unknown)}")
        try:
            config = cls(**raw)
        except (TypeError, ValueError) as exc:
            raise HomeError(f"{path}: {exc}") from exc
        config.check()
        return config

    def check(self) -> None:
        """Raise HomeError for settings that are present but unusable."""

    def save(self, home: Path) -> None:
        """Write the configuration, refusing (HomeError) settings that `load` would refuse."""
        self.check()
        home.mkdir(mode=0o700, parents=True, exist_ok=True)  # journals of what the role did live here too
        (home / self.FILE).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")  # type: ignore[call-overload]


MAX_AGE = 300.0
"""The light client's default bound on the age of the latest header (chain/lightclient.py
DEFAULT_MAX_AGE, which says why five minutes)."""


def max_age_problem(value: object) -> str | None:
    """Why `value` is no usable `max_age` (None: it is one)."""
    usable = isinstance(value, int | float) and not isinstance(value, bool)
    if not usable or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type]
        return (f"max_age must be a positive number of seconds (default {MAX_AGE:g}), well above the "
                f"chain's block interval, got {value!r}")
    return None


@dataclass(kw_only=True)
class LedgerHome(HomeConfig):
    """The home of a role that reads the ledger (a model node, a user relay, a verifier): where it reads
    it and what it verifies it against, declared once, with the check of every address it holds."""

    rpc: str = "http://127.0.0.1:26657"
    """A validator's CometBFT RPC endpoint."""
    genesis: str = ""
    """The genesis file the light client starts from."""
    witness: str = ""
    """A second RPC endpoint (best: another operator's validator) whose header at each height read must
    be the one verified from `rpc`; empty: none. It guards against a fork or a lying `rpc`, and makes
    every read wait for both endpoints."""
    max_age: float = MAX_AGE
    """Seconds the latest verified header may be older than this machine's clock: an endpoint serving
    an older (validly signed) state is refused, and lists read from it are dropped once this old."""
    metrics: str = ""
    """host:port where the role serves its Prometheus metrics (`/metrics`); empty: nowhere."""
    HOST_PORTS: ClassVar[tuple[str, ...]] = ()
    """The role's other settings that must be host:port."""
    URLS: ClassVar[tuple[str, ...]] = ()
    """Its other settings that must be http(s) URLs (`rpc` always is)."""
    OPTIONAL: ClassVar[tuple[str, ...]] = ()
    """Those of them that may also be empty."""

    def check(self) -> None:
        check_addresses(self.FILE, self, host_ports=(*self.HOST_PORTS, "metrics"),
                        urls=("rpc", "witness", *self.URLS), optional=("witness", "metrics", *self.OPTIONAL))
        if self.witness and self.witness.rstrip("/") == self.rpc.rstrip("/"):
            raise HomeError(f"{self.FILE}: witness must be another endpoint than rpc ({self.rpc}): a "
                            f"witness checks rpc's answers, so it cannot be rpc itself")
        if (problem := max_age_problem(self.max_age)) is not None:
            raise HomeError(f"{self.FILE}: {problem}")
