"""Disk use of a validator's block store with and without retention: two one-validator networks of the
real app and CometBFT, side by side, each running `--blocks` blocks (a register-user transaction in
every tenth), one keeping every block and one with `retain_blocks` set (and snapshots every
`--interval` heights, which retention never goes above). Reports each one's earliest kept block and
the sizes of CometBFT's block store and state store and of the app's database, as they run and once
goleveldb has compacted (`cometbft experimental-compact-goleveldb`, nodes stopped): deleted blocks
give their room back only then.

    .venv/bin/python bench/block_retention.py                  # 10,000 blocks, retain 1,000
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from planetserve.chain.client import LedgerClient, sign
from planetserve.chain.keys import KeySet
from planetserve.chain.lightclient import LightClient
from planetserve.chain.messages import RegisterUser
from planetserve.chain.rpc import RpcClient
from planetserve.genesis.committee import app_state_builder
from planetserve.genesis.network import build_network, cometbft_binary
from planetserve.localnet.cluster import Cluster
from planetserve.localnet.net import cluster_app
from planetserve.registry.params import Params

FAST = {"consensus": {"peer_gossip_sleep_duration": "10ms"}, "p2p": {"flush_throttle_timeout": "10ms"}}
CHEAP = Params(user_work_bits=0, max_signer_txs=10**6)


def mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / (1 << 20)


def sizes(cluster: Cluster, status: bool = True) -> tuple[tuple[int, int], tuple[float, float, float]]:
    """((latest, earliest) block, MiB of the block store, CometBFT's state store and the app's database)."""
    heights = (0, 0)
    if status:
        info = cluster.status(0)["sync_info"]
        heights = (int(info["latest_block_height"]), int(info["earliest_block_height"]))
    data = cluster.validators[0].home / "data"
    app_db = sum(f.stat().st_size for f in data.glob("planetserve.db*")) / (1 << 20)
    return heights, (mib(data / "blockstore.db"), mib(data / "state.db"), app_db)


def compact(cluster: Cluster) -> None:
    """goleveldb frees the room of deleted blocks only when it compacts; force it (node stopped)."""
    subprocess.run([cometbft_binary(), "experimental-compact-goleveldb", "--home",
                    str(cluster.validators[0].home)], check=True, capture_output=True, timeout=600)


def start(root: Path, retain: int, interval: int) -> Cluster:
    spec = build_network(root, 1, "bench-retention", app_state_builder([("gt", "gt")], CHEAP),
                         timeout_commit="1ms", snapshot_interval=interval, retain_blocks=retain,
                         extra_config=FAST)
    cluster = Cluster(spec, cluster_app, start_timeout=60.0)
    cluster.start()
    return cluster


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=10_000)
    parser.add_argument("--retain", type=int, default=1_000)
    parser.add_argument("--interval", type=int, default=1_000, help="heights between snapshots")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="retention-"))
    runs = {"keep all": start(root / "all", 0, args.interval),
            f"retain {args.retain}": start(root / "retain", args.retain, args.interval)}
    began = time.monotonic()
    try:
        clients = {name: LedgerClient(RpcClient(c.rpc_url(0)), LightClient.from_genesis_file(
            c.spec.genesis_path, c.rpc(0))) for name, c in runs.items()}
        sent = 0
        while min(c.height(0) or 0 for c in runs.values()) < args.blocks:
            lowest = min(c.height(0) or 0 for c in runs.values())
            if lowest // 10 > sent:  # about one registration per ten blocks on each
                for name, client in clients.items():
                    msg = RegisterUser(f"10.9.{sent // 256 % 256}.{sent % 256}:9000", "bench")
                    runs[name].rpc(0).broadcast_tx_sync(sign(KeySet.generate(), client.chain_id(), msg, 0))
                sent += 1
            print(f"\rheight {lowest} of {args.blocks} ({time.monotonic() - began:.0f} s)", end="",
                  file=sys.stderr, flush=True)
            time.sleep(1.0)
        print(file=sys.stderr)
        live = {name: sizes(cluster) for name, cluster in runs.items()}
        for cluster in runs.values():
            cluster.stop(0)
            compact(cluster)
        print(f"{'validator':>12} {'blocks':>7} {'earliest':>8} {'blockstore MiB':>14} {'state.db MiB':>12} "
              f"{'app db MiB':>10} {'total MiB':>9} {'compacted MiB':>13}")
        totals = {}
        for name, cluster in runs.items():
            (latest, earliest), before = live[name]
            _, after = sizes(cluster, status=False)
            totals[name] = (sum(before), sum(after))
            print(f"{name:>12} {latest:>7} {earliest:>8} {before[0]:>14.1f} {before[1]:>12.1f} "
                  f"{before[2]:>10.1f} {totals[name][0]:>9.1f} {totals[name][1]:>13.1f}")
        (keep, keep_compact), (retained, retained_compact) = totals.values()
        print(f"retention: {retained / keep:.2f}x the disk of keeping every block as it runs, "
              f"{retained_compact / keep_compact:.2f}x once goleveldb compacts "
              f"({args.blocks} blocks, {sent} registrations each)")
    finally:
        for cluster in runs.values():
            cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
