"""Epoch finalization cost in the block that finalizes the epoch (target: under 1 s of app time at
10,000 model nodes).

The chain runs in-process as CometBFT drives it (Application: InitChain, then FinalizeBlock +
Commit per block), with a 4-member committee and epochs of 10 blocks, so epoch 1 ends at height 20.
The evidence of epoch 1 is written straight into the blocks' batches (through `State`, after the
block's own FinalizeBlock and before its Commit, as if its transactions had run: signing and
executing 10k transactions would take far longer than the block being measured), on the heights
where the chain would hold it:

    height 2    N model nodes (model "gt", 100 organisations, 4 regions) with their list entries
                and Reputation records: half of them scored in earlier epochs, some of those
                untrusted; the other half never scored, past probation
    height 9    epoch 0's plan window: epoch 1's plan is committed (N PlanEntry: a 32-byte
                commitment and 4 sealed boxes of ~300 B each; N pcom/ keys), epoch 1's leader is
                fixed (election "vrf"; 4 VRF entries)
    height 11   epoch 1's leader submits N results: status "valid", a signed response of 100 token
                ids and ~400 characters of text, the node's real ed25519 signature
    height 12   every result is attested by the 4 members, credibilities around a per-node median
                (1% of nodes have one member off by 200,000 ppm: a deviating-attestation fault) and
                0-2 deviating tokens, which the evidence across epochs adds up
    height 19   epoch 1's plan window: epoch 2's plan is committed, as on a chain that keeps going

Credibilities are chosen so that ~15% of the nodes change trust (new nodes scored low, untrusted
nodes that recover, trusted nodes that fail), which rewrites their node record and list entry.
Height 20 is the measured block: its FinalizeBlock runs end_block, which finalizes epoch 1 (reads
the evidence, decides, writes N reputations), then computes the app hash; its Commit writes the
block to the database. Measured per block: wall time and process CPU time (time.process_time) of
FinalizeBlock, of which end_block (epoch finalization proper) and the app hash (Batch.root, the trie
update), and of Commit. Before it the SQLite WAL is checkpointed, so that the background
checkpoint of the large evidence blocks does not run during the measured block.

Each size and round runs in a fresh interpreter on a fresh database; the median over rounds is
reported. After each run the committed state is checked (epoch 1 finalized with scored = N, every
node's Reputation at last_epoch 1 with the expected value, node list and faults as expected), so a
no-op cannot pass as fast. The target judges the wall time of FinalizeBlock + Commit at the
largest size.

    .venv/bin/python bench/epoch_finalization.py --sizes 100,1000,10000 --rounds 3
    .venv/bin/python bench/epoch_finalization.py --sizes 10000 --rounds 1 --profile 30
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp
from nacl.signing import SigningKey
from tendermint.abci import types_pb2 as abci
from tendermint.crypto import keys_pb2

from planetserve.chain import layout
from planetserve.chain.abci import epochs as chain_epochs
from planetserve.chain.abci.app import Application
from planetserve.chain.abci.state import State
from planetserve.chain.abci.store import Batch, StateStore
from planetserve.chain.keys import KeySet
from planetserve.registry import epochs, evidence, reputation
from planetserve.registry.entities import Member, Model, ModelNode, Organisation
from planetserve.registry.epochs import (
    PLAN_COMMITTED,
    VALID,
    ChallengeResult,
    Fault,
    PlanEntry,
    Reputation,
    SignedResponse,
    VrfEntry,
)
from planetserve.registry.genesis import AppState
from planetserve.registry.params import Params

CHAIN_ID = "bench-epochs"
GENESIS_TIME = 1_700_000_000
BLOCK_SECONDS = 5
MEMBERS = 4
MODEL = "gt"
TEMPERATURE = 1_000
"""Every challenge samples at temperature 1 (thousandths, as committed and signed)."""
ORGS = 100
REGIONS = ("ap-south", "eu-west", "sa-east", "us-east")
PARAMS = Params(epoch_blocks=10, results_blocks=5, vrf_window_blocks=2, plan_window_blocks=2)
EPOCH = 1  # the epoch whose finalization is measured
NODES_HEIGHT, PLAN_HEIGHT, RESULTS_HEIGHT, ATTEST_HEIGHT, NEXT_PLAN_HEIGHT = 2, 9, 11, 12, 19
FINAL_HEIGHT = (EPOCH + 1) * PARAMS.epoch_blocks  # 20
TARGET_MS = 1000.0
TARGET_NODES = 10_000
WORDS = ("the", "model", "answers", "each", "prompt", "with", "tokens", "drawn", "from", "its", "vocabulary",
         "while", "relays", "forward", "encrypted", "requests", "across", "regions", "and", "committee",
         "checks", "signed", "responses", "in", "every", "epoch")


# -- the chain ----------------------------------------------------------------------------------


class Chain:
    """The Application over a fresh store, driven block by block."""

    def __init__(self, db_url: str, rnd: random.Random) -> None:
        self.store = StateStore(db_url)
        if self.store.height != 0:
            raise SystemExit(f"{db_url} is not empty: the benchmark needs a fresh database per run")
        self.app = Application(self.store)
        self.rnd = rnd
        self.members = [KeySet.generate() for _ in range(MEMBERS)]
        consensus = [KeySet.generate() for _ in range(MEMBERS)]
        committee = tuple(
            Member(m.public, c.public, bytes(m.vrf.verify_key), bytes(m.x25519.public_key),
                   f"member {i}", 10)
            for i, (m, c) in enumerate(zip(self.members, consensus, strict=True))
        )
        self.operators = sorted(m.operator for m in committee)
        state = AppState(params=PARAMS, committee=committee, models=(Model(MODEL, "ground truth", 0),))
        self.app.init_chain(abci.RequestInitChain(
            chain_id=CHAIN_ID,
            validators=[abci.ValidatorUpdate(pub_key=keys_pb2.PublicKey(ed25519=c.public), power=10)
                        for c in consensus],
            app_state_bytes=json.dumps(state.to_json()).encode(),
            initial_height=1,
            time=Timestamp(seconds=GENESIS_TIME),
        ))
        self.height = 0
        self.time = GENESIS_TIME

    def request(self) -> abci.RequestFinalizeBlock:
        self.height += 1
        self.time += BLOCK_SECONDS
        return abci.RequestFinalizeBlock(txs=[], height=self.height, time=Timestamp(seconds=self.time))

    def block(self, inject: Any = None) -> None:
        """One block; `inject(State)` writes evidence into it after its FinalizeBlock, before Commit."""
        self.app.finalize_block(self.request())
        if inject is not None:
            assert self.app.block is not None
            inject(State(self.app.block))
        self.app.commit(abci.RequestCommit())
        assert self.store.height == self.height


# -- the evidence -------------------------------------------------------------------------------


def words(rnd: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        w = rnd.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:chars]


class Evidence:
    """The nodes of the benchmark, their expected outcome, and writers of each block's records."""

    def __init__(self, chain: Chain, n: int, rnd: random.Random) -> None:
        self.chain = chain
        self.n = n
        self.rnd = rnd
        self.rule = reputation.ReputationRule.from_params(PARAMS)
        self.evidence_rule = evidence.EvidenceRule.from_params(PARAMS)
        self.keys = [SigningKey(rnd.randbytes(32)) for _ in range(n)]
        self.pubkeys = [bytes(k.verify_key) for k in self.keys]
        self.leader = rnd.choice(chain.operators)
        self.nodes: list[ModelNode] = []
        self.previous: list[Reputation] = []
        self.base: list[int] = []  # the credibility around which the members attest
        self.deviant: list[bool] = []
        for i, pk in enumerate(self.pubkeys):
            self.nodes.append(ModelNode(
                pubkey=pk, org_id=f"org-{i % ORGS:03d}", model_id=MODEL,
                address=f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:8000", hardware="H100 80GB",
                capacity=8, region=REGIONS[i % len(REGIONS)], status="active",
                registered_at=GENESIS_TIME + NODES_HEIGHT * BLOCK_SECONDS,
            ))
            k = i % 20
            if i % 2 == 0:  # a new node: never scored, at the initial reputation
                self.previous.append(Reputation(pk, self.rule.initial, (), 0, 0, True, 0))
                self.base.append(200_000 if k == 0 else 850_000 + rnd.randrange(-30_000, 30_000))
            elif k == 1:  # untrusted after one bad epoch; recovers now
                window = (800_000, 800_000, 800_000, 300_000)
                self.previous.append(Reputation(pk, 350_000, window, 4, 0, False, 0))
                self.base.append(950_000)
            elif k == 3:  # trusted; fails this epoch
                self.previous.append(Reputation(pk, 600_000, (800_000,) * 4, 4, 0, True, 0))
                self.base.append(100_000)
            else:  # trusted and stays so
                value = 700_000 + rnd.randrange(-50_000, 50_000)
                self.previous.append(Reputation(pk, value, (800_000,) * 4, 4, 0, True, 0))
                self.base.append(850_000 + rnd.randrange(-30_000, 30_000))
            self.deviant.append(i % 100 == 7)
        self.prompts = [words(rnd, 200) for _ in range(n)]
        self.salts = [rnd.randbytes(32) for _ in range(n)]

    # expected outcome, from the reference rule (the checks below compare the chain against it)
    def expected(self, i: int) -> tuple[int, int, tuple[int, ...], bool, bool]:
        """(credibility, reputation, window, trusted now, trusted before) of node i."""
        credibility = reputation.median(self.attested(i))
        prev = self.previous[i]
        value, window = reputation.update(self.rule, prev.value, credibility, prev.window)
        return credibility, value, window, reputation.is_trusted(self.rule, value), prev.trusted

    def deviations(self, i: int) -> int:
        """The deviating tokens every member attests in node i's 100-token answer (the evidence's path)."""
        return i % 3

    def attested(self, i: int) -> list[int]:
        b = self.base[i]
        scores = [b - 10_000, b, b + 5_000, b + 10_000]
        if self.deviant[i]:
            scores[3] = b - 200_000
        return scores

    # block writers
    def write_nodes(self, st: State) -> None:
        for o in range(min(ORGS, self.n)):
            owner = self.rnd.randbytes(32)
            st.put_org(Organisation(f"org-{o:03d}", f"Organisation {o}", owner, self.chain.time))
        for node, prev in zip(self.nodes, self.previous, strict=True):
            st.put_reputation(prev)
            st.put_node(node, at=self.chain.time, listable=prev.listable)

    def write_plan(self, st: State, number: int = EPOCH) -> None:
        """The committed plan of epoch `number` and its leader (the plan of the epoch after the
        measured one is there too, as in a chain that keeps going: otherwise its absence would be
        recorded as a no-plan fault in the measured block)."""
        current = st.epoch(number)
        assert current is not None, "begin_block creates the next epoch's record at its setup height"
        for i, pk in enumerate(self.pubkeys):
            if number == EPOCH:
                prompt, salt = self.prompts[i], self.salts[i]
            else:
                prompt, salt = words(self.rnd, 200), self.rnd.randbytes(32)
            commitment = epochs.commitment(prompt, TEMPERATURE, salt, epochs.MILLI)
            sealed = tuple([op, self.rnd.randbytes(80)] for op in self.chain.operators)
            st.put_plan_entry(number, PlanEntry(pk, commitment, sealed, self.rnd.randbytes(1_064)))
            st.use_commitment(number, commitment, pk)
        outputs = {op: self.rnd.randbytes(64) for op in self.chain.operators}
        leader = self.leader if number == EPOCH else self.rnd.choice(self.chain.operators)
        outputs[leader] = b"\x00" + outputs[leader][1:]  # the lowest output leads
        for op, output in outputs.items():
            st.put_vrf_entry(number, VrfEntry(op, self.rnd.randbytes(80), output))
        st.put_epoch(replace(current, leader=leader, leader_output=outputs[leader], election="vrf",
                             plan_status=PLAN_COMMITTED, plan_nodes=self.n))

    def write_next_plan(self, st: State) -> None:
        self.write_plan(st, EPOCH + 1)

    def write_results(self, st: State) -> None:
        height, now = self.chain.height, self.chain.time
        for i, (key, pk) in enumerate(zip(self.keys, self.pubkeys, strict=True)):
            tokens = tuple(self.rnd.randrange(50_000) for _ in range(100))
            unsigned = SignedResponse(pk, epochs.prompt_hash(self.prompts[i]), tokens, words(self.rnd, 400),
                                      MODEL, TEMPERATURE, epochs.challenge_seed(self.salts[i]), now - 2,
                                      self.nodes[i].address, b"")
            response = replace(unsigned, signature=key.sign(unsigned.sign_bytes()).signature)
            st.put_result(EPOCH, ChallengeResult(pk, self.leader, "leader", VALID, "", self.prompts[i],
                                                 self.salts[i], response.to_record(), self.base[i], height))

    def write_attestations(self, st: State) -> None:
        for i, pk in enumerate(self.pubkeys):
            scores = [[op, c, self.deviations(i)] for op, c in zip(self.chain.operators, self.attested(i),
                                                                   strict=True)]
            st.put_attestations(EPOCH, pk, self.leader, scores)


def build(db_url: str, n: int, seed: int) -> tuple[Chain, Evidence]:
    """The chain up to the block before the end of epoch 1, with epoch 1's evidence in state."""
    rnd = random.Random(seed)
    chain = Chain(db_url, rnd)
    ev = Evidence(chain, n, rnd)
    writers = {NODES_HEIGHT: ev.write_nodes, PLAN_HEIGHT: ev.write_plan,
               RESULTS_HEIGHT: ev.write_results, ATTEST_HEIGHT: ev.write_attestations,
               NEXT_PLAN_HEIGHT: ev.write_next_plan}
    while chain.height < FINAL_HEIGHT - 1:
        chain.block(writers.get(chain.height + 1))
    epoch = State(chain.store.batch()).epoch(EPOCH)
    assert epoch is not None and epoch.leader == ev.leader and epoch.plan_status == PLAN_COMMITTED
    assert not epoch.finalized
    return chain, ev


# -- the measured block -------------------------------------------------------------------------


class Timer:
    """Accumulates the wall time of calls to a function, through `wrapped` (a plain function, so it
    can stand in for a method too)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.seconds = 0.0

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        self.wrapped = wrapped


def measure_final(chain: Chain, profile: int = 0) -> dict[str, Any]:
    """FinalizeBlock and Commit of the block that ends epoch 1."""
    keys_before = sum(1 for _ in chain.store.batch().iterate(b""))
    chain.store.checkpoint()  # the evidence blocks' WAL: not this block's work
    end_timer, root_timer = Timer(chain_epochs.end_block), Timer(Batch.root)
    chain_epochs.end_block = end_timer.wrapped  # Application calls it as epochs.end_block
    Batch.root = root_timer.wrapped  # type: ignore[method-assign]
    req = chain.request()
    profiler = cProfile.Profile() if profile else None
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        if profiler:
            profiler.enable()
        chain.app.finalize_block(req)
        if profiler:
            profiler.disable()
        c1, t1 = time.process_time(), time.perf_counter()
    finally:
        chain_epochs.end_block = end_timer.fn
        Batch.root = root_timer.fn  # type: ignore[method-assign]
    assert chain.app.block is not None
    written = chain.app.block.changes
    c2, t2 = time.process_time(), time.perf_counter()
    chain.app.commit(abci.RequestCommit())
    c3, t3 = time.process_time(), time.perf_counter()
    out = {
        "keys_before": keys_before,
        "keys_written": written,
        "finalize_ms": (t1 - t0) * 1000,
        "finalize_cpu_ms": (c1 - c0) * 1000,
        "end_block_ms": end_timer.seconds * 1000,
        "root_ms": root_timer.seconds * 1000,
        "commit_ms": (t3 - t2) * 1000,
        "commit_cpu_ms": (c3 - c2) * 1000,
    }
    if profiler:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(profile)
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(profile)
        out["profile"] = buf.getvalue()
    return out


def verify(chain: Chain, ev: Evidence) -> dict[str, int]:
    """The committed state after the measured block is what finalizing epoch 1 must leave."""
    st = State(chain.store.batch())
    epoch = st.epoch(EPOCH)
    deviants = sum(ev.deviant)
    assert epoch is not None and epoch.finalized, "epoch 1 is not finalized"
    assert epoch.scored == ev.n, f"scored {epoch.scored}, expected {ev.n}"
    assert epoch.faults == deviants, f"{epoch.faults} faults, expected {deviants}"
    flips = listed = 0
    for i, pk in enumerate(ev.pubkeys):
        _, value, window, trusted, before = ev.expected(i)
        rep = st.reputation(pk)
        prev = ev.previous[i]
        assert rep is not None and rep.last_epoch == EPOCH, f"node {i}: no reputation of epoch {EPOCH}"
        assert (rep.value, rep.window, rep.trusted) == (value, window, trusted), f"node {i}: {rep}"
        assert rep.epochs == prev.epochs + 1
        assert (rep.checked, rep.deviations) == (100, ev.deviations(i)), f"node {i}: {rep}"
        cusum = evidence.accumulate(ev.evidence_rule, 0, 100, ev.deviations(i))
        assert rep.cusum == cusum, f"node {i}: {rep}"
        flips += trusted != before
        listed += trusted
    in_list = sum(1 for _ in st.kv.iterate(layout.node_list_prefix(MODEL)))
    assert in_list == listed, f"{in_list} nodes listed, expected {listed}"
    faults = [Fault.decode(v) for _, v in st.kv.iterate(layout.fault_prefix())]
    kinds = {(f.epoch, f.kind) for f in faults}
    assert len(faults) == deviants and kinds <= {(EPOCH, "deviating-attestation")}, f"faults: {kinds}"
    assert flips > 0 and 0 < listed < ev.n
    return {"flips": flips, "listed": listed, "faults": len(faults)}


def run_worker(n: int, db_url: str, seed: int, profile: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    chain, ev = build(db_url, n, seed)
    setup_s = time.perf_counter() - t0
    out = measure_final(chain, profile)
    out.update(verify(chain, ev))
    out.update(nodes=n, setup_s=setup_s)
    chain.store.close()
    return out


# -- driver -------------------------------------------------------------------------------------


def measure(sizes: list[int], rounds: int, db: str | None, workdir: Path, seed: int,
            profile: int) -> dict[int, list[dict[str, Any]]]:
    """Each size and round in a fresh interpreter and database, sizes in alternating order."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
    jobs = [(r, n) for r in range(rounds) for n in (sizes if r % 2 == 0 else list(reversed(sizes)))]
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("setup + measured block", total=len(jobs))
        for r, n in jobs:
            progress.update(task, description=f"round {r + 1}: {n:,} nodes")
            name = f"epochs-{n}-{r}"
            url = db.replace("{run}", name) if db else f"sqlite:///{workdir / f'{name}.db'}"
            cmd = [sys.executable, __file__, "--worker", str(n), "--db", url, "--seed", str(seed + r),
                   "--profile", str(profile)]
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
            if proc.returncode != 0:
                progress.stop()
                sys.stderr.write(proc.stderr)
                raise SystemExit(f"worker for {n} nodes (round {r + 1}) failed")
            runs[n].append(json.loads(proc.stdout))
            for p in workdir.glob(f"{name}.db*"):
                p.unlink()
            progress.advance(task)
    return runs


COLUMNS = ("finalize_ms", "finalize_cpu_ms", "end_block_ms", "root_ms", "commit_ms", "commit_cpu_ms")


def summarise(runs: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for n, samples in runs.items():
        row: dict[str, Any] = {"nodes": n, "rounds": len(samples)}
        for name in ("keys_before", "keys_written", "flips", "faults"):
            row[name] = samples[0][name]
        for name in (*COLUMNS, "setup_s"):
            row[name] = statistics.median(s[name] for s in samples)
        totals = [s["finalize_ms"] + s["commit_ms"] for s in samples]
        row["total_ms"] = statistics.median(totals)
        row["total_cpu_ms"] = statistics.median(s["finalize_cpu_ms"] + s["commit_cpu_ms"] for s in samples)
        row["min_ms"], row["max_ms"] = min(totals), max(totals)
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]], rounds: int, db_label: str) -> None:
    print(f"\nEpoch finalization in the block that ends epoch {EPOCH} (height {FINAL_HEIGHT}): "
          f"{MEMBERS} members' attestations per node, {db_label}; median of {rounds} round(s); "
          f"target: FinalizeBlock + Commit under {TARGET_MS:.0f} ms (wall) at {TARGET_NODES:,} nodes")
    hdr = (f"{'nodes':>7} {'state keys':>11} {'finalize ms':>12} {'cpu ms':>8} {'end-epoch ms':>13}"
           f" {'root ms':>8} {'commit ms':>10} {'cpu ms':>8} {'total ms':>9} {'min-max ms':>12}"
           f" {'keys written':>13} {'flips':>6} {'faults':>7} {'target':>7} {'setup s':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        target = "ok" if r["total_ms"] < TARGET_MS else "MISSED"
        if r["nodes"] != TARGET_NODES:
            target = f"({target})"
        span = f"{r['min_ms']:.0f}-{r['max_ms']:.0f}"
        print(f"{r['nodes']:>7,} {r['keys_before']:>11,} {r['finalize_ms']:>12.1f}"
              f" {r['finalize_cpu_ms']:>8.1f} {r['end_block_ms']:>13.1f} {r['root_ms']:>8.1f}"
              f" {r['commit_ms']:>10.1f}"
              f" {r['commit_cpu_ms']:>8.1f} {r['total_ms']:>9.1f} {span:>12} {r['keys_written']:>13,}"
              f" {r['flips']:>6,} {r['faults']:>7,} {target:>7} {r['setup_s']:>8.1f}")
    print("end-epoch = planetserve.chain.abci.epochs.end_block (reads the evidence, decides, writes"
          " reputations); root = the app hash (trie update) in FinalizeBlock; cpu = process CPU time")
    ordered = sorted(rows, key=lambda r: r["nodes"])
    biggest = ordered[-1]
    smaller = ordered[-2] if len(ordered) > 1 else biggest  # the next size down
    print(f"{biggest['nodes']:,} nodes: FinalizeBlock + Commit {biggest['total_ms']:.1f} ms = "
          f"{biggest['total_ms'] / TARGET_MS:.2f} of the {TARGET_MS:.0f} ms target"
          f" ({biggest['total_ms'] / biggest['nodes'] * 1000:.1f} us per node)")
    if biggest is not smaller:
        per = [r["total_ms"] / r["nodes"] for r in (smaller, biggest)]
        print(f"per-node cost at {biggest['nodes']:,} vs {smaller['nodes']:,} nodes: {per[1] / per[0]:.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,1000,10000", help="comma-separated numbers of model nodes")
    ap.add_argument("--rounds", type=int, default=3, help="fresh chains per size; the median is reported")
    ap.add_argument("--db", default=None,
                    help="database URL (default: a temp SQLite file per run); every run needs an empty "
                         "database, so with more than one run the URL must contain {run}, replaced by "
                         "epochs-<nodes>-<round> (e.g. sqlite:////tmp/{run}.db)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile the measured FinalizeBlock of each run, print the top N functions")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        out = run_worker(args.worker, args.db, args.seed, args.profile)
        print(json.dumps(out))
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.db and "{run}" not in args.db and len(sizes) * args.rounds > 1:
        ap.error("--db needs {run} in the URL when there is more than one run (sizes x rounds)")
    with tempfile.TemporaryDirectory(prefix="ps-epochs-") as tmp:
        runs = measure(sizes, args.rounds, args.db, Path(tmp), args.seed, args.profile)
    rows = summarise(runs)
    if args.profile:
        for n, samples in runs.items():
            print(f"\n=== profile of the finalizing FinalizeBlock, {n:,} nodes (round 1) ===")
            print(samples[0]["profile"])
    print_table(rows, args.rounds, "PostgreSQL" if args.db and "postgres" in args.db else "SQLite (WAL)")
    if args.json:
        for samples in runs.values():
            for s in samples:
                s.pop("profile", None)
        args.json.write_text(json.dumps({"rows": rows, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
