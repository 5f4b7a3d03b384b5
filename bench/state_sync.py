"""State sync against replay from genesis: for a chain of N registered users, the time and bytes of a
snapshot (made by the real app's `Snapshots`, restored by a fresh real `Application` through
OfferSnapshot and ApplySnapshotChunk, its root checked against the trusted app hash) beside the time
the app takes to execute every block that registered them (FinalizeBlock and Commit, as a node
replaying from genesis does; CometBFT's own block sync comes on top of that).

N users are registered through the app itself in blocks of 2,000 register-user transactions. With
`--synthetic N` the state is instead N users laid out as the chain lays them out (bench/commit_cost.py,
3 keys each), loaded directly: the snapshot and restore are measured, and replay is extrapolated from
the measured per-transaction rate of the largest real run.

    .venv/bin/python bench/state_sync.py                        # 10k and 100k users
    .venv/bin/python bench/state_sync.py --users 10000 --synthetic 1000000
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from app_cost import genesis  # noqa: E402
from commit_cost import state_entries, user_id  # noqa: E402
from google.protobuf.timestamp_pb2 import Timestamp  # noqa: E402
from tendermint.abci import types_pb2 as abci  # noqa: E402
from tx_throughput import planetserve_txs  # noqa: E402

from planetserve.chain.abci.app import Application  # noqa: E402
from planetserve.chain.abci.server import tune_gc  # noqa: E402
from planetserve.chain.abci.snapshots import CHUNK_BYTES, Snapshots  # noqa: E402
from planetserve.chain.abci.store import StateStore  # noqa: E402

BLOCK = 2_000
GENESIS_TIME = 1_700_000_000


def replayed(users: int, db_url: str) -> tuple[StateStore, Application, float]:
    """A store holding `users` registered through the app; the seconds FinalizeBlock and Commit took."""
    store = StateStore(db_url)
    app = Application(store)
    app.init_chain(genesis())
    tune_gc()
    txs = planetserve_txs(users, app.chain_id)
    spent = 0.0
    for height, start in enumerate(range(0, users, BLOCK), start=1):
        t0 = time.perf_counter()
        done = app.finalize_block(abci.RequestFinalizeBlock(txs=txs[start:start + BLOCK], height=height,
                                                            time=Timestamp(seconds=GENESIS_TIME + height)))
        app.commit(abci.RequestCommit())
        spent += time.perf_counter() - t0
        if any(r.code for r in done.tx_results):
            raise SystemExit("a benchmark transaction was refused")
    return store, app, spent


def synthetic(users: int, db_url: str) -> tuple[StateStore, Application]:
    store = StateStore(db_url)
    rnd = random.Random(7)
    store.bulk_load(state_entries(sorted(user_id(i) for i in range(users)), rnd), 1,
                    {"block_time": GENESIS_TIME.to_bytes(8, "big"), "chain_id": b"bench"})
    return store, Application(store)


def sync(store: StateStore, app: Application, work: Path) -> dict[str, float]:
    """Make the snapshot of the store's height, then restore it into a fresh node; times and sizes."""
    app.snapshots = Snapshots(work / "source", interval=store.height, chunk_bytes=CHUNK_BYTES)
    t0 = time.perf_counter()
    app.snapshots.after_commit(store, store.height, app.committed_time, app.chain_id or "bench")
    app.snapshots.wait()
    made = time.perf_counter() - t0
    (snapshot,) = app.list_snapshots(abci.RequestListSnapshots()).snapshots
    load = abci.RequestLoadSnapshotChunk
    chunks = [app.load_snapshot_chunk(load(height=snapshot.height, format=1, chunk=i)).chunk
              for i in range(snapshot.chunks)]
    with StateStore(f"sqlite:///{work / 'joiner.db'}") as fresh:
        joiner = Application(fresh, Snapshots(work / "joiner"))
        t1 = time.perf_counter()
        offered = joiner.offer_snapshot(abci.RequestOfferSnapshot(snapshot=snapshot, app_hash=store.app_hash))
        if offered.result != abci.ResponseOfferSnapshot.ACCEPT:
            raise SystemExit("the snapshot was refused")
        for i, chunk in enumerate(chunks):
            if joiner.apply_snapshot_chunk(abci.RequestApplySnapshotChunk(index=i, chunk=chunk)).result != \
                    abci.ResponseApplySnapshotChunk.ACCEPT:
                raise SystemExit(f"chunk {i} was refused")
        restored = time.perf_counter() - t1
        if fresh.app_hash != store.app_hash:
            raise SystemExit("the restored state differs")
    return {"snapshot_mib": sum(map(len, chunks)) / (1 << 20), "chunks": snapshot.chunks,
            "make_s": made, "restore_s": restored}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", default="10000,100000",
                        help="comma-separated users registered through the app")
    parser.add_argument("--synthetic", type=int, default=0, help="also a loaded state of this many users")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    per_tx = 0.0
    for users in (int(u) for u in args.users.split(",")):
        work = Path(tempfile.mkdtemp(prefix="state-sync-"))
        try:
            store, app, replay = replayed(users, f"sqlite:///{work / 'chain.db'}")
            with store:
                rows.append({"users": users, "state": "registered", "replay_s": replay,
                             **sync(store, app, work)})
            per_tx = replay / users
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if args.synthetic:
        work = Path(tempfile.mkdtemp(prefix="state-sync-"))
        try:
            store, app = synthetic(args.synthetic, f"sqlite:///{work / 'chain.db'}")
            with store:
                rows.append({"users": args.synthetic, "state": "loaded", "replay_s": per_tx * args.synthetic,
                             **sync(store, app, work)})
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'users':>9} {'state':>10} {'snapshot MiB':>12} {'chunks':>6} {'make s':>7} {'restore s':>9} "
          f"{'replay s':>9} {'replay/restore':>14}")
    for r in rows:
        extrapolated = "*" if r["state"] == "loaded" else " "
        print(f"{r['users']:>9} {r['state']:>10} {r['snapshot_mib']:>12.1f} {r['chunks']:>6} "
              f"{r['make_s']:>7.1f} {r['restore_s']:>9.1f} {r['replay_s']:>8.1f}{extrapolated} "
              f"{r['replay_s'] / r['restore_s']:>13.1f}x")
    if any(r["state"] == "loaded" for r in rows):
        print("* replay extrapolated from the per-transaction time of the largest registered run")


if __name__ == "__main__":
    main()
