"""CPU the planetserve app spends per registry transaction, phase by phase, in one process: the app
driven block by block as CometBFT drives it (CheckTx for every transaction, a recheck of the ones
still pending, FinalizeBlock, Commit), without sockets or other validators.

`tx_throughput.py` measures the whole network, where four validators and the load share the cores;
this says where one validator's share goes. Beside it, in the same process, runs the one step no
validator can skip: the ed25519 check of each transaction's signature (libsodium through PyNaCl).

With `--baseline REV` the package as it was at that commit is measured too, in the same run: every
round runs once on each tree, in a process of its own, alternately, so both see the same machine.

    .venv/bin/python bench/app_cost.py [--txs 20000] [--block 2000] [--rounds 3] [--baseline REV]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from google.protobuf.timestamp_pb2 import Timestamp  # noqa: E402
from machine import describe  # noqa: E402
from tendermint.abci import types_pb2 as abci  # noqa: E402
from tendermint.crypto import keys_pb2  # noqa: E402
from tx_throughput import planetserve_txs  # noqa: E402

import planetserve  # noqa: E402
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
ROOT = Path(__file__).resolve().parent.parent


TARGET_MS = 0.15
"""The target CPU per register-user transaction over all phases (docs/benchmarks.md, "Serving at
scale"): what lets one validator's app keep up with a block rate near CometBFT's own."""

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


def one_round(txs_count: int, block: int) -> dict[str, float]:
    """CPU milliseconds per transaction of each phase, of all of them ("app") and of the signature
    check alone ("ed25519"), for one fresh state."""
    txs = planetserve_txs(txs_count, CHAIN_ID)
    with tempfile.TemporaryDirectory(prefix="ps-app-cost-") as tmp:
        spent = run(txs, block, f"sqlite:///{tmp}/state.db")
    per_tx = {phase: 1000 * seconds / txs_count for phase, seconds in spent.items()}
    per_tx["app"] = 1000 * sum(spent.values()) / txs_count
    per_tx["ed25519"] = 1000 * signature_floor(txs) / txs_count
    return per_tx


def baseline_tree(rev: str, directory: Path) -> Path:
    """The package as it was at commit `rev`, extracted under `directory` (for PYTHONPATH)."""
    archive = subprocess.run(["git", "archive", rev, "planetserve"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    return directory


def round_in(tree: Path, txs: int, block: int) -> dict[str, float]:
    """One round in a process whose `planetserve` is the package under `tree`."""
    done = subprocess.run(
        [sys.executable, __file__, "--txs", str(txs), "--block", str(block), "--rounds", "1", "--json"],
        env={**os.environ, "PYTHONPATH": str(tree)}, check=True, capture_output=True, text=True)
    result = json.loads(done.stdout)
    if Path(result["package"]).parent != tree:
        raise SystemExit(f"the round imported {result['package']}, not the package under {tree}")
    return {name: values[0] for name, values in result["ms_per_tx"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--txs", type=int, default=20_000, help="register-user transactions per round")
    parser.add_argument("--block", type=int, default=2_000, help="transactions per block")
    parser.add_argument("--rounds", type=int, default=3,
                        help="fresh state each round; the table gives medians")
    parser.add_argument("--baseline", metavar="REV", help="also measure the package of this commit")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.txs < 1 or args.block < 1 or args.rounds < 1:
        parser.error("--txs, --block and --rounds must be positive")

    names = ["current", *([args.baseline] if args.baseline else [])]
    per_tx: dict[str, dict[str, list[float]]] = {
        impl: {name: [] for name in (*PHASES, "app", "ed25519")} for impl in names}
    with tempfile.TemporaryDirectory(prefix="ps-app-cost-tree-") as tmp:
        trees = {"current": ROOT}
        if args.baseline:
            trees[args.baseline] = baseline_tree(args.baseline, Path(tmp))
        for _ in range(args.rounds):
            for impl, tree in trees.items():
                measured = (one_round(args.txs, args.block) if not args.baseline
                            else round_in(tree, args.txs, args.block))
                for name, value in measured.items():
                    per_tx[impl][name].append(value)
    median = {impl: {name: statistics.median(v) for name, v in values.items()}
              for impl, values in per_tx.items()}
    if args.json:
        print(json.dumps({"machine": describe(), "txs": args.txs, "block": args.block, "rounds": args.rounds,
                          "package": str(Path(planetserve.__file__).parent),
                          "ms_per_tx": per_tx["current"], "median_ms_per_tx": median["current"],
                          **({"baseline": {"rev": args.baseline, "ms_per_tx": per_tx[args.baseline],
                                           "median_ms_per_tx": median[args.baseline]}}
                             if args.baseline else {})}, indent=2))
        return
    print(f"machine: {describe()}")
    print(f"{args.txs} register-user txs in blocks of {args.block}, SQLite, {args.rounds} rounds; "
          "CPU ms per transaction, median (each round)")
    for impl in names:
        if args.baseline:
            print(f"{impl}:")
        for name in (*PHASES, "app", "ed25519"):
            label = {"app": "app, all phases", "ed25519": "signature check alone"}.get(name, name)
            rounds = " ".join(f"{v:.4f}" for v in per_tx[impl][name])
            print(f"  {label:22} {median[impl][name]:8.4f}   ({rounds})")
    now = median["current"]
    print(f"app / signature check: {now['app'] / now['ed25519']:.1f}x; the signature check is "
          f"{100 * now['ed25519'] / now['app']:.0f}% of the app's CPU per transaction")
    if args.baseline:
        then = median[args.baseline]
        print(f"current against {args.baseline}: " + ", ".join(
            f"{name} {then[name] / now[name]:.2f}x" for name in (*PHASES, "app"))
              + " less CPU per transaction")
    print(f"target: at most {TARGET_MS} ms per transaction over all phases: "
          + ("met" if now["app"] <= TARGET_MS else "NOT met"))


if __name__ == "__main__":
    main()
