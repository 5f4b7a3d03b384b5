"""Registry transaction throughput and commit latency on a four-validator network, side by side
with CometBFT's built-in kvstore app on the same layout, in the same run, with the same tx size.

Each network is built fresh on this machine, loaded with pre-signed transactions broadcast to all
validators, and measured from the first broadcast to the block that commits the last one. The two
networks run one after the other, alternating over rounds, so they do not compete for the CPU.

The load is open loop by default (broadcast_tx_async in JSON-RPC batches of 100, so neither the
app's answer time nor this Python client caps the offered load), which measures the chain's
committed capacity. With --wait-check, 8 senders
each wait for CheckTx (broadcast_tx_sync); over CometBFT's ABCI socket client, requests are flushed
every 20 ms, so that mode measures the senders' round trips as much as the chain.

    .venv/bin/python bench/tx_throughput.py [--txs 10000] [--rounds 2] [--wait-check]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from loadgen import LoadResult, run_load  # noqa: E402

from planetserve.chain import tx as txlib  # noqa: E402
from planetserve.chain.keys import KeySet  # noqa: E402
from planetserve.chain.messages import RegisterUser  # noqa: E402
from planetserve.genesis.committee import app_state_builder  # noqa: E402
from planetserve.genesis.network import build_network  # noqa: E402
from planetserve.localnet.cluster import Cluster  # noqa: E402
from planetserve.localnet.net import cluster_app  # noqa: E402
from planetserve.registry.params import Params  # noqa: E402

BATCH = 100  # transactions per JSON-RPC batch request (both networks allow it)
UNLIMITED = Params(user_work_bits=0, max_registrations_per_block=10**9, mempool_non_member_txs=10**9,
                   mempool_non_member_bytes=1 << 40)
"""Throughput, not admission: registrations without proof of work and no cap on how many a block or the
mempool takes (docs/threat-model.md for the limits)."""
MEMPOOL_SIZE = 50_000  # both networks: room for the whole load, so nothing is refused as "mempool full"


def planetserve_txs(n: int, chain_id: str, region: str = "bench") -> list[bytes]:
    return [
        txlib.sign(KeySet.generate(), chain_id,
                   RegisterUser(f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:9000", region), 0)
        for i in range(n)
    ]


def kvstore_txs(n: int, size: int) -> list[bytes]:
    out = []
    for i in range(n):
        key = f"k{i:08d}=".encode()
        out.append(key + secrets.token_hex(size).encode()[: size - len(key)])
    return out


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_role(spec) -> dict[str, float]:
    """CPU seconds so far of all validators' processes, summed per role (app, cometbft)."""
    out: dict[str, float] = {}
    for v in spec.validators:
        for role, entry in json.loads((v.home / "pids.json").read_text()).items():
            out[role] = out.get(role, 0.0) + process_cpu_seconds(entry["pid"])
    return out


CPU: dict[str, dict[str, float]] = {}  # network name -> role -> CPU ms per committed tx per validator


def measure(root: Path, name: str, validators: int, timeout_commit: str, txs_for, app: bool,
            wait_check: bool) -> LoadResult:
    chain_id = f"bench-{name}"
    builder = app_state_builder(params=UNLIMITED) if app else None
    spec = build_network(root / name, validators, chain_id, builder,
                         kvstore=not app, timeout_commit=timeout_commit,
                         extra_config={"mempool": {"size": MEMPOOL_SIZE, "cache_size": 2 * MEMPOOL_SIZE},
                                       "rpc": {"max_request_batch_size": BATCH}})
    with Cluster(spec, cluster_app if app else None, start_timeout=60.0) as cluster:
        cluster.start()
        cluster.wait_for_height(2, timeout=60.0)
        txs = txs_for(chain_id)
        before = cpu_by_role(spec)
        result = run_load([v.rpc_url for v in spec.validators], txs, wait_check=wait_check, batch=BATCH)
        after = cpu_by_role(spec)
    per_tx = 1000 / max(result.committed, 1) / validators
    for role in after:
        CPU.setdefault(name, {}).setdefault(role, 0.0)
        CPU[name][role] += (after[role] - before[role]) * per_tx
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--txs", type=int, default=10_000)
    parser.add_argument("--validators", type=int, default=4)
    parser.add_argument("--timeout-commit", default="1s")
    parser.add_argument("--rounds", type=int, default=2, help="alternating kvstore/planetserve runs")
    parser.add_argument("--wait-check", action="store_true",
                        help="closed loop: each sender waits for CheckTx (broadcast_tx_sync)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    size = len(planetserve_txs(1, "bench-planetserve")[0])
    runs: list[tuple[int, str, LoadResult]] = []
    with tempfile.TemporaryDirectory(prefix="ps-bench-") as tmp:
        for r in range(args.rounds):
            root = Path(tmp) / f"round{r}"
            runs.append((r, "kvstore", measure(root, "kvstore", args.validators, args.timeout_commit,
                                               lambda _cid: kvstore_txs(args.txs, size), app=False,
                                               wait_check=args.wait_check)))
            runs.append((r, "planetserve", measure(root, "planetserve", args.validators, args.timeout_commit,
                                                   lambda cid: planetserve_txs(args.txs, cid), app=True,
                                                   wait_check=args.wait_check)))
    ratios = [ps.tx_per_s / kv.tx_per_s for (_, _, kv), (_, _, ps) in zip(runs[::2], runs[1::2], strict=True)]
    if args.json:
        print(json.dumps({"runs": [{"round": r, "app": name, "txs": res.txs, "committed": res.committed,
                                    "seconds": res.seconds, "tx_per_s": res.tx_per_s, "p50_ms": res.median_ms,
                                    "p95_ms": res.percentile(0.95)} for r, name, res in runs],
                          "ratios": ratios}, indent=2))
        return
    load = "closed loop: 8 senders wait for CheckTx" if args.wait_check else "open loop, batches of 100"
    print(f"{args.validators} validators on 127.0.0.1, timeout_commit {args.timeout_commit}, "
          f"{args.txs} txs of {size} bytes each, {args.rounds} alternating rounds, {load}")
    print(f"{'round':>5} {'app':28} {'committed':>9} {'seconds':>8} {'tx/s':>8} {'p50 ms':>8} {'p95 ms':>8}")
    for r, name, res in runs:
        label = "kvstore (CometBFT built-in)" if name == "kvstore" else "planetserve register-user"
        print(f"{r:>5} {label:28} {res.committed:>9} {res.seconds:>8.2f} {res.tx_per_s:>8.1f} "
              f"{res.median_ms:>8.0f} {res.percentile(0.95):>8.0f}")
    print("CPU ms per committed tx per validator (mean over rounds):")
    for name, roles in CPU.items():
        shown = ", ".join(f"{role} {ms / args.rounds:.2f}" for role, ms in sorted(roles.items()))
        print(f"  {name:12} {shown}")
    shown = ", ".join(f"{x:.2f}" for x in ratios)
    print(f"planetserve / kvstore committed tx/s per round: {shown}; median {statistics.median(ratios):.2f} "
          "(target >= 0.50)")


if __name__ == "__main__":
    main()
