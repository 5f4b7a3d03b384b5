"""What a localnet's processes record in their homes and answer when asked: read by `up` to tell when
each is ready and by `status` to tell how each is doing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from planetserve.chain.client import LedgerClient
from planetserve.chain.lightclient import LightClient
from planetserve.chain.rpc import RpcClient
from planetserve.genesis.network import NetworkSpec
from planetserve.localnet.processes import read_object
from planetserve.node.home import load_keys

DASHBOARD_FILE = "dashboard.json"
"""In the dashboard's home: the address it serves on, picked once."""


def http_url(address: str) -> str:
    return f"http://{address}"


def http_status(address: str, timeout: float = 3.0) -> dict[str, Any] | None:
    """A node's or relay's /v1/planetserve/status, or None when it does not answer."""
    try:
        reply = httpx.get(f"{http_url(address)}/v1/planetserve/status", timeout=timeout)
    except httpx.HTTPError:
        return None
    return reply.json() if reply.status_code == 200 else None


def dashboard_address(home: Path) -> str | None:
    """The address (host:port) recorded in the dashboard's home, None before it is made."""
    body = read_object(home / DASHBOARD_FILE)
    return body.get("http") if body is not None and isinstance(body.get("http"), str) else None


def dashboard_serving(address: str, timeout: float = 3.0) -> bool:
    """Whether the dashboard at `address` answers its health check."""
    from planetserve.dashboard import HEALTH_PATH

    try:
        return httpx.get(f"{http_url(address)}{HEALTH_PATH}", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def verifier_status(home: Path) -> dict[str, Any] | None:
    from planetserve.verifier.config import STATUS_FILE

    return read_object(home / STATUS_FILE)


def node_key(home: Path) -> bytes:
    return load_keys(home).public


def ledger_for(spec: NetworkSpec, index: int = 0) -> LedgerClient:
    """The verified ledger, read through validator `index`."""
    rpc = RpcClient(spec.validators[index].rpc_url)
    return LedgerClient(rpc, LightClient.from_genesis_file(spec.genesis_path, rpc))
