"""State sync and block retention on a real four-validator network: a fifth node made with
`planetserve chain init --state-sync` joins past height 500 from a snapshot, reaches the others' app
hashes and answers verified queries, while the validators' block stores drop old blocks (all but v1's,
an archive: a light client bootstraps from the genesis only where the blocks since it are kept)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from chainnet import LISTED_AT_ONCE, MODELS, fast_config
from click.testing import CliRunner
from harness import relaxed
from promscrape import scrape, value
from waiting import wait_until

from planetserve.chain.client import LedgerClient, sign
from planetserve.chain.keys import KeySet
from planetserve.chain.lightclient import LightClient
from planetserve.chain.messages import RegisterUser
from planetserve.chain.rpc import RpcClient
from planetserve.cli import main
from planetserve.genesis.committee import app_state_builder
from planetserve.genesis.network import (
    APP_CONFIG_FILE,
    NetworkSpec,
    Ports,
    ValidatorInfo,
    build_network,
    consensus_pubkey,
    free_ports,
)
from planetserve.localnet.cluster import Cluster
from planetserve.localnet.net import cluster_app

pytestmark = pytest.mark.network

INTERVAL = 100
"""Heights between the validators' snapshots."""
RETAIN = 150
JOIN_AFTER = 500
CHUNK_BYTES = 8 << 10
"""Small chunks, so that the snapshot travels in several."""
ARCHIVE = 1
"""The validator that keeps every block."""
FAST = fast_config({"consensus": {"timeout_propose": "1s"}})
"""About 15 blocks a second here instead of 2.5 (chainnet.FAST_P2P), with timeout_commit 10 ms."""


def network(root: Path) -> Cluster:
    spec = build_network(root, 4, "planetserve-sync", app_state_builder(MODELS, relaxed(LISTED_AT_ONCE)),
                         timeout_commit="10ms", snapshot_interval=INTERVAL, retain_blocks=RETAIN,
                         extra_config=FAST)
    for v in spec.validators:
        path = v.home / "config" / APP_CONFIG_FILE
        config = {**json.loads(path.read_text()), "snapshot_chunk_bytes": CHUNK_BYTES}
        path.write_text(json.dumps({**config, "retain_blocks": 0} if v.index == ARCHIVE else config))
    cluster = Cluster(spec, cluster_app, start_timeout=60.0)
    cluster.start()
    return cluster


def joiner(cluster: Cluster, root: Path) -> Cluster:
    """v4's home made by the CLI, as an operator would, and a cluster of that one node."""
    rpc, p2p, abci, metrics, app_metrics = free_ports(5)
    home = root / "v4"
    peers = [f"{v.node_id}@127.0.0.1:{v.ports.p2p}" for v in cluster.validators]
    result = CliRunner().invoke(main, [
        "chain", "init", "--home", str(home), "--genesis", str(cluster.spec.genesis_path),
        *(a for p in peers for a in ("--peer", p)), "--moniker", "v4", "--local",
        "--p2p", f"127.0.0.1:{p2p}", "--rpc", f"127.0.0.1:{rpc}", "--abci", f"127.0.0.1:{abci}",
        "--metrics", f"127.0.0.1:{metrics}", "--app-metrics", f"127.0.0.1:{app_metrics}",
        "--state-sync", cluster.rpc_url(ARCHIVE), "--state-sync", cluster.rpc_url(2), "--json"],
        catch_exceptions=False)
    assert result.exit_code == 0, result.output
    made = json.loads(result.output)
    assert made["state_sync"]["height"] > JOIN_AFTER
    info = ValidatorInfo(index=0, moniker="v4", home=home, pub_key=consensus_pubkey(home), power=0,
                         node_id=made["node_id"], ports=Ports(rpc, p2p, abci, metrics, app_metrics),
                         db_url=f"sqlite:///{home}/data/planetserve.db")
    spec = NetworkSpec(root=root, chain_id=cluster.spec.chain_id, genesis_time=cluster.spec.genesis_time,
                       validators=[info], kvstore=False)
    return Cluster(spec, cluster_app, start_timeout=60.0)


def test_a_node_joins_past_height_500_by_state_sync_while_validators_prune_their_blocks(tmp_path: Path) -> None:
    cluster = network(tmp_path)
    late = None
    try:
        cluster.wait_for_height(2, timeout=60)
        ledger = LedgerClient(cluster.rpc(0), LightClient.from_genesis_file(cluster.spec.genesis_path,
                                                                            cluster.rpc(0)))
        users = [KeySet.generate() for _ in range(40)]
        chain_id, params = ledger.chain_id(), ledger.params()
        for i, keys in enumerate(users):
            msg = RegisterUser(f"10.4.0.{i}:9000", "eu").solved(chain_id, keys.public, params)
            assert cluster.rpc(0).broadcast_tx_sync(sign(keys, chain_id, msg, 0)).ok
        wait_until(lambda: all(ledger.user(k.public) for k in users), timeout=60)
        app_metrics, cometbft_metrics = (f"http://127.0.0.1:{port}/metrics" for port in (
            cluster.validators[0].ports.app_metrics, cluster.validators[0].ports.cometbft_metrics))
        early = scrape(app_metrics)
        assert value(early, "planetserve_app_transactions_total", type="register-user", code="0") == len(users)
        assert value(early, "planetserve_app_entities", kind="users") == len(users)
        early_height = value(scrape(cometbft_metrics), "cometbft_consensus_height")
        assert early_height >= 2
        cluster.wait_for_height(JOIN_AFTER + 5, timeout=240)

        # retention: the validators' block stores no longer start at 1, and never after a kept snapshot
        status = cluster.status(0)["sync_info"]
        latest, earliest = int(status["latest_block_height"]), int(status["earliest_block_height"])
        assert 1 < earliest <= latest - RETAIN + 1
        kept = sorted(int(p.name) for p in (cluster.validators[0].home / "data" / "snapshots").iterdir()
                      if p.name.isdigit())
        assert len(kept) == 2 and kept[-1] % INTERVAL == 0 and earliest <= kept[0]
        assert int(cluster.status(ARCHIVE)["sync_info"]["earliest_block_height"]) == 1
        late_metrics = scrape(app_metrics)
        assert value(late_metrics, "planetserve_app_height") > JOIN_AFTER
        assert value(late_metrics, "planetserve_app_snapshot_height") >= kept[-1]
        assert 1 < value(late_metrics, "planetserve_app_retain_height") <= kept[0]
        assert value(scrape(cometbft_metrics), "cometbft_consensus_height") > early_height + JOIN_AFTER // 2

        late = joiner(cluster, tmp_path)
        started = time.monotonic()
        late.start()
        wait_until(lambda: (late.height(0) or 0) >= latest and not late.status(0)["sync_info"]["catching_up"],
              timeout=180)
        synced_in = time.monotonic() - started
        base = int(late.status(0)["sync_info"]["earliest_block_height"])
        assert base > JOIN_AFTER - INTERVAL, "v4 replayed blocks instead of restoring a snapshot"
        app_log = (tmp_path / "v4" / "logs" / "app.log").read_text()
        assert "state sync: restored height" in app_log and "chunks" in app_log

        # the same app hashes as the validators, from its first block on (the archive's: by now the
        # pruning validators may have let those blocks go)
        height = late.height(0) or 0
        for h in (base + 1, height - 1):
            ours = cluster.app_hashes(h, [ARCHIVE])[ARCHIVE]
            assert late.app_hashes(h, [0])[0] == ours, f"app hash differs at {h}"

        # it answers verified queries (its proofs checked against headers verified from the genesis),
        # of state from before its snapshot and of what comes after
        from_v4 = LedgerClient(RpcClient(late.rpc_url(0)), LightClient.from_genesis_file(
            cluster.spec.genesis_path, cluster.rpc(ARCHIVE)))
        with from_v4.snapshot((late.height(0) or 0) - 1):
            assert all(from_v4.user(k.public) is not None for k in users[:5])
        newcomer = KeySet.generate()
        done = ledger.submit(newcomer, RegisterUser("10.4.9.9:9000", "eu"))
        assert done.outcome.ok
        late.wait_for_height(done.height + 1, timeout=30)
        with from_v4.snapshot(done.height):
            assert from_v4.user(newcomer.public) is not None
        print(f"v4 state-synced at base {base} in {synced_in:.1f} s")
    finally:
        if late is not None:
            late.close()
        cluster.close()
