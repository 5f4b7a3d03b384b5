"""The localnet's processes besides the validators: a verifier daemon beside each validator, the model
nodes, the user relays, the client's relay and the dashboard beside it. Each has a home under the
network's root, made once the way `planetserve verifier init`, `node init-model` and `node init-user`
make them:

    <root>/verifiers/v<i>    beside validator v<i>        process `verifier`
    <root>/nodes/<name>      a model node                 process `node`
    <root>/relays/relay<i>   a user relay                 process `relay`
    <root>/relays/client     the client's relay           process `relay`
    <root>/dashboard         the dashboard (dashboard.json: its address)   process `dashboard`
    <root>/keys/<org>.json   each organisation's key (registers its nodes)

and runs as `planetserve verifier run`, `node model --org-keys`, `node user`, `dashboard`, recorded
with `processes` (pids in the home's pids.json, output in its logs/).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from planetserve.chain.keys import KeySet
from planetserve.genesis.network import KEYS_FILE as MEMBER_KEYS_FILE
from planetserve.genesis.network import NetworkSpec, free_ports
from planetserve.localnet import processes
from planetserve.localnet.config import CLOVES, LocalnetConfig, NodeSpec
from planetserve.node.home import ModelNodeConfig, UserConfig, init_home, load_keys

VERIFIERS, NODES, RELAYS, KEYS = "verifiers", "nodes", "relays", "keys"
CLIENT = "client"
LIST_INTERVAL = 2.0
"""Seconds between re-reads of the verified lists by nodes and relays (a localnet changes fast)."""
KINDS = {VERIFIERS: "verifier", NODES: "node", RELAYS: "relay"}
"""Directory of a role's homes → the name its process is recorded under."""
DASHBOARD = "dashboard"
"""The dashboard's home (directly under the root) and the name its process is recorded under."""
DASHBOARD_FILE = "dashboard.json"


class RoleError(Exception):
    """A role process failed to start or to become ready; the message names its log."""


@dataclass(frozen=True)
class Role:
    kind: str
    """verifier, node, relay or dashboard."""
    name: str
    home: Path
    command: tuple[str, ...]

    @property
    def log(self) -> Path:
        return processes.log_path(self.home, self.kind)

    @property
    def running(self) -> bool:
        return processes.running(self.home, self.kind)

    def describe(self) -> str:
        if self.kind == DASHBOARD:
            return DASHBOARD
        return f"{'client relay' if self.name == CLIENT else self.kind} {self.name}"


def planetserve(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "planetserve", *args)


def org_key_path(root: Path, org_id: str) -> Path:
    return root / KEYS / f"{org_id}.json"


def org_keys(root: Path, org_id: str) -> KeySet:
    """The organisation's key, made the first time it is asked for."""
    path = org_key_path(root, org_id)
    if path.exists():
        return KeySet.load(path)
    keys = KeySet.generate()
    path.parent.mkdir(parents=True, exist_ok=True)
    keys.save(path)
    return keys


def _addresses() -> tuple[str, str]:
    http, peer = free_ports(2)
    return f"127.0.0.1:{http}", f"127.0.0.1:{peer}"


# --- homes (made once; an existing home is used as it is) ---------------------------------------


def node_role(root: Path, spec: NetworkSpec, config: LocalnetConfig, index: int, node: NodeSpec) -> Role:
    home = root / NODES / node.name
    if not (home / ModelNodeConfig.FILE).exists():
        http, peer = _addresses()
        validator = spec.validators[index % len(spec.validators)]
        init_home(home, ModelNodeConfig(
            org_id=node.org_id, model_id=node.model_id, model=node.model, rpc=validator.rpc_url,
            genesis=str(spec.genesis_path), http=http, peer=peer, capacity=node.capacity,
            data_dir=str(config.family_dir(root)), behaviour=node.behaviour, list_interval=LIST_INTERVAL))
    org_keys(root, node.org_id)
    return Role("node", node.name, home, planetserve(
        "node", "model", "--home", str(home), "--org-keys", str(org_key_path(root, node.org_id)), "--json"))


def relay_role(root: Path, spec: NetworkSpec, config: LocalnetConfig, index: int, name: str) -> Role:
    home = root / RELAYS / name
    if not (home / UserConfig.FILE).exists():
        http, peer = _addresses()
        if name == CLIENT and config.client_http:
            http = config.client_http
        validator = spec.validators[index % len(spec.validators)]
        init_home(home, UserConfig(rpc=validator.rpc_url, genesis=str(spec.genesis_path), http=http,
                                   peer=peer, proxies=config.proxies, n=CLOVES, list_interval=LIST_INTERVAL))
    return Role("relay", name, home, planetserve("node", "user", "--home", str(home), "--json"))


QUICK_CHAT_SHARE = 0.0
"""The quick family answers every greedy chat with line breaks alone, whoever the model: its verifiers
send completions, which separate the models (tests/test_verifier_network.py)."""


def verifier_role(root: Path, spec: NetworkSpec, config: LocalnetConfig, index: int, relay: Path) -> Role:
    from planetserve.verifier.config import VerifierConfig  # the verifier package loads torch

    validator = spec.validators[index]
    home = root / VERIFIERS / validator.moniker
    if not (home / VerifierConfig.FILE).exists():
        VerifierConfig(
            keys=str(validator.home / "config" / MEMBER_KEYS_FILE), rpc=validator.rpc_url,
            genesis=str(spec.genesis_path), relay=http_url(UserConfig.load(relay).http),
            models={model_id: model_id for model_id in config.model_ids},
            data_dir=str(config.family_dir(root)), max_tokens=32, challenge_timeout=30.0,
            chat_share=QUICK_CHAT_SHARE if config.preset == "quick" else None,
        ).save(home)
    return Role("verifier", validator.moniker, home, planetserve("verifier", "run", "--home", str(home)))


def dashboard_address(home: Path) -> str | None:
    """The address (host:port) recorded in the dashboard's home, None before it is made."""
    try:
        body = json.loads((home / DASHBOARD_FILE).read_text())
    except (OSError, ValueError):
        return None
    return body.get("http") if isinstance(body, dict) and isinstance(body.get("http"), str) else None


def dashboard_role(root: Path, spec: NetworkSpec, config: LocalnetConfig, client: Role,
                   nodes: list[Role]) -> Role:
    """`planetserve dashboard` over every validator's RPC and the client's relay, naming the model nodes
    as the configuration does; its address is picked once (the configured one, else a free port)."""
    home = root / DASHBOARD
    http = dashboard_address(home)
    if http is None:
        http = config.dashboard_http or f"127.0.0.1:{free_ports(1)[0]}"
        home.mkdir(parents=True, exist_ok=True)
        (home / DASHBOARD_FILE).write_text(json.dumps({"http": http}) + "\n")
    rpc = [arg for v in spec.validators for arg in ("--rpc", v.rpc_url)]
    labels = [arg for n in nodes for arg in ("--label", f"{node_key(n.home).hex()}={n.name}")]
    return Role(DASHBOARD, DASHBOARD, home, planetserve(
        "dashboard", "--genesis", str(spec.genesis_path), *rpc,
        "--relay", http_url(UserConfig.load(client.home).http), "--model", config.client_model, *labels,
        "--http", http, "--json"))


def roles(root: Path, spec: NetworkSpec, config: LocalnetConfig) -> list[Role]:
    """Every role of the configuration, homes made where missing: model nodes, relays (the client's
    first), verifiers, and the dashboard beside the client's relay."""
    nodes = [node_role(root, spec, config, i, node) for i, node in enumerate(config.nodes)]
    out = list(nodes)
    names = ([CLIENT] if config.has_client else []) + [f"relay{i}" for i in range(config.relays)]
    relays = [relay_role(root, spec, config, i, name) for i, name in enumerate(names)]
    out += relays
    carriers = [r for r in relays if r.name != CLIENT]
    if config.verifiers:
        out += [verifier_role(root, spec, config, i, carriers[i % len(carriers)].home)
                for i in range(len(spec.validators))]
    if config.has_client:
        out.append(dashboard_role(root, spec, config, relays[0], nodes))
    return out


def existing_homes(root: Path) -> list[tuple[str, Path]]:
    """Every role home under `root` (kind, home), whatever the configuration says now."""
    homes = [(kind, home) for directory, kind in KINDS.items()
             for home in sorted((root / directory).glob("*")) if home.is_dir()]
    if (root / DASHBOARD).is_dir():
        homes.append((DASHBOARD, root / DASHBOARD))
    return homes


# --- processes ---------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    """Unbuffered output for the logs; one math thread per process unless the caller chose otherwise,
    since a localnet runs many model processes on the same cores."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start(role: Role) -> subprocess.Popen | None:
    """Start the role's process unless it is running; the new process, or None."""
    if role.running:
        return None
    return processes.spawn(role.home, role.kind, list(role.command), child_env())


def stop(root: Path, timeout: float = 15.0) -> None:
    """Stop every role process recorded under `root`, all at once."""
    processes.stop_recorded([home for _, home in existing_homes(root)], timeout=timeout)


def http_url(address: str) -> str:
    return f"http://{address}"


def http_status(address: str, timeout: float = 3.0) -> dict[str, Any] | None:
    """A node's or relay's /v1/planetserve/status, or None when it does not answer."""
    try:
        reply = httpx.get(f"{http_url(address)}/v1/planetserve/status", timeout=timeout)
    except httpx.HTTPError:
        return None
    return reply.json() if reply.status_code == 200 else None


def dashboard_serving(home: Path, timeout: float = 3.0) -> bool:
    """Whether the dashboard recorded in `home` answers its health check."""
    from planetserve.dashboard import HEALTH_PATH

    address = dashboard_address(home)
    if address is None:
        return False
    try:
        return httpx.get(f"{http_url(address)}{HEALTH_PATH}", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def verifier_status(home: Path) -> dict[str, Any] | None:
    from planetserve.verifier.config import STATUS_FILE

    try:
        body = json.loads((home / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def ready(role: Role) -> bool:
    """Whether the role's process is serving: a node or relay answers its status endpoint (the client's
    relay with enough live paths for a message), a verifier has ticked since it was started."""
    if role.kind == "verifier":
        status = verifier_status(role.home)
        since = processes.started_at(role.home, role.kind) or 0
        return status is not None and int(status.get("started", 0)) >= since - 1
    if role.kind == DASHBOARD:
        return dashboard_serving(role.home)
    config = (ModelNodeConfig if role.kind == "node" else UserConfig).load(role.home)
    status = http_status(config.http)
    if status is None:
        return False
    return role.name != CLIENT or len(status.get("paths", ())) >= CLOVES


def wait_ready(roles: list[Role], timeout: float, on_wait: Any = None) -> None:
    """Until every role is ready; RoleError names the first one that stopped or timed out, and its log."""
    deadline = time.monotonic() + timeout
    waiting = list(roles)
    while waiting:
        for role in list(waiting):
            if not role.running:
                raise RoleError(f"{role.describe()} stopped before it was ready; see {role.log}"
                                f"{log_tail(role.log)}")
            if ready(role):
                waiting.remove(role)
        if on_wait is not None and waiting:
            on_wait(waiting)
        if waiting and time.monotonic() > deadline:
            names = ", ".join(r.describe() for r in waiting)
            raise RoleError(f"not ready after {timeout:g} s: {names}; see {waiting[0].log}"
                            f"{log_tail(waiting[0].log)}")
        time.sleep(0.5)


def log_tail(path: Path, lines: int = 8) -> str:
    """The end of a log, indented, for an error message ('' when there is none)."""
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()[-lines:]
    except OSError:
        return ""
    return "".join(f"\n  | {line[:300]}" for line in text)


def node_key(home: Path) -> bytes:
    return load_keys(home).public
