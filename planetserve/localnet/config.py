"""The composition of `make localnet`, read from a TOML file (localnet/localnet.toml by default).

Every setting has a default, the value the committed localnet/localnet.toml gives it, so a file only
needs what it changes. Unknown tables and keys are errors, and each bad value names its place
(`nodes[2].behaviour`) and what it should be.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planetserve.chain.abci.store import check_keep_heights
from planetserve.models.recipes import DEFAULT_PRESET, NAMES, PRESETS
from planetserve.node.behaviours import ALTER_PROMPTS, BEHAVIOURS, HONEST
from planetserve.node.overlay.routes import PATH_LENGTH
from planetserve.registry import fields
from planetserve.registry.errors import InvalidField
from planetserve.registry.params import Params

DEFAULT_FILE = Path("localnet/localnet.toml")
LOCALNET_PARAMS = {"epoch_blocks": 40, "results_blocks": 16, "vrf_window_blocks": 10,
                   "plan_window_blocks": 14, "probation_epochs": 0}
"""Epochs of about 40 blocks (the verifier network test's), so a localnet scores its nodes within minutes;
nodes listed from registration (no probation), so its client is answered as soon as it starts."""
CLOVES = 4
"""n: cloves per message, one per path, so a relay keeps at least this many proxies."""
_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
_DURATION = re.compile(r"[0-9]+(ms|s)")
_ADDRESS = re.compile(r"127\.0\.0\.1:[0-9]{1,5}")


class ConfigError(Exception):
    """The localnet configuration file is missing, malformed, or holds an unusable value."""


@dataclass(frozen=True)
class NodeSpec:
    """One model node, run by an organisation of its own unless `org` names a shared one."""

    name: str
    model: str = "gt"
    """What its engine loads: a model of the family."""
    model_id: str = "gt"
    """The registered model it claims to serve (its group); the verifiers score it against the family
    model of that name."""
    behaviour: str = HONEST
    org: str = ""
    """Its organisation's id; empty: org-<name>."""
    capacity: int = 2

    def __post_init__(self) -> None:
        if not self.org:
            object.__setattr__(self, "org", f"org-{self.name}")

    @property
    def org_id(self) -> str:
        return self.org


DEFAULT_NODES = (NodeSpec("honest-a"), NodeSpec("honest-b"), NodeSpec("smaller", model="tiny"),
                 NodeSpec("clickbait", behaviour=ALTER_PROMPTS))


@dataclass(frozen=True)
class LocalnetConfig:
    source: Path | None = None
    """The file read (None: the built-in defaults)."""
    validators: int = 4
    chain_id: str = "planetserve-localnet"
    timeout_commit: str = "1s"
    keep_heights: int = 0
    """Recent heights each validator's state keeps provable (0: all; see StateStore)."""
    verifiers: bool = True
    params: Params = field(default_factory=lambda: Params(**LOCALNET_PARAMS))
    preset: str = DEFAULT_PRESET
    data_dir: Path | None = None
    """Where the model family lives (None: the network's root directory)."""
    nodes: tuple[NodeSpec, ...] = DEFAULT_NODES
    relays: int = 8
    """User relays besides the client's."""
    proxies: int = 5
    path_lifetime: int = 600
    """Seconds each relay's paths serve before they are replaced (UserConfig.path_lifetime); 0 never."""
    client_model: str = "gt"
    prompt: str = "What does the json module do?"
    max_tokens: int = 32
    client_http: str = ""
    """The client relay's OpenAI endpoint (host:port); empty: a free port, picked when its home is made."""
    dashboard_http: str = ""
    """Where the dashboard (beside the client relay) serves its page (host:port); empty: a free port,
    picked once and then kept."""

    @property
    def has_client(self) -> bool:
        return bool(self.nodes)

    @property
    def model_ids(self) -> list[str]:
        return sorted({n.model_id for n in self.nodes})

    def family_dir(self, root: Path) -> Path:
        return self.data_dir if self.data_dir is not None else root.absolute()


def load_config(path: Path | None = None) -> LocalnetConfig:
    """Read `path`; without one, DEFAULT_FILE if it exists, else the built-in defaults."""
    if path is None:
        if not DEFAULT_FILE.exists():
            return LocalnetConfig()
        path = DEFAULT_FILE
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the localnet configuration {path}: {exc.strerror or exc}") from exc
    return parse_config(text, path)


def parse_config(text: str, source: Path) -> LocalnetConfig:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
    reader = _Reader(source)
    reader.keys(raw, "", {"network", "params", "models", "nodes", "relays", "client", "dashboard"})
    network = reader.table(raw, "network", {"validators", "chain_id", "timeout_commit", "keep_heights",
                                            "verifiers"})
    models = reader.table(raw, "models", {"preset", "data_dir"})
    relays = reader.table(raw, "relays", {"count", "proxies", "path_lifetime"})
    client = reader.table(raw, "client", {"model", "prompt", "max_tokens", "http"})
    dashboard = reader.table(raw, "dashboard", {"http"})
    base = LocalnetConfig()
    nodes = reader.nodes(raw["nodes"]) if "nodes" in raw else base.nodes
    config = LocalnetConfig(
        source=source,
        validators=reader.integer(network, "network.validators", base.validators, 1, 16),
        chain_id=reader.ident(network, "network.chain_id", base.chain_id),
        timeout_commit=reader.pattern(network, "network.timeout_commit", base.timeout_commit, _DURATION,
                                      'a duration such as "1s" or "300ms"'),
        keep_heights=reader.keep_heights(network, "network.keep_heights", base.keep_heights),
        verifiers=reader.boolean(network, "network.verifiers", base.verifiers),
        params=reader.params(raw.get("params", {})),
        preset=reader.choice(models, "models.preset", base.preset, tuple(sorted(PRESETS))),
        data_dir=reader.directory(models, "models.data_dir"),
        nodes=nodes,
        relays=reader.integer(relays, "relays.count", base.relays, 0, 64),
        proxies=reader.integer(relays, "relays.proxies", base.proxies, CLOVES, 16),
        path_lifetime=reader.integer(relays, "relays.path_lifetime", base.path_lifetime, 0, 86_400),
        client_model=reader.string(client, "client.model", base.client_model),
        prompt=reader.string(client, "client.prompt", base.prompt),
        max_tokens=reader.integer(client, "client.max_tokens", base.max_tokens, 1, 1024),
        client_http=reader.pattern(client, "client.http", base.client_http, _ADDRESS,
                                   'empty or "127.0.0.1:PORT"', empty_ok=True),
        dashboard_http=reader.pattern(dashboard, "dashboard.http", base.dashboard_http, _ADDRESS,
                                      'empty or "127.0.0.1:PORT"', empty_ok=True),
    )
    check(config)
    return config


def check(config: LocalnetConfig) -> None:
    """Rules between settings."""
    where = config.source or "localnet configuration"
    if config.verifiers and not config.nodes:
        raise ConfigError(f"{where}: network.verifiers: verifiers challenge model nodes, and [[nodes]] lists "
                          "none; set verifiers = false")
    relays = config.relays + (1 if config.has_client else 0)
    if (config.relays or config.has_client) and relays < PATH_LENGTH + 1:
        raise ConfigError(f"{where}: relays.count: {config.relays} relay(s) cannot carry onion paths: a "
                          f"path needs {PATH_LENGTH} relays besides its user, so at least {PATH_LENGTH + 1} "
                          "relays in all, the client's included")
    if config.client_http and config.client_http == config.dashboard_http:
        raise ConfigError(f"{where}: dashboard.http: {config.dashboard_http} is the client relay's address "
                          "(client.http); give the dashboard another port")
    if config.nodes and config.client_model not in config.model_ids:
        raise ConfigError(f"{where}: client.model: {config.client_model!r} is served by no node; the nodes "
                          f"claim {', '.join(config.model_ids)}")


class _Reader:
    """Typed reads of the parsed TOML, each failure a ConfigError naming the file and the setting."""

    def __init__(self, source: Path) -> None:
        self.source = source

    def error(self, where: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {where}: {message}")

    def keys(self, table: dict[str, Any], where: str, allowed: set[str]) -> None:
        unknown = sorted(set(table) - allowed)
        if unknown:
            place = f"{where}.{unknown[0]}" if where else unknown[0]
            known = ", ".join(sorted(allowed))
            raise self.error(place, f"unknown setting; {where or 'the file'} takes {known}")

    def table(self, raw: dict[str, Any], name: str, allowed: set[str]) -> dict[str, Any]:
        value = raw.get(name, {})
        if not isinstance(value, dict):
            raise self.error(name, f"must be a table ([{name}])")
        self.keys(value, name, allowed)
        return value

    def _get(self, table: dict[str, Any], where: str, default: Any) -> Any:
        return table.get(where.rpartition(".")[2], default)

    def _checked(self, table: dict[str, Any], where: str, default: Any, ok: Callable[[Any], bool],
                 what: str) -> Any:
        """The setting at `where` if `ok` takes it; else an error saying it must be `what`."""
        value = self._get(table, where, default)
        if not ok(value):
            raise self.error(where, f"must be {what}, got {value!r}")
        return value

    def integer(self, table: dict[str, Any], where: str, default: int, low: int, high: int) -> int:
        return self._checked(table, where, default, lambda v: isinstance(v, int) and not isinstance(v, bool)
                             and low <= v <= high, f"an integer from {low} to {high}")

    def keep_heights(self, table: dict[str, Any], where: str, default: int) -> int:
        value = self.integer(table, where, default, 0, 10**9)
        try:
            return check_keep_heights(value)
        except ValueError as exc:
            raise self.error(where, str(exc)) from None

    def boolean(self, table: dict[str, Any], where: str, default: bool) -> bool:
        return self._checked(table, where, default, lambda v: isinstance(v, bool), "true or false")

    def string(self, table: dict[str, Any], where: str, default: str) -> str:
        return self._checked(table, where, default, lambda v: isinstance(v, str) and bool(v.strip()),
                             "a non-empty string")

    def pattern(self, table: dict[str, Any], where: str, default: str, regex: re.Pattern[str], what: str,
                empty_ok: bool = False) -> str:
        return self._checked(table, where, default, lambda v: isinstance(v, str) and bool(
            regex.fullmatch(v) or (empty_ok and v == "")), what)

    def choice(self, table: dict[str, Any], where: str, default: str, allowed: tuple[str, ...]) -> str:
        return self._checked(table, where, default, lambda v: v in allowed, f"one of {', '.join(allowed)}")

    def ident(self, table: dict[str, Any], where: str, default: str) -> str:
        value = self._get(table, where, default)
        try:
            return fields.ident({"value": value}, "value")
        except InvalidField as exc:
            raise self.error(where, f"{exc.reason}, got {value!r}") from None

    def directory(self, table: dict[str, Any], where: str) -> Path | None:
        value = self._get(table, where, "")
        if not isinstance(value, str):
            raise self.error(where, f"must be a directory path (a string), got {value!r}")
        if not value:
            return None
        path = Path(value).expanduser()
        return path if path.is_absolute() else (self.source.parent / path).absolute()

    def params(self, raw: Any) -> Params:
        if not isinstance(raw, dict):
            raise self.error("params", "must be a table ([params])")
        merged = {**LOCALNET_PARAMS, **raw}
        try:
            return Params.from_genesis(merged)
        except InvalidField as exc:
            raise self.error(f"params.{exc.field}", f"{exc.reason}, got {merged.get(exc.field)!r}") from None

    def nodes(self, raw: Any) -> tuple[NodeSpec, ...]:
        if not isinstance(raw, list):
            raise self.error("nodes", "must be an array of tables ([[nodes]])")
        specs: list[NodeSpec] = []
        for i, entry in enumerate(raw):
            where = f"nodes[{i}]"
            if not isinstance(entry, dict):
                raise self.error(where, "must be a table")
            self.keys(entry, where, {"name", "model", "model_id", "behaviour", "org", "capacity"})
            if "name" not in entry:
                raise self.error(f"{where}.name", "missing (each node needs a name)")
            name = self.pattern(entry, f"{where}.name", "", _NAME, "1-32 lower-case letters, digits or -")
            if any(s.name == name for s in specs):
                raise self.error(f"{where}.name", f"{name!r} names two nodes")
            family = tuple(NAMES)
            specs.append(NodeSpec(
                name=name,
                model=self.choice(entry, f"{where}.model", "gt", family),
                model_id=self.choice(entry, f"{where}.model_id", "gt", family),
                behaviour=self.choice(entry, f"{where}.behaviour", HONEST, BEHAVIOURS),
                org=self.ident(entry, f"{where}.org", f"org-{name}"),
                capacity=self.integer(entry, f"{where}.capacity", 2, 1, 64),
            ))
        return tuple(specs)
