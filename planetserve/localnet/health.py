"""`planetserve localnet status`: each process of a localnet and how it is doing, read from the
directory alone (pid files, homes, status files) and from what the processes and the ledger answer."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from planetserve.chain.client import QueryRefused
from planetserve.chain.lightclient import VerificationError
from planetserve.chain.rpc import RpcClient, RpcError
from planetserve.genesis.network import NetworkSpec
from planetserve.localnet import processes
from planetserve.localnet.plan import CLIENT, DASHBOARD, existing_homes
from planetserve.localnet.probes import (
    dashboard_address,
    dashboard_serving,
    http_status,
    http_url,
    ledger_for,
    node_key,
    verifier_status,
)
from planetserve.node.home import HomeError, ModelNodeConfig, UserConfig

GROUPS = ("validators", "verifiers", "nodes", "relays", "dashboards")
LEDGER_ERRORS = (RpcError, VerificationError, QueryRefused, OSError)


def status(root: Path) -> dict[str, list[dict[str, Any]]]:
    """Every process of the localnet under `root` by group (GROUPS); each entry has at least `name`,
    `up` (its process runs) and `log`. Raises FileNotFoundError when there is no network there."""
    root = root.absolute()
    spec = NetworkSpec.load(root)
    homes = existing_homes(root)
    return {
        "validators": validators(spec),
        "verifiers": [verifier(home) for kind, home in homes if kind == "verifier"],
        "nodes": nodes(spec, [home for kind, home in homes if kind == "node"]),
        "relays": [relay(home) for kind, home in homes if kind == "relay"],
        "dashboards": [dashboard(home) for kind, home in homes if kind == DASHBOARD],
    }


def validators(spec: NetworkSpec) -> list[dict[str, Any]]:
    out = []
    for v in spec.validators:
        app, cometbft = processes.running(v.home, "app"), processes.running(v.home, "cometbft")
        height = app_hash = None
        with contextlib.suppress(RpcError), RpcClient(v.rpc_url, timeout=2.0) as rpc:
            info = rpc.status()["sync_info"]
            height, app_hash = int(info["latest_block_height"]), info["latest_app_hash"]
        out.append({"name": v.moniker, "up": app and cometbft, "rpc": v.rpc_url, "app": app,
                    "cometbft": cometbft, "height": height, "app_hash": app_hash,
                    "log": str(v.home / "logs")})
    return out


def _base(kind: str, home: Path) -> dict[str, Any]:
    return {"name": home.name, "up": processes.running(home, kind),
            "log": str(processes.log_path(home, kind))}


def verifier(home: Path) -> dict[str, Any]:
    state = verifier_status(home) or {}
    return {**_base("verifier", home), "height": state.get("height"), "epoch": state.get("epoch"),
            "leader": state.get("leader"), "ticks": state.get("ticks"), "last_tick": state.get("updated"),
            "submitted": state.get("submitted"), "rejected": state.get("rejected"),
            "last_error": state.get("last_error")}


def relay(home: Path) -> dict[str, Any]:
    entry = {**_base("relay", home), "client": home.name == CLIENT, "http": None, "live_paths": None,
             "relayed_paths": None, "distinct_proxies": None, "rotations": None}
    with contextlib.suppress(HomeError):
        config = UserConfig.load(home)
        entry["http"] = http_url(config.http) + "/v1"
        state = http_status(config.http) if entry["up"] else None
        if state is not None:
            entry.update(live_paths=len(state.get("paths", ())), relayed_paths=state.get("relayed_paths"),
                         distinct_proxies=state.get("distinct_proxies"), rotations=state.get("rotations"))
    return entry


def dashboard(home: Path) -> dict[str, Any]:
    address = dashboard_address(home)
    url = None if address is None else http_url(address) + "/"
    entry = {**_base(DASHBOARD, home), "url": url}
    entry["serving"] = entry["up"] and address is not None and dashboard_serving(address)
    return entry


def nodes(spec: NetworkSpec, homes: list[Path]) -> list[dict[str, Any]]:
    """Model nodes, with their standing on the ledger (trusted, reputation) when it can be read."""
    out = []
    for home in homes:
        entry = {**_base("node", home), "key": None, "model": None, "model_id": None, "behaviour": None,
                 "org": None, "http": None, "serving": False, "trusted": None, "reputation": None}
        with contextlib.suppress(HomeError, OSError, ValueError):
            config = ModelNodeConfig.load(home)
            entry.update(key=node_key(home).hex(), model=config.model, model_id=config.model_id,
                         behaviour=config.behaviour, org=config.org_id, http=http_url(config.http))
            entry["serving"] = entry["up"] and http_status(config.http) is not None
        out.append(entry)
    with contextlib.suppress(*LEDGER_ERRORS):
        _standing(spec, [e for e in out if e["key"]])
    return out


def _standing(spec: NetworkSpec, entries: list[dict[str, Any]]) -> None:
    ledger = ledger_for(spec)
    with ledger.snapshot():
        trusted = set()
        for model_id in sorted({e["model_id"] for e in entries}):
            trusted |= {n.pubkey.hex() for n in ledger.nodes(model_id)[1]}
        initial = ledger.params().initial_reputation_ppm
        for entry in entries:
            record = ledger.reputation(bytes.fromhex(entry["key"]))
            entry["trusted"] = entry["key"] in trusted
            entry["reputation"] = record.value if record is not None else initial
            entry["scored_epochs"] = record.epochs if record is not None else 0
