"""The localnet's processes besides the validators: a verifier daemon beside each validator, the model
nodes, the user relays, the client's relay and the dashboard beside it. Each has a home where the plan
places it (`plan`), made once the way `planetserve verifier init`, `node init-model` and `node init-user`
make them (the dashboard's holds dashboard.json, its address), and runs as `planetserve verifier run`,
`node model --org-keys`, `node user`, `dashboard`, recorded with `processes` (pids in the home's
pids.json, output in its logs/).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from planetserve.chain.keys import KeySet
from planetserve.genesis.network import KEYS_FILE as MEMBER_KEYS_FILE
from planetserve.genesis.network import free_ports
from planetserve.localnet import processes
from planetserve.localnet.config import CLOVES, NodeSpec
from planetserve.localnet.plan import CLIENT, DASHBOARD, Plan, existing_homes
from planetserve.localnet.probes import (
    DASHBOARD_FILE,
    dashboard_address,
    dashboard_serving,
    http_status,
    http_url,
    verifier_status,
)
from planetserve.node.home import ModelNodeConfig, UserConfig, init_home, load_keys

LIST_INTERVAL = 2.0
"""Seconds between re-reads of the verified lists by nodes and relays (a localnet changes fast)."""


class RoleError(Exception):
    """A role process failed to start or to become ready; the message names its log."""


@dataclass(frozen=True)
class Role:
    kind: str
    """verifier, node, relay or dashboard."""
    name: str
    home: Path
    command: tuple[str, ...]
    http: str = ""
    """Where it serves HTTP (host:port), as its home says; empty for a verifier."""
    key: bytes = b""
    """A model node's public key; empty for the others."""

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


# --- homes (made once; an existing home is used as it is) ---------------------------------------

Config = TypeVar("Config", ModelNodeConfig, UserConfig)


def _home(home: Path, kind: type[Config], make: Callable[[str, str], Config]) -> tuple[Config, KeySet]:
    """The configuration and key of a node's or relay's home, made the first time by `make(http, peer)`
    with free ports, its metrics served on a third."""
    if (home / kind.FILE).exists():
        return kind.load(home), load_keys(home)
    http, peer, metrics = free_ports(3)
    config = replace(make(f"127.0.0.1:{http}", f"127.0.0.1:{peer}"), metrics=f"127.0.0.1:{metrics}")
    return config, init_home(home, config)


def node_role(plan: Plan, index: int, node: NodeSpec) -> Role:
    home = plan.node_home(node.name)
    validator = plan.validator(index)
    config, keys = _home(home, ModelNodeConfig, lambda http, peer: ModelNodeConfig(
        org_id=node.org_id, model_id=node.model_id, model=node.model, rpc=validator.rpc_url,
        genesis=str(plan.spec.genesis_path), http=http, peer=peer, capacity=node.capacity,
        data_dir=str(plan.family_dir), behaviour=node.behaviour, list_interval=LIST_INTERVAL))
    return Role("node", node.name, home, planetserve(
        "node", "model", "--home", str(home), "--org-keys", str(plan.org_key_path(node.org_id)), "--json"),
        http=config.http, key=keys.public)


def relay_role(plan: Plan, index: int, name: str) -> Role:
    home = plan.relay_home(name)
    validator = plan.validator(index)
    client_http = plan.config.client_http if name == CLIENT else ""
    config, _ = _home(home, UserConfig, lambda http, peer: UserConfig(
        rpc=validator.rpc_url, genesis=str(plan.spec.genesis_path), http=client_http or http, peer=peer,
        proxies=plan.config.proxies, n=CLOVES, list_interval=LIST_INTERVAL,
        path_lifetime=float(plan.config.path_lifetime)))
    return Role("relay", name, home, planetserve("node", "user", "--home", str(home), "--json"),
                http=config.http)


QUICK_CHAT_SHARE = 0.0
"""The quick family answers every greedy chat with line breaks alone, whoever the model: its verifiers
send completions, which separate the models (tests/test_verifier_network.py)."""


def verifier_role(plan: Plan, index: int, relay: Role) -> Role:
    from planetserve.verifier.config import VerifierConfig  # the verifier package loads torch

    validator = plan.spec.validators[index]
    home = plan.verifier_home(validator)
    if not (home / VerifierConfig.FILE).exists():
        VerifierConfig(
            keys=str(validator.home / "config" / MEMBER_KEYS_FILE), rpc=validator.rpc_url,
            genesis=str(plan.spec.genesis_path), relay=http_url(relay.http),
            models={model_id: model_id for model_id in plan.config.model_ids},
            data_dir=str(plan.family_dir), max_tokens=32, challenge_timeout=30.0,
            chat_share=QUICK_CHAT_SHARE if plan.config.preset == "quick" else None,
            metrics=f"127.0.0.1:{free_ports(1)[0]}",
        ).save(home)
    return Role("verifier", validator.moniker, home, planetserve("verifier", "run", "--home", str(home)))


def dashboard_role(plan: Plan, client: Role, nodes: list[Role]) -> Role:
    """`planetserve dashboard` over every validator's RPC and the client's relay, naming the model nodes
    as the configuration does; its address is picked once (the configured one, else a free port)."""
    home = plan.dashboard_home
    http = dashboard_address(home)
    if http is None:
        http = plan.config.dashboard_http or f"127.0.0.1:{free_ports(1)[0]}"
        home.mkdir(parents=True, exist_ok=True)
        (home / DASHBOARD_FILE).write_text(json.dumps({"http": http}) + "\n")
    rpc = [arg for v in plan.spec.validators for arg in ("--rpc", v.rpc_url)]
    labels = [arg for n in nodes for arg in ("--label", f"{n.key.hex()}={n.name}")]
    return Role(DASHBOARD, DASHBOARD, home, planetserve(
        "dashboard", "--genesis", str(plan.spec.genesis_path), *rpc, "--relay", http_url(client.http),
        "--model", plan.config.client_model, *labels, "--http", http, "--json"), http=http)


def roles(plan: Plan) -> list[Role]:
    """Every role of the plan, homes made where missing: model nodes, relays (the client's first),
    verifiers, and the dashboard beside the client's relay."""
    nodes = [node_role(plan, i, node) for i, node in enumerate(plan.config.nodes)]
    relays = [relay_role(plan, i, name) for i, name in enumerate(plan.relay_names)]
    out = nodes + relays
    carriers = [r for r in relays if r.name != CLIENT]
    if plan.config.verifiers:
        out += [verifier_role(plan, i, carriers[i % len(carriers)]) for i in range(len(plan.spec.validators))]
    if plan.config.has_client:
        out.append(dashboard_role(plan, relays[0], nodes))
    return out


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


def ready(role: Role) -> bool:
    """Whether the role's process is serving: a node or relay answers its status endpoint (the client's
    relay with enough live paths for a message), a verifier has ticked since it was started."""
    if role.kind == "verifier":
        status = verifier_status(role.home)
        since = processes.started_at(role.home, role.kind) or 0
        return status is not None and int(status.get("started", 0)) >= since - 1
    if role.kind == DASHBOARD:
        return dashboard_serving(role.http)
    status = http_status(role.http)
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
