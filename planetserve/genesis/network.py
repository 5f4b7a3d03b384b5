"""Validator homes and one shared genesis for an N-validator network on a single machine.

`build_network` runs `cometbft init` once per validator, then replaces each home's genesis with one
genesis that lists every genesis validator's consensus key, edits each `config.toml` (listen
addresses on free localhost ports, persistent peers, consensus timing, log level) and writes the
planetserve files next to CometBFT's own:

- `config/planetserve_keys.json`: the validator's planetserve KeySet (identity, VRF, X25519);
- `config/planetserve.json`: where its ABCI app listens, its database URL and the chain id.

Nodes built here share one machine and listen on loopback TCP; a home made by `join_home` (one
operator's node) has its app on a Unix socket in the home by default (`default_abci`).

The whole layout is recorded in `<root>/network.json` so that other processes (the localnet CLI,
tests) can reload it with `NetworkSpec.load(root)`.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from planetserve.chain.abci.address import AbciAddress, TcpAddress, UnixAddress, fits_socket
from planetserve.chain.keys import KeySet, write_private

SPEC_FILE = "network.json"
KEYS_FILE = "planetserve_keys.json"
APP_CONFIG_FILE = "planetserve.json"
DEFAULT_MAX_BLOCK_BYTES = 4 * 1024 * 1024
DEFAULT_SNAPSHOT_INTERVAL = 1000
"""Heights between a validator's state sync snapshots (about 8 minutes at 500 ms blocks)."""
SNAPSHOT_KEEP = 2
STATE_SYNC_TRUST_PERIOD = "168h0m0s"
"""How old a trusted header may be: within a week, the validators that signed it are still accountable."""
ABCI_SOCKET = Path("abci") / "app.sock"
"""The app's socket in a home, in a directory of its own that the app keeps 0700. Not in data/: that is
CometBFT's (`unsafe-reset-all` deletes and remakes it) and holds what operators back up or share, so its
mode is not the app's to enforce."""
ABCI_TCP = TcpAddress("127.0.0.1", 26658)
"""CometBFT's default `proxy_app`: the app's address when the home's path is too long for a socket."""


@dataclass(frozen=True)
class StateSync:
    """How a joining node syncs by snapshot: light-client `rpc_servers` (at least one; CometBFT asks for
    two, so one is given twice) and a trusted header (`trust_height`, `trust_hash`) that the joining
    operator verified, e.g. with `planetserve chain init --state-sync`, which verifies the latest from
    the genesis."""

    rpc_servers: tuple[str, ...]
    trust_height: int
    trust_hash: bytes
    discovery_time: str = "5s"

    def config(self) -> dict[str, Any]:
        servers = list(self.rpc_servers) * (2 if len(self.rpc_servers) == 1 else 1)
        return {"enable": True, "rpc_servers": ",".join(servers), "trust_height": self.trust_height,
                "trust_hash": self.trust_hash.hex().upper(), "trust_period": STATE_SYNC_TRUST_PERIOD,
                "discovery_time": self.discovery_time}


class NetworkBuildError(Exception):
    """The network could not be built (missing binary, existing home, bad argument)."""


@dataclass(frozen=True)
class Ports:
    """The localhost TCP ports of one validator."""

    rpc: int
    p2p: int
    abci: int
    cometbft_metrics: int = 0
    """CometBFT's Prometheus endpoint (0: none)."""
    app_metrics: int = 0
    """The ABCI app's Prometheus endpoint (0: none)."""


@dataclass(frozen=True)
class ValidatorInfo:
    """One node of the network. `power` is its voting power in genesis (0: a full node at genesis)."""

    index: int
    moniker: str
    home: Path
    pub_key: bytes  # ed25519 consensus public key, from priv_validator_key.json
    power: int
    node_id: str  # hex of the first 20 bytes of sha256(node key's public key)
    ports: Ports
    keys: dict[str, str] = field(default_factory=dict)  # KeySet.public_summary(): hex strings
    db_url: str = ""

    @property
    def address(self) -> bytes:
        """The consensus address: the first 20 bytes of sha256(pubkey)."""
        return hashlib.sha256(self.pub_key).digest()[:20]

    @property
    def rpc_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.rpc}"

    @property
    def p2p_address(self) -> str:
        return f"{self.node_id}@127.0.0.1:{self.ports.p2p}"

    @property
    def abci_address(self) -> TcpAddress:
        return TcpAddress("127.0.0.1", self.ports.abci)

    @property
    def abci_listen(self) -> str:
        return str(self.abci_address)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "moniker": self.moniker,
            "home": str(self.home),
            "pub_key": self.pub_key.hex(),
            "power": self.power,
            "node_id": self.node_id,
            "ports": dataclasses.asdict(self.ports),
            "keys": dict(self.keys),
            "db_url": self.db_url,
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ValidatorInfo:
        return cls(
            index=int(body["index"]),
            moniker=str(body["moniker"]),
            home=Path(body["home"]),
            pub_key=bytes.fromhex(body["pub_key"]),
            power=int(body["power"]),
            node_id=str(body["node_id"]),
            ports=Ports(**{k: int(v) for k, v in body["ports"].items()}),
            keys=dict(body.get("keys", {})),
            db_url=str(body.get("db_url", "")),
        )


@dataclass(frozen=True)
class NetworkSpec:
    """Everything needed to run and address the network built under `root`."""

    root: Path
    chain_id: str
    genesis_time: str
    validators: list[ValidatorInfo]
    kvstore: bool  # proxy_app = "kvstore": cometbft's built-in application

    @property
    def genesis_path(self) -> Path:
        return self.validators[0].home / "config" / "genesis.json"

    def save(self) -> Path:
        path = self.root / SPEC_FILE
        body = {
            "chain_id": self.chain_id,
            "genesis_time": self.genesis_time,
            "kvstore": self.kvstore,
            "validators": [v.to_json() for v in self.validators],
        }
        write_private(path, json.dumps(body, indent=2) + "\n")  # database URLs may carry passwords
        return path

    @classmethod
    def load(cls, root: Path) -> NetworkSpec:
        root = Path(root)
        body = json.loads((root / SPEC_FILE).read_text())
        return cls(
            root=root,
            chain_id=body["chain_id"],
            genesis_time=body["genesis_time"],
            validators=[ValidatorInfo.from_json(v) for v in body["validators"]],
            kvstore=bool(body["kvstore"]),
        )


def cometbft_binary() -> str:
    """The cometbft binary: $PLANETSERVE_COMETBFT, the one next to this Python, or one on PATH."""
    env = os.environ.get("PLANETSERVE_COMETBFT")
    if env:
        return env
    beside = Path(sys.executable).parent / "cometbft"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("cometbft")
    if found:
        return found
    raise NetworkBuildError("cometbft binary not found (run scripts/setup.sh)")


_HANDED_OUT: set[int] = set()
_PORTS = random.Random()


def _ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


PORTS_ENV = "PLANETSERVE_PORTS"
"""LOW-HIGH: where free_ports draws from, for processes that share a machine and must not draw the same
port between drawing it and binding it (test workers, say); by default 10000 to the kernel's ephemeral
range."""


def port_range() -> tuple[int, int]:
    """The ports free_ports draws from: $PLANETSERVE_PORTS, else 10000 up to the ephemeral range."""
    raw = os.environ.get(PORTS_ENV, "").strip()
    if not raw:
        return 10_000, _ephemeral_low() - 1
    low_text, _, high_text = raw.partition("-")
    try:
        low, high = int(low_text), int(high_text)
    except ValueError:
        low, high = 0, -1
    if not 1024 <= low <= high <= 65535:
        raise NetworkBuildError(f"{PORTS_ENV}={raw!r}: must be LOW-HIGH with 1024 <= LOW <= HIGH <= 65535")
    return low, high


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that were free a moment ago. They are drawn below the
    range the kernel takes outgoing connections' ports from, so that no client connection takes one
    before its server binds it, and never twice in one process."""
    low, high = port_range()
    out: list[int] = []
    for _ in range(50 * count):
        port = _PORTS.randint(low, high)
        if port in _HANDED_OUT or port in out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
        if len(out) == count:
            _HANDED_OUT.update(out)
            return out
    raise NetworkBuildError(f"found only {len(out)} of {count} free ports in {low}..{high}")


def node_id_from_key_file(path: Path) -> str:
    """The p2p node id: hex of the first 20 bytes of sha256 of the node's ed25519 public key."""
    priv = base64.b64decode(json.loads(path.read_text())["priv_key"]["value"])
    if len(priv) != 64:
        raise NetworkBuildError(f"unexpected node key length in {path}")
    return hashlib.sha256(priv[32:]).digest()[:20].hex()


def consensus_pubkey(home: Path) -> bytes:
    body = json.loads((home / "config" / "priv_validator_key.json").read_text())
    if body["pub_key"]["type"] != "tendermint/PubKeyEd25519":
        raise NetworkBuildError(f"unsupported consensus key type {body['pub_key']['type']}")
    return base64.b64decode(body["pub_key"]["value"])


def format_time(t: datetime) -> str:
    """RFC 3339 in UTC with a Z, as CometBFT writes genesis times."""
    t = t.astimezone(UTC)
    frac = f".{t.microsecond:06d}".rstrip("0").rstrip(".")
    return t.strftime("%Y-%m-%dT%H:%M:%S") + frac + "Z"


# --- config.toml editing ------------------------------------------------------------------------

_SECTION = re.compile(r"^\s*\[([^\[\]]+)\]\s*(#.*)?$")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for the plain values written here
    raise TypeError(f"unsupported TOML value {value!r}")


def edit_toml(text: str, edits: dict[str, dict[str, Any]]) -> str:
    """Set `key = value` inside `[section]` ("" = the top-level table), line by line.

    Existing keys are replaced in place (keeping the file's comments); missing keys are appended to
    their section. The result is re-parsed to make sure it is valid and holds the new values.
    """
    lines = text.splitlines()
    pending = {sec: dict(kv) for sec, kv in edits.items()}
    section = ""
    section_end: dict[str, int] = {}  # section -> index after its last line
    for i, line in enumerate(lines):
        m = _SECTION.match(line)
        if m:
            section = m.group(1).strip()
            section_end.setdefault(section, i + 1)
            continue
        section_end[section] = i + 1
        todo = pending.get(section)
        if not todo:
            continue
        key = line.split("=", 1)[0].strip() if "=" in line and not line.lstrip().startswith("#") else None
        if key in todo:
            lines[i] = f"{key} = {_toml_value(todo.pop(key))}"
    # Append keys that were not found, after the last line of their section, last section first
    for sec in sorted(pending, key=lambda s: section_end.get(s, len(lines)), reverse=True):
        rest = pending[sec]
        if not rest:
            continue
        new = [f"{k} = {_toml_value(v)}" for k, v in rest.items()]
        if sec in section_end:
            at = section_end[sec]
            lines[at:at] = new
        elif sec == "":
            lines[0:0] = new
        else:
            lines += ["", f"[{sec}]", *new]
    out = "\n".join(lines) + "\n"
    parsed = tomllib.loads(out)
    for sec, kv in edits.items():
        table = parsed
        for part in filter(None, sec.split(".")):
            table = table[part]
        for k, v in kv.items():
            if table.get(k) != v:
                raise NetworkBuildError(f"config edit [{sec}] {k} did not take")
    return out


# --- the builder --------------------------------------------------------------------------------


def build_network(
    root: Path,
    n: int,
    chain_id: str,
    app_state_fn: Callable[[list[ValidatorInfo]], dict] | None = None,
    *,
    kvstore: bool | None = None,
    genesis_time: str | datetime | None = None,
    timeout_commit: str = "500ms",
    power: int | Sequence[int] = 10,
    n_genesis: int | None = None,
    db_urls: Sequence[str] | None = None,
    log_level: str = "state:info,*:error",
    max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
    extra_config: dict[str, dict[str, Any]] | None = None,
    keep_heights: int = 0,
    snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL,
    retain_blocks: int = 0,
) -> NetworkSpec:
    """Create `root/v0 … root/v{n-1}` and a genesis shared by all of them.

    - `app_state_fn(infos)` gives the genesis `app_state`; when it is None and `kvstore` is not
      False, the nodes use cometbft's built-in kvstore app (proxy_app = "kvstore").
    - Only the first `n_genesis` nodes (default: all) are genesis validators; the others start as
      full nodes (power 0 in their ValidatorInfo) and can be added later by a validator update.
    - `power` is one voting power for everyone or one per node; `db_urls` one URL per node.
    - `extra_config` maps a config.toml section ("" for the top level) to keys to set.
    - `keep_heights` is every app's state pruning (0: keep every height; see `StateStore`).
    - `snapshot_interval`: every app makes a state sync snapshot each that many heights (0: none);
      `retain_blocks`: the blocks each CometBFT keeps (0: all; see `Application`).
    """
    root = Path(root).absolute()
    if n < 1:
        raise NetworkBuildError("a network needs at least one node")
    n_genesis = n if n_genesis is None else n_genesis
    if not 1 <= n_genesis <= n:
        raise NetworkBuildError(f"n_genesis must be within 1..{n}")
    powers = [power] * n if isinstance(power, int) else list(power)
    if len(powers) != n or any(p <= 0 for p in powers):
        raise NetworkBuildError("power must be positive, one value or one per node")
    if db_urls is not None and len(db_urls) != n:
        raise NetworkBuildError("db_urls needs one URL per node")
    use_kvstore = (app_state_fn is None) if kvstore is None else kvstore
    if isinstance(genesis_time, datetime):
        genesis_time = format_time(genesis_time)
    elif genesis_time is None:
        genesis_time = format_time(datetime.now(UTC).replace(microsecond=0))
    binary = cometbft_binary()

    root.mkdir(parents=True, exist_ok=True)
    ports = free_ports(5 * n)
    infos: list[ValidatorInfo] = []
    for i in range(n):
        home = root / f"v{i}"
        keyset = init_home(home, binary)
        infos.append(
            ValidatorInfo(
                index=i,
                moniker=f"v{i}",
                home=home,
                pub_key=consensus_pubkey(home),
                power=powers[i] if i < n_genesis else 0,
                node_id=node_id_from_key_file(home / "config" / "node_key.json"),
                ports=Ports(*ports[5 * i : 5 * i + 5]),
                keys=keyset.public_summary(),
                db_url=db_urls[i] if db_urls else f"sqlite:///{home}/data/planetserve.db",
            )
        )

    genesis = genesis_doc(chain_id, genesis_time, infos, max_block_bytes)
    if app_state_fn is not None:
        genesis["app_state"] = app_state_fn(infos)
    genesis_text = json.dumps(genesis, indent=2) + "\n"

    for info in infos:
        edits = node_config(
            moniker=info.moniker, proxy_app="kvstore" if use_kvstore else info.abci_address.proxy_app,
            rpc=f"127.0.0.1:{info.ports.rpc}", p2p=f"127.0.0.1:{info.ports.p2p}",
            peers=[o.p2p_address for o in infos if o.index != info.index], log_level=log_level,
            local=True, metrics=f"127.0.0.1:{info.ports.cometbft_metrics}")
        edits["consensus"] = {"timeout_commit": timeout_commit, "create_empty_blocks": True}
        for sec, kv in (extra_config or {}).items():
            edits.setdefault(sec, {}).update(kv)
        write_home(info.home, genesis_text, edits, abci_listen=info.abci_listen, db_url=info.db_url,
                   chain_id=chain_id, keep_heights=keep_heights, snapshot_interval=snapshot_interval,
                   retain_blocks=retain_blocks, metrics_listen=f"127.0.0.1:{info.ports.app_metrics}")

    spec = NetworkSpec(
        root=root, chain_id=chain_id, genesis_time=genesis_time, validators=infos, kvstore=use_kvstore
    )
    spec.save()
    return spec


def init_home(home: Path, binary: str) -> KeySet:
    """`cometbft init` in an empty `home` (node and consensus keys), and the planetserve KeySet."""
    if home.exists() and any(home.iterdir()):
        raise NetworkBuildError(f"{home} already exists and is not empty")
    res = subprocess.run([binary, "init", "--home", str(home)], capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise NetworkBuildError(f"cometbft init failed for {home}: {res.stderr.strip()[-500:]}")
    keyset = KeySet.generate()
    keyset.save(home / "config" / KEYS_FILE)
    return keyset


def node_config(*, moniker: str, proxy_app: str, rpc: str, p2p: str, peers: Sequence[str],
                log_level: str, local: bool, external: str = "",
                metrics: str = "") -> dict[str, dict[str, Any]]:
    """config.toml edits for one node. `local`: several nodes share one address (one machine), so
    CometBFT must accept duplicate IPs and unroutable addresses. `metrics`: where CometBFT serves its
    Prometheus metrics (host:port; empty: it serves none)."""
    return {
        "": {"moniker": moniker, "proxy_app": proxy_app, "log_level": log_level},
        "rpc": {"laddr": f"tcp://{rpc}", "pprof_laddr": ""},
        "p2p": {"laddr": f"tcp://{p2p}", "external_address": external, "persistent_peers": ",".join(peers),
                "addr_book_strict": not local, "allow_duplicate_ip": local, "pex": False},
        "instrumentation": {"prometheus": bool(metrics), "prometheus_listen_addr": metrics or ":26660"},
    }


def write_home(home: Path, genesis_text: str, edits: dict[str, dict[str, Any]], *, abci_listen: str,
               db_url: str, chain_id: str, keep_heights: int = 0,
               snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL, retain_blocks: int = 0,
               metrics_listen: str = "") -> None:
    """The shared genesis, the edited config.toml and planetserve.json in an initialised home
    (`keep_heights`: how many recent heights the app keeps provable, 0 for all; `snapshot_interval`:
    heights between state sync snapshots, 0 for none; `retain_blocks`: blocks kept, 0 for all;
    `metrics_listen`: where the app serves its Prometheus metrics, empty for nowhere)."""
    cfg = home / "config"
    (cfg / "genesis.json").write_text(genesis_text)
    toml_path = cfg / "config.toml"
    toml_path.write_text(edit_toml(toml_path.read_text(), edits))
    app_cfg = {"abci_listen": abci_listen, "db": db_url, "chain_id": chain_id, "keep_heights": keep_heights,
               "snapshot_interval": snapshot_interval, "snapshot_keep": SNAPSHOT_KEEP,
               "retain_blocks": retain_blocks, "metrics_listen": metrics_listen}
    write_private(cfg / APP_CONFIG_FILE, json.dumps(app_cfg, indent=2) + "\n")  # the database URL
    (home / "logs").mkdir(exist_ok=True)


@dataclass(frozen=True)
class JoiningNode:
    """A home made to join a running network: what its operator hands to the committee."""

    home: Path
    chain_id: str
    node_id: str
    consensus_key: bytes
    keys: dict[str, str]
    """KeySet.public_summary(): the operator (identity), VRF and X25519 keys, hex."""
    abci: AbciAddress
    """Where its app listens."""


def default_abci(home: Path) -> AbciAddress:
    """The app's Unix socket in `home` (absolute), or ABCI_TCP when that path is too long for one."""
    path = home / ABCI_SOCKET
    return UnixAddress(path) if fits_socket(path) else ABCI_TCP


def join_home(home: Path, genesis_path: Path, peers: Sequence[str], *, moniker: str,
              rpc: str = "127.0.0.1:26657", p2p: str = "0.0.0.0:26656", abci: AbciAddress | None = None,
              external: str = "", db_url: str = "", local: bool = False,
              log_level: str = "state:info,*:error", keep_heights: int = 0,
              snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL, retain_blocks: int = 0,
              state_sync: StateSync | None = None, metrics: str = "", app_metrics: str = "") -> JoiningNode:
    """A full node's home for the network of `genesis_path` (another institution's copy of it),
    following `peers` (node_id@host:port). Once it has synced (from genesis, or from a snapshot with
    `state_sync`), the committee can admit it. `abci`: where its app listens (default: `default_abci`).
    `metrics`, `app_metrics`: where CometBFT and the app serve their Prometheus metrics (host:port;
    empty: nowhere)."""
    try:
        genesis_text = genesis_path.read_text()
        chain_id = json.loads(genesis_text)["chain_id"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise NetworkBuildError(f"{genesis_path} is not a readable genesis file: {exc}") from exc
    for peer in peers:
        if not re.fullmatch(r"[0-9a-f]{40}@[^@\s]+:\d{1,5}", peer):
            raise NetworkBuildError(f"peer {peer!r} is not node_id@host:port (node_id: 40 hex digits)")
    if not peers:
        raise NetworkBuildError("a joining node needs at least one peer of the network (node_id@host:port)")
    home = home.absolute()
    abci = abci or default_abci(home)
    keyset = init_home(home, cometbft_binary())
    edits = node_config(moniker=moniker, proxy_app=abci.proxy_app, rpc=rpc, p2p=p2p, peers=peers,
                        log_level=log_level, local=local, external=external, metrics=metrics)
    if state_sync is not None:
        edits["statesync"] = state_sync.config()
    write_home(home, genesis_text, edits, abci_listen=str(abci),
               db_url=db_url or f"sqlite:///{home}/data/planetserve.db", chain_id=chain_id,
               keep_heights=keep_heights, snapshot_interval=snapshot_interval, retain_blocks=retain_blocks,
               metrics_listen=app_metrics)
    return JoiningNode(home, chain_id, node_id_from_key_file(home / "config" / "node_key.json"),
                       consensus_pubkey(home), keyset.public_summary(), abci)


def genesis_doc(
    chain_id: str, genesis_time: str, infos: Sequence[ValidatorInfo], max_block_bytes: int
) -> dict[str, Any]:
    """The genesis document (without app_state) for the validators with positive power."""
    return {
        "genesis_time": genesis_time,
        "chain_id": chain_id,
        "initial_height": "1",
        "consensus_params": {
            "block": {"max_bytes": str(max_block_bytes), "max_gas": "-1"},
            "evidence": {
                "max_age_num_blocks": "100000",
                "max_age_duration": "172800000000000",
                "max_bytes": "1048576",
            },
            "validator": {"pub_key_types": ["ed25519"]},
            "version": {"app": "0"},
            "abci": {"vote_extensions_enable_height": "0"},
        },
        "validators": [
            {
                "address": info.address.hex().upper(),
                "pub_key": {
                    "type": "tendermint/PubKeyEd25519",
                    "value": base64.b64encode(info.pub_key).decode(),
                },
                "power": str(info.power),
                "name": info.moniker,
            }
            for info in infos
            if info.power > 0
        ],
        "app_hash": "",
    }
