"""`make localnet`: four validators of one planetserve chain on 127.0.0.1, with demo registrations.

State lives under `localnet/build/` (ignored by git). Running `up` again reuses what is there:
stopped processes are restarted, running ones are left alone.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

from planetserve.chain.client import LedgerClient
from planetserve.chain.keys import KeySet
from planetserve.chain.lightclient import LightClient
from planetserve.chain.rpc import RpcClient, RpcError
from planetserve.genesis.committee import app_state_builder
from planetserve.genesis.network import SPEC_FILE, NetworkSpec, ValidatorInfo, build_network
from planetserve.localnet.cluster import Cluster, stop_all
from planetserve.registry.entities import ModelNode

DEFAULT_ROOT = Path("localnet/build")
CHAIN_ID = "planetserve-localnet"
MODELS = (("gt", "planetserve reference model"),)
DEMO_ORG = "demo-org"
DEMO_NODES = (("gt", "127.0.0.1:7101", "cpu-2core", "local"), ("gt", "127.0.0.1:7102", "cpu-2core", "local"))


def app_command(home: Path) -> list[str]:
    """The command line of a validator's ABCI app."""
    return [sys.executable, "-m", "planetserve", "chain", "app", "--home", str(home)]


def cluster_app(info: ValidatorInfo) -> list[str]:
    """`app_command` in the form a Cluster asks for."""
    return app_command(info.home)


@dataclass(frozen=True)
class ValidatorStatus:
    moniker: str
    rpc_url: str
    app_running: bool
    cometbft_running: bool
    height: int | None
    app_hash: str | None


def load_or_build(root: Path, validators: int) -> NetworkSpec:
    if (root / SPEC_FILE).exists():
        return NetworkSpec.load(root)
    return build_network(root, validators, CHAIN_ID, app_state_builder(MODELS), timeout_commit="1s")


def up(root: Path = DEFAULT_ROOT, validators: int = 4) -> tuple[NetworkSpec, list[ModelNode], int]:
    """Start (or resume) the network, register the demo organisation and nodes once, and return
    the verified node list of model gt with the height it was verified at."""
    spec = load_or_build(root.absolute(), validators)
    cluster = Cluster(spec, cluster_app, start_timeout=60.0)
    cluster.start()
    cluster.wait_for_height(2, timeout=90.0)
    ledger = ledger_for(spec)
    seed_demo(root.absolute(), ledger)
    listing, nodes = ledger.nodes("gt")
    return spec, nodes, listing.height


def ledger_for(spec: NetworkSpec, index: int = 0) -> LedgerClient:
    rpc = RpcClient(spec.validators[index].rpc_url)
    return LedgerClient(rpc, LightClient.from_genesis_file(spec.genesis_path, rpc))


def _keys(path: Path) -> KeySet:
    if path.exists():
        return KeySet.load(path)
    keys = KeySet.generate()
    keys.save(path)
    return keys


def seed_demo(root: Path, ledger: LedgerClient) -> None:
    """Register the demo organisation and its model nodes unless already there."""
    org_keys = _keys(root / "keys" / "demo-org.json")
    if ledger.org(DEMO_ORG) is None:
        ledger.submit(org_keys, "register-org", {"org_id": DEMO_ORG, "name": "Demo organisation"})
    for i, (model_id, address, hardware, region) in enumerate(DEMO_NODES):
        node = _keys(root / "keys" / f"demo-node-{i}.json")
        if ledger.node(node.public) is not None:
            continue
        ledger.submit(org_keys, "register-model-node", ledger.model_node_body(
            DEMO_ORG, node, model_id=model_id, address=address, hardware=hardware, capacity=8,
            region=region))


def down(root: Path = DEFAULT_ROOT) -> bool:
    """Stop every process of the network; False when there is no network under root."""
    if not (root / SPEC_FILE).exists():
        return False
    stop_all(root.absolute())
    return True


def status(root: Path = DEFAULT_ROOT) -> list[ValidatorStatus]:
    spec = NetworkSpec.load(root.absolute())
    cluster = Cluster(spec, cluster_app)
    out = []
    for v in spec.validators:
        running = cluster.running(v.index)
        height = app_hash = None
        with contextlib.suppress(RpcError):
            info = cluster.status(v.index)["sync_info"]
            height, app_hash = int(info["latest_block_height"]), info["latest_app_hash"]
        out.append(
            ValidatorStatus(v.moniker, v.rpc_url, running["app"], running["cometbft"], height, app_hash)
        )
    return out
