"""Reading a signed list in parts against reading it whole (LedgerClient.entries).

A list with more entries than the chain's `max_query_entries` is refused whole (code 6, OVERSIZE)
and read in parts: one proven part per child of the trie node that holds the list, split again where
a part is still too long, all at one verified height. This builds two planetserve networks side by
side, the same N users registered in one region on each: on one the whole list fits one answer (the
baseline); on the other `max_query_entries` is lower, so the client reads it in parts. Reads
alternate between the two, so both see the same machine.

    .venv/bin/python bench/list_paging.py [--users 10000] [--max-entries 1000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from loadgen import run_load  # noqa: E402
from tx_throughput import planetserve_txs  # noqa: E402

from planetserve.chain import layout  # noqa: E402
from planetserve.chain.client import LedgerClient  # noqa: E402
from planetserve.chain.lightclient import LightClient  # noqa: E402
from planetserve.chain.rpc import RpcClient  # noqa: E402
from planetserve.genesis.committee import app_state_builder  # noqa: E402
from planetserve.genesis.network import build_network  # noqa: E402
from planetserve.localnet.cluster import Cluster  # noqa: E402
from planetserve.localnet.net import cluster_app  # noqa: E402
from planetserve.registry.params import Params  # noqa: E402

REGION = "bench"


class CountingRpc(RpcClient):
    """Counts the ABCI queries a read makes."""

    queries = 0

    def abci_query(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.queries += 1
        return super().abci_query(*args, **kwargs)


def network(stack: ExitStack, root: Path, name: str, users: int, max_entries: int, validators: int
            ) -> tuple[LedgerClient, CountingRpc]:
    room = {"mempool": {"size": 2 * users, "cache_size": 4 * users}}  # never "mempool full"
    spec = build_network(root / name, validators, f"bench-{name}",
                         app_state_builder(params=Params(max_query_entries=max_entries)),
                         timeout_commit="1s", extra_config=room)
    cluster = stack.enter_context(Cluster(spec, cluster_app, start_timeout=60.0))
    cluster.start()
    cluster.wait_for_height(2, timeout=60.0)
    load = run_load([v.rpc_url for v in spec.validators], planetserve_txs(users, f"bench-{name}", REGION))
    print(f"{name}: registered {load.committed} users in {load.seconds:.1f} s "
          f"(max_query_entries {max_entries:,})", flush=True)
    cluster.wait_for_height(cluster.height(0) + 2)
    rpc = CountingRpc(spec.validators[0].rpc_url, timeout=60)
    return LedgerClient(rpc, LightClient.from_genesis_file(spec.genesis_path, rpc)), rpc


def timed_read(client: LedgerClient, rpc: CountingRpc) -> tuple[float, int, int]:
    """(seconds, entries, ABCI queries) of one verified read of the list."""
    rpc.queries = 0
    t0 = time.perf_counter()
    listing = client.entries(layout.user_list_prefix(REGION))
    seconds = time.perf_counter() - t0
    assert listing.verified
    return seconds, len(listing.entries), rpc.queries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--max-entries", type=int, default=1_000,
                        help="max_query_entries of the paged network (the baseline's holds the list whole)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--validators", type=int, default=1)
    args = parser.parse_args()
    rows: dict[str, list[tuple[float, int, int]]] = {"whole": [], "parts": []}
    with tempfile.TemporaryDirectory(prefix="ps-bench-") as tmp, ExitStack() as stack:
        clients = {
            "whole": network(stack, Path(tmp), "whole", args.users, max(20_000, args.users), args.validators),
            "parts": network(stack, Path(tmp), "parts", args.users, args.max_entries, args.validators),
        }
        for client, rpc in clients.values():
            timed_read(client, rpc)  # the light client's first verification, from genesis
        for _ in range(args.repeat):
            for name, (client, rpc) in clients.items():
                rows[name].append(timed_read(client, rpc))

    print(f"\n{'read':6} {'entries':>8} {'queries':>8} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    medians = {}
    for name, runs in rows.items():
        times = [t * 1000 for t, _, _ in runs]
        medians[name] = statistics.median(times)
        print(f"{name:6} {runs[0][1]:>8} {runs[0][2]:>8} {medians[name]:>10.1f} {min(times):>8.1f} "
              f"{max(times):>8.1f}")
    print(f"in parts / whole: {medians['parts'] / medians['whole']:.2f}x "
          f"({rows['parts'][0][2]} queries against 1)")


if __name__ == "__main__":
    main()
