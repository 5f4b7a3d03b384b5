"""Client verification of a 10,000-entry signed list, end to end from RPC (target: under 100 ms).

Builds a four-validator planetserve network, registers N users in one region, then times what a
client holding only the genesis file does to obtain the verified user list: the ABCI query over
RPC, the light-client verification of the header that carries the app hash, and the Merkle proof
check that recomputes the list's subtree root. As `LedgerClient` does, the client first verifies
the latest header L and asks for the state at height L-1, whose app hash L carries.
cold = a fresh light client (verifies from genesis); live = the same client again while the four
validators keep producing blocks on this 2-core machine; idle = the same after three validators
stop (the chain halts, validator 0 keeps answering): the client's own cost without their noise.

    .venv/bin/python bench/list_verify.py [--users 10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from loadgen import run_load  # noqa: E402
from tx_throughput import planetserve_txs  # noqa: E402

from planetserve.chain import (
    layout,  # noqa: E402
    trie,  # noqa: E402
)
from planetserve.chain.client import LedgerClient, decode_entries  # noqa: E402
from planetserve.chain.lightclient import LightClient  # noqa: E402
from planetserve.chain.rpc import RpcClient  # noqa: E402
from planetserve.genesis.committee import app_state_builder  # noqa: E402
from planetserve.genesis.network import build_network  # noqa: E402
from planetserve.localnet.cluster import Cluster  # noqa: E402
from planetserve.localnet.net import cluster_app  # noqa: E402


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ps-bench-") as tmp:
        room = {"mempool": {"size": 2 * args.users, "cache_size": 4 * args.users}}  # never "mempool full"
        spec = build_network(Path(tmp), 4, "bench-list", app_state_builder(), timeout_commit="1s",
                             extra_config=room)
        with Cluster(spec, cluster_app, start_timeout=60.0) as cluster:
            cluster.start()
            cluster.wait_for_height(2, timeout=60.0)
            load = run_load([v.rpc_url for v in spec.validators], planetserve_txs(args.users, "bench-list"))
            print(f"registered {load.committed} users in {load.seconds:.1f}s")
            cluster.wait_for_height(cluster.height(0) + 1)
            url = spec.validators[0].rpc_url
            prefix = layout.user_list_prefix("bench")

            rpc = RpcClient(url, timeout=30)
            light = LightClient.from_genesis_file(spec.genesis_path, rpc)
            rows = [measure("cold", light, rpc, prefix)]
            rows += [measure("live", light, rpc, prefix) for _ in range(args.repeat)]
            t0 = time.perf_counter()
            _, users = LedgerClient(rpc, light).users("bench")
            whole = time.perf_counter() - t0
            for i in (1, 2, 3):  # the chain halts: v0 keeps answering, nothing else runs
                cluster.stop(i)
            rows += [measure("idle", light, rpc, prefix) for _ in range(args.repeat)]

    columns = ("header", "query", "decode", "proof", "total")
    print(f"{'run':6} {'entries':>8} " + " ".join(f"{c:>8}" for c in columns) + "  (ms)")
    for label, n, *times in rows:
        print(f"{label:6} {n:>8} " + " ".join(ms(t) for t in times))
    print(f"LedgerClient.users() incl. record decoding: {whole * 1000:.1f} ms for {len(users)} users")
    for phase in ("live", "idle"):
        median = statistics.median(r[-1] for r in rows if r[0] == phase) * 1000
        print(f"median {phase} end-to-end: {median:.1f} ms (target < 100 ms; ratio {median / 100:.2f})")


def measure(label: str, light: LightClient, rpc: RpcClient, prefix: bytes) -> tuple:
    """One verified read of the list, timed step by step as LedgerClient performs it."""
    t0 = time.perf_counter()
    latest = light.verified_light_block()
    t1 = time.perf_counter()
    answer = rpc.abci_query("/prefix", prefix, height=latest.height - 1, prove=True)
    t2 = time.perf_counter()
    entries = decode_entries(answer.value, prefix)
    proof = trie.PrefixProof.decode(answer.proof_ops[0].data)
    t3 = time.perf_counter()
    trie.verify_prefix(latest.header.app_hash, prefix, entries, proof)
    t4 = time.perf_counter()
    return (label, len(entries), t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)


if __name__ == "__main__":
    main()
