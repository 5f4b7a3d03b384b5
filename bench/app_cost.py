"""CPU the planetserve app spends per registry transaction, phase by phase, in one process: the app
driven block by block as CometBFT drives it (CheckTx for every transaction, a recheck of the ones
still pending, FinalizeBlock, Commit), without sockets or other validators.

`tx_throughput.py` measures the whole network, where four validators and the load share the cores;
this says where one validator's share goes. Beside it, in the same process, runs the one step no
validator can skip: the ed25519 check of each transaction's signature (libsodium through PyNaCl).

    .venv/bin/python bench/app_cost.py [--txs 20000] [--block 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from google.protobuf.timestamp_pb2 import Timestamp  # noqa: E402
from tendermint.abci import types_pb2 as abci  # noqa: E402
from tendermint.crypto import keys_pb2  # noqa: E402
from tx_throughput import planetserve_txs  # noqa: E402

from planetserve.chain.abci.app import Application  # noqa: E402
from planetserve.chain.abci.server import tune_gc  # noqa: E402
from planetserve.chain.abci.store import StateStore  # noqa: E402
from planetserve.chain.keys import KeySet  # noqa: E402
from planetserve.chain.tx import decode  # noqa: E402
from planetserve.registry.entities import Member  # noqa: E402
from planetserve.registry.genesis import AppState  # noqa: E402
from planetserve.registry.params import Params  # noqa: E402

CHAIN_ID = "bench-app-cost"
PHASES = ("CheckTx", "recheck", "FinalizeBlock", "Commit")


UNLIMITED = Params(user_work_bits=0, max_registrations_per_block=10**9, mempool_non_member_txs=10**9,
                   mempool_non_member_bytes=1 << 40)
"""The app's cost per transaction, not its admission limits: registrations without proof of work (the
check still costs its hash) and no cap on how many a block or the mempool takes."""


def genesis() -> abci.RequestInitChain:
    """A one-member committee: the app's work per transaction does not depend on the committee."""
    member, consensus = KeySet.generate(), KeySet.generate()
    state = AppState(params=UNLIMITED, models=(), committee=(
        Member(member.public, consensus.public, bytes(member.vrf.verify_key),
               bytes(member.x25519.public_key), "bench member", 10),))
    return abci.RequestInitChain(
        chain_id=CHAIN_ID, initial_height=1, time=Timestamp(seconds=1_700_000_000),
        validators=[abci.ValidatorUpdate(pub_key=keys_pb2.PublicKey(ed25519=consensus.public), power=10)],
        app_state_bytes=json.dumps(state.to_json()).encode())


def run(txs: list[bytes], block: int, db_url: str) -> dict[str, float]:
    """CPU seconds per phase for the whole load. The mempool runs one block ahead, as under a steady
    load: a block's transactions arrive by CheckTx while the one before is executed, and after each
    Commit the transactions still pending are rechecked."""
    clock = time.process_time
    spent = dict.fromkeys(PHASES, 0.0)
    chunks = [txs[i:i + block] for i in range(0, len(txs), block)]
    with StateStore(db_url) as store:
        app = Application(store)
        app.init_chain(genesis())
        tune_gc()
        pending: list[bytes] = []
        for height, arriving in enumerate([*chunks, []], start=0):
            t0 = clock()
            for raw in arriving:
                if app.check_tx(abci.RequestCheckTx(tx=raw)).code:
                    raise SystemExit("a benchmark transaction was refused in CheckTx")
            spent["CheckTx"] += clock() - t0
            pending += arriving
            if not height:
                continue
            chosen, pending = pending[:block], pending[block:]
            t1 = clock()
            done = app.finalize_block(abci.RequestFinalizeBlock(
                txs=chosen, height=height, time=Timestamp(seconds=1_700_000_000 + height)))
            t2 = clock()
            app.commit(abci.RequestCommit())
            t3 = clock()
            for raw in pending:
                app.check_tx(abci.RequestCheckTx(tx=raw, type=abci.RECHECK))
            spent["recheck"] += clock() - t3
            spent["FinalizeBlock"] += t2 - t1
            spent["Commit"] += t3 - t2
            if any(r.code for r in done.tx_results):
                raise SystemExit("a benchmark transaction was refused in FinalizeBlock")
    return spent


def signature_floor(txs: list[bytes]) -> float:
    """CPU seconds to check every transaction's signature once, and nothing else."""
    decoded = [decode(raw, len(raw)) for raw in txs]
    t0 = time.process_time()
    for tx in decoded:
        if not tx.signature_valid():
            raise SystemExit("a benchmark transaction has a bad signature")
    return time.process_time() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--txs", type=int, default=20_000, help="register-user transactions per round")
    parser.add_argument("--block", type=int, default=2_000, help="transactions per block")
    parser.add_argument("--rounds", type=int, default=3,
                        help="fresh state each round; the table gives medians")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.txs < 1 or args.block < 1 or args.rounds < 1:
        parser.error("--txs, --block and --rounds must be positive")

    per_tx: dict[str, list[float]] = {name: [] for name in (*PHASES, "app", "ed25519")}
    for _ in range(args.rounds):
        txs = planetserve_txs(args.txs, CHAIN_ID)
        with tempfile.TemporaryDirectory(prefix="ps-app-cost-") as tmp:
            spent = run(txs, args.block, f"sqlite:///{tmp}/state.db")
        for phase, seconds in spent.items():
            per_tx[phase].append(1000 * seconds / args.txs)
        per_tx["app"].append(1000 * sum(spent.values()) / args.txs)
        per_tx["ed25519"].append(1000 * signature_floor(txs) / args.txs)
    median = {name: statistics.median(values) for name, values in per_tx.items()}
    if args.json:
        print(json.dumps({"txs": args.txs, "block": args.block, "rounds": args.rounds,
                          "ms_per_tx": per_tx, "median_ms_per_tx": median}, indent=2))
        return
    print(f"{args.txs} register-user txs in blocks of {args.block}, SQLite, {args.rounds} rounds; "
          "CPU ms per transaction, median (each round)")
    for name in (*PHASES, "app", "ed25519"):
        label = {"app": "app, all phases", "ed25519": "signature check alone"}.get(name, name)
        rounds = " ".join(f"{v:.4f}" for v in per_tx[name])
        print(f"  {label:22} {median[name]:8.4f}   ({rounds})")
    print(f"app / signature check: {median['app'] / median['ed25519']:.1f}x; the signature check is "
          f"{100 * median['ed25519'] / median['app']:.0f}% of the app's CPU per transaction")


if __name__ == "__main__":
    main()
