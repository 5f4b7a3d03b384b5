"""CPU the planetserve app spends per registry transaction, phase by phase, in one process: the app
driven block by block as CometBFT drives it (CheckTx for every transaction, a recheck of the ones
still pending, FinalizeBlock, Commit), without sockets or other validators.

`tx_throughput.py` measures the whole network, where four validators and the load share the cores;
this says where one validator's share goes. Beside it, in the same process, runs the one step no
validator can skip: the ed25519 check of each transaction's signature (libsodium through PyNaCl).

With `--baseline REV` the same transactions also run on the code of revision REV (a temporary
`git worktree`), each round in a fresh process per side, the sides alternating, so that both are
measured under the same load of the machine; the two must reach the same app hash at every height.

    .venv/bin/python bench/app_cost.py [--txs 20000] [--block 2000] [--rounds 3] [--baseline REV]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
from google.protobuf.timestamp_pb2 import Timestamp
from tendermint.abci import types_pb2 as abci
from tendermint.crypto import keys_pb2

from planetserve.chain.abci.app import Application
from planetserve.chain.abci.server import tune_gc
from planetserve.chain.abci.store import StateStore
from planetserve.chain.keys import KeySet
from planetserve.chain.tx import decode
from planetserve.registry.entities import Member
from planetserve.registry.genesis import AppState
from planetserve.registry.params import Params

CHAIN_ID = "bench-app-cost"
PHASES = ("CheckTx", "recheck", "FinalizeBlock", "Commit")
ROWS = (*PHASES, "app", "ed25519")
LABELS = {"app": "app, all phases", "ed25519": "signature check alone"}
REPO = Path(__file__).resolve().parent.parent


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


def workload(n: int) -> tuple[abci.RequestInitChain, list[bytes]]:
    """A genesis and `n` register-user transactions, each from a fresh key."""
    if str(Path(__file__).parent) not in sys.path:  # not imported above: a worker runs another tree's code
        sys.path.insert(0, str(Path(__file__).parent))
    from tx_throughput import planetserve_txs

    return genesis(), planetserve_txs(n, CHAIN_ID)


def run(init: abci.RequestInitChain, txs: list[bytes], block: int,
        db_url: str) -> tuple[dict[str, float], list[bytes]]:
    """CPU seconds per phase for the whole load, and the app hash of every block. The mempool runs
    one block ahead, as under a steady load: a block's transactions arrive by CheckTx while the one
    before is executed, and after each Commit the transactions still pending are rechecked."""
    clock = time.process_time
    spent = dict.fromkeys(PHASES, 0.0)
    hashes: list[bytes] = []
    chunks = [txs[i:i + block] for i in range(0, len(txs), block)]
    with StateStore(db_url) as store:
        app = Application(store)
        app.init_chain(init)
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
            hashes.append(done.app_hash)
            if any(r.code for r in done.tx_results):
                raise SystemExit("a benchmark transaction was refused in FinalizeBlock")
    return spent, hashes


def signature_floor(txs: list[bytes]) -> float:
    """CPU seconds to check every transaction's signature once, and nothing else."""
    decoded = [decode(raw, len(raw)) for raw in txs]
    t0 = time.process_time()
    for tx in decoded:
        if not tx.signature_valid():
            raise SystemExit("a benchmark transaction has a bad signature")
    return time.process_time() - t0


def measure(init: abci.RequestInitChain, txs: list[bytes], block: int) -> dict:
    """One round on fresh SQLite state: CPU ms per transaction of each row, and the blocks' app hashes."""
    with tempfile.TemporaryDirectory(prefix="ps-app-cost-") as tmp:
        spent, hashes = run(init, txs, block, f"sqlite:///{tmp}/state.db")
    per_tx = {phase: 1000 * seconds / len(txs) for phase, seconds in spent.items()}
    per_tx["app"] = 1000 * sum(spent.values()) / len(txs)
    per_tx["ed25519"] = 1000 * signature_floor(txs) / len(txs)
    return {"ms_per_tx": per_tx, "app_hashes": [h.hex() for h in hashes]}


def worker(path: Path) -> None:
    """One round of the load in `path` on whichever planetserve this process imports (PYTHONPATH)."""
    load = msgpack.unpackb(path.read_bytes())
    init = abci.RequestInitChain.FromString(load["genesis"])
    print(json.dumps(measure(init, load["txs"], load["block"])))


@contextmanager
def checkout(rev: str) -> Iterator[tuple[str, Path]]:
    """A temporary detached worktree of `rev`: (its short commit id, its root)."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", f"{rev}^{{commit}}"],
                            check=True, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="ps-app-cost-base-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--quiet", "--detach", str(tree), commit],
                       check=True)
        try:
            yield commit, tree
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=True)


def in_process(root: Path, load: Path) -> dict:
    """`worker` in a fresh interpreter that imports planetserve from `root`."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, __file__, "--worker", str(load)], env=env, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out)


def table(title: str, sides: dict[str, list[dict]]) -> None:
    """Medians and each round's figure per row, side by side, and new/old where there are two sides."""
    print(title)
    names = list(sides)
    medians = {name: {row: statistics.median(r["ms_per_tx"][row] for r in rounds) for row in ROWS}
               for name, rounds in sides.items()}
    cells = {(name, row): f"{medians[name][row]:.4f} ("
             + " ".join(f"{r['ms_per_tx'][row]:.4f}" for r in sides[name]) + ")"
             for name in names for row in ROWS}
    width = 2 + max(len(text) for text in [*names, *cells.values()])
    two = len(names) == 2
    print(f"  {'CPU ms per tx':22}" + "".join(n.rjust(width) for n in names) + ("   new/old" if two else ""))
    for row in ROWS:
        ratio = f"   {medians[names[1]][row] / medians[names[0]][row]:7.2f}" if two else ""
        print(f"  {LABELS.get(row, row):22}" + "".join(cells[n, row].rjust(width) for n in names) + ratio)
    for name in names:
        m = medians[name]
        print(f"{name}: app / signature check {m['app'] / m['ed25519']:.1f}x; the signature check is "
              f"{100 * m['ed25519'] / m['app']:.0f}% of the app's CPU per transaction")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--txs", type=int, default=20_000, help="register-user transactions per round")
    parser.add_argument("--block", type=int, default=2_000, help="transactions per block")
    parser.add_argument("--rounds", type=int, default=3,
                        help="fresh state each round; the table gives medians")
    parser.add_argument("--baseline", metavar="REV",
                        help="also run the same transactions on revision REV, alternating, and compare")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.txs < 1 or args.block < 1 or args.rounds < 1:
        parser.error("--txs, --block and --rounds must be positive")

    head = f"{args.txs} register-user txs in blocks of {args.block}, SQLite, {args.rounds} rounds"
    if args.baseline is None:
        rounds = [measure(*workload(args.txs), args.block) for _ in range(args.rounds)]
        if args.json:
            print(json.dumps({"txs": args.txs, "block": args.block, "rounds": rounds}, indent=2))
            return
        table(f"{head}; CPU ms per transaction, median (each round)", {"this tree": rounds})
        return

    with checkout(args.baseline) as (commit, tree), tempfile.TemporaryDirectory() as tmp:
        sides: dict[str, list[dict]] = {f"{commit} (baseline)": [], "this tree": []}
        roots = dict(zip(sides, (tree, REPO), strict=True))
        load = Path(tmp) / "load.msgpack"
        for i in range(args.rounds):
            init, txs = workload(args.txs)
            load.write_bytes(msgpack.packb(
                {"genesis": init.SerializeToString(), "txs": txs, "block": args.block}))
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            results = {name: in_process(roots[name], load) for name in order}
            baseline, candidate = (results[name]["app_hashes"] for name in sides)
            if baseline != candidate:
                raise SystemExit(f"round {i}: the app hashes differ from the baseline's")
            for name, result in results.items():
                sides[name].append(result)
    if args.json:
        print(json.dumps({"txs": args.txs, "block": args.block, "baseline": commit, "rounds": sides},
                         indent=2))
        return
    table(f"{head}, alternating with {commit}; CPU ms per transaction, median (each round)", sides)
    blocks = len(sides["this tree"][0]["app_hashes"])
    print(f"app hashes: the same as {commit}'s at every height "
          f"({blocks} blocks in each of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
