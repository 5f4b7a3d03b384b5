"""Commit cost per block against state size (SQLite), and client-side proof verification time.

The state is laid out as the chain lays out registered users: 3 keys per user,
    user/<64 hex>                       the user record (~200 bytes)
    ulist/<region>/<64 hex>             the same record, in its region's list
    uexp/<12-digit expiry time>/<64 hex>  empty value (the expiry index)
so 10k, 100k and 1M users are 30k, 300k and 3M state keys. Each block changes 1,000 keys: 251
existing users get their record rewritten (user/ and ulist/ keys, 502 updates) and 166 new users
register (498 inserts). The base state is bulk-loaded as height 1; a few warm-up blocks run first,
then the median over the measured blocks is reported. Target: the block cost at 1M users within 2x
of the cost at 10k users. Each size is a store in its own process, under the garbage-collector
settings of `planetserve chain app`; all sizes are loaded first and then take turns, a block each,
so that they are measured over the same minutes of a machine whose speed drifts.

Both wall time and the CPU time of the thread that makes and commits the block (time.thread_time:
Python, hashing and the SQLite library all run on it; the background WAL checkpoint thread is not
counted) are reported per block; on a shared 2-core machine CPU time is the steadier of the two,
since it does not count time spent waiting for a core, so the target column judges the CPU-time
ratio.

Three ways of making a block are measured, one after the other on the same store:
  write   the block only writes: batch.set() x 1,000, root(), commit()
  rmw     as the chain's handlers do: each update reads the record first and each insert checks
          that the key is absent (batch.get() x 1,000), then the same writes, root(), commit()
  pruned  as write, on a store that keeps only the last 2 heights: each commit also deletes the
          nodes that the commit before it replaced (what any keep_heights deletes per block once
          the chain is longer than it); the heights of the first two modes are pruned first
nodes/block is the mean net growth of the node table per measured block (nodes written less nodes
deleted). Every block inserts 498 keys, so the state itself grows by about 1,000 nodes (a leaf and
an inner node per key); an archive also keeps every path a block replaces. KiB written is the size
of the node bodies a block writes (what an archive keeps of it, before database overhead). (The
SQLite file does not shrink: deleted nodes free space inside pages that later appends, at higher
ids, do not reuse until a page empties; PostgreSQL reuses it.)

    .venv/bin/python bench/commit_cost.py                      # 10k, 100k, 1M users
    .venv/bin/python bench/commit_cost.py --sizes 10000,100000 --blocks 5 --json out.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import func, select

from planetserve.chain.abci.server import tune_gc
from planetserve.chain.abci.store import StateStore, nodes_table, orphans_table
from planetserve.chain.trie import PrefixProof, verify_prefix

BLOCK_UPDATE_USERS = 251  # x 2 keys (user/ and ulist/ records) = 502 updates
BLOCK_NEW_USERS = 166  # x 3 keys = 498 inserts
BLOCK_KEYS = 2 * BLOCK_UPDATE_USERS + 3 * BLOCK_NEW_USERS
REGIONS = ("ap-south", "eu-west", "sa-east", "us-east")
MODES = ("write", "rmw", "pruned")
PRUNED_KEEP = 2
TARGET_RATIO = 2.0


def user_id(i: int, tag: bytes = b"base") -> bytes:
    return hashlib.sha256(tag + i.to_bytes(8, "big")).hexdigest().encode()


def region_of(uid: bytes) -> bytes:
    return REGIONS[int(uid[:2], 16) % len(REGIONS)].encode()


def expiry_of(uid: bytes) -> int:
    return 1_700_000_000 + int(uid[2:10], 16) % 10**7


def user_key(uid: bytes) -> bytes:
    return b"user/" + uid


def ulist_key(uid: bytes) -> bytes:
    return b"ulist/" + region_of(uid) + b"/" + uid


def uexp_key(uid: bytes) -> bytes:
    return b"uexp/%012d/" % expiry_of(uid) + uid


def user_keys(uid: bytes) -> list[bytes]:
    return [user_key(uid), ulist_key(uid), uexp_key(uid)]


def record(uid: bytes, version: int, rnd: random.Random) -> bytes:
    """A user-like record of about 200 bytes."""
    body = b'{"pubkey":"%s","region":"%s","org":"org-%03d","expires_at":%d,"rep_ppm":%d,"v":%d}' % (
        uid,
        region_of(uid),
        rnd.randrange(1000),
        expiry_of(uid),
        rnd.randrange(10**6),
        version,
    )
    return body + b" " * max(0, 200 - len(body))


def state_entries(uids: list[bytes], rnd: random.Random) -> Iterator[tuple[bytes, bytes]]:
    """The 3 keys of every user, in key order ("uexp/" < "ulist/" < "user/")."""
    for k, _ in sorted((uexp_key(u), u) for u in uids):
        yield k, b""
    for k, u in sorted((ulist_key(u), u) for u in uids):
        yield k, record(u, 0, rnd)
    for u in uids:  # sorted by the caller
        yield user_key(u), record(u, 0, rnd)


def run_block(
    store: StateStore, mode: str, updates: list[bytes], inserts: list[bytes], j: int, rnd: random.Random
) -> tuple[float, float, float]:
    """One block; returns (ms until the root is known, ms of commit, CPU ms of the whole block)."""
    c0 = time.thread_time()
    t0 = time.perf_counter()
    b = store.batch()
    for uid in updates:
        rec = record(uid, j, rnd)
        for k in (user_key(uid), ulist_key(uid)):
            if mode == "rmw" and b.get(k) is None:
                raise AssertionError("update of a missing key")
            b.set(k, rec)
    for uid in inserts:
        rec = record(uid, j, rnd)
        for k, v in zip(user_keys(uid), (rec, rec, b""), strict=True):
            if mode == "rmw" and b.get(k) is not None:
                raise AssertionError("insert of a present key")
            b.set(k, v)
    assert b.changes == BLOCK_KEYS
    b.root()
    t1 = time.perf_counter()
    store.commit(b, store.height + 1)
    t2 = time.perf_counter()
    c1 = time.thread_time()
    return (t1 - t0) * 1000, (t2 - t1) * 1000, (c1 - c0) * 1000


class Subject:
    """One store of a given number of users and the users it holds."""

    def __init__(self, users: int, workdir: Path, seed: int, cache_mib: int) -> None:
        self.users = users
        self.rnd = random.Random(seed)
        self.uids = sorted(user_id(i) for i in range(users))
        self.path = workdir / f"state-{users}.db"
        self.store = StateStore(f"sqlite:///{self.path}", cache_bytes=cache_mib << 20)
        t0 = time.perf_counter()
        self.store.bulk_load(state_entries(self.uids, self.rnd), 1)
        self.bulk_load_s = time.perf_counter() - t0
        tune_gc()  # as `planetserve chain app` does once its state is open
        self.inserted = 0

    def block(self, mode: str, j: int) -> tuple[float, float, float, int, int]:
        """One block of `mode`: (root ms, commit ms, CPU ms, node table growth, bytes written)."""
        rnd = self.rnd
        updates = [self.uids[i] for i in rnd.sample(range(len(self.uids)), BLOCK_UPDATE_USERS)]
        inserts = [user_id(self.inserted + t, b"new") for t in range(BLOCK_NEW_USERS)]
        self.inserted += BLOCK_NEW_USERS
        store = self.store
        first_id, orphans = store._next_id, self.orphan_ids()
        sample = run_block(store, mode, updates, inserts, j, rnd)
        deleted = orphans + self.orphan_ids(store.height) - self.orphan_ids()
        written = select(func.coalesce(func.sum(func.length(nodes_table.c.body)), 0)).where(
            nodes_table.c.id >= first_id)
        with store._engine.connect() as conn:
            written_bytes = conn.execute(written).scalar()
        sample = (*sample, store._next_id - first_id - deleted, written_bytes)
        self.uids.extend(inserts)
        return sample

    def orphan_ids(self, height: int | None = None) -> int:
        """How many replaced node ids wait for pruning (those of `height` only, if given)."""
        q = select(func.coalesce(func.sum(func.length(orphans_table.c.ids)), 0))
        if height is not None:
            q = q.where(orphans_table.c.height == height)
        with self.store._engine.connect() as conn:
            return conn.execute(q).scalar() // 8

    def pruning_backlog(self) -> bool:
        """Whether heights older than the store keeps still have nodes to delete."""
        store = self.store
        with store._engine.connect() as conn:
            oldest = conn.execute(select(func.min(orphans_table.c.height))).scalar()
        return oldest is not None and oldest <= store.height - store.keep_heights + 1

    def result(self) -> dict[str, object]:
        self.store.close()
        files = list(self.path.parent.glob(self.path.name + "*"))
        out: dict[str, object] = {
            "users": self.users,
            "state_keys": 3 * self.users,
            "bulk_load_s": self.bulk_load_s,
            "db_mb": sum(p.stat().st_size for p in files) / 2**20,
        }
        for p in files:
            p.unlink()
        return out


def serve_worker(users: int, workdir: Path, seed: int, cache_mib: int) -> None:
    """One size in this process: bulk load, then make blocks as the parent asks, one JSON line in
    and one out per request (so that the parent can interleave the sizes block by block)."""
    subject = Subject(users, workdir, seed, cache_mib)
    print(json.dumps({"users": users, "bulk_load_s": subject.bulk_load_s}), flush=True)
    j = 0
    for line in sys.stdin:
        req = json.loads(line)
        reply: dict[str, object] = {}
        if req["op"] == "block":
            j += 1
            reply["sample"] = subject.block(req["mode"], j)
        elif req["op"] == "prune":  # switch to pruning and drain what earlier heights left
            subject.store.keep_heights = PRUNED_KEEP
            while subject.pruning_backlog():
                j += 1
                subject.block("pruned", j)
        else:
            reply = subject.result()
        print(json.dumps(reply), flush=True)
        if req["op"] == "finish":
            return


class Worker:
    """A `serve_worker` process for one size."""

    def __init__(self, users: int, workdir: Path, seed: int, cache_mib: int) -> None:
        cmd = [sys.executable, __file__, "--worker", str(users), "--seed", str(seed), "--dir", str(workdir),
               "--cache-mib", str(cache_mib)]  # fmt: skip
        self.users = users
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def reply(self) -> dict:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"the {self.users:,}-user worker died (exit {self.proc.wait()})")
        return json.loads(line)

    def ask(self, **req: object) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.reply()


def measure(sizes: list[int], blocks: int, warmup: int, rounds: int, workdir: Path, seed: int,
            cache_mib: int) -> list[dict]:
    """Every size is a store in its own interpreter (so no size pays for another's memory); all
    are loaded first, then the blocks alternate between them, one size at a time, in ascending
    then descending order. The sizes are measured side by side over the same minutes, so a
    machine that slows down for a while (other tenants, frequency changes) does not bias the
    ratio. `rounds` repeats everything on fresh stores; the medians are over every round."""
    merged = {n: {"users": n, "state_keys": 3 * n, "bulk_load_s": [], "db_mb": 0.0,
                  "samples": {m: [] for m in MODES}} for n in sizes}  # fmt: skip
    for r in range(rounds):
        workers = [Worker(n, workdir, seed + r, cache_mib) for n in sizes]
        for w in workers:
            merged[w.users]["bulk_load_s"].append(w.reply()["bulk_load_s"])
        loaded = ", ".join(f"{n:,}" for n in sizes)
        print(f"  round {r + 1}: {loaded} users loaded", file=sys.stderr, flush=True)
        for mode in MODES:
            if mode == "pruned":
                for w in workers:
                    w.ask(op="prune")
            for b in range(warmup + blocks):
                for w in workers if b % 2 == 0 else reversed(workers):
                    sample = w.ask(op="block", mode=mode)["sample"]
                    if b >= warmup:
                        merged[w.users]["samples"][mode].append(sample)
        for w in workers:
            merged[w.users]["db_mb"] = w.ask(op="finish")["db_mb"]
            w.proc.wait()
        print(f"  round {r + 1} done", file=sys.stderr, flush=True)
    rows = []
    for n in sizes:
        row = merged[n]
        out: dict[str, object] = {
            "users": n,
            "state_keys": row["state_keys"],
            "bulk_load_s": statistics.median(row["bulk_load_s"]),
            "db_mb": row["db_mb"],
        }
        for m in MODES:
            samples = row["samples"][m]
            totals = [r + c for r, c, *_ in samples]
            out[m] = {
                "blocks": len(samples),
                "ms_per_block": statistics.median(totals),
                "cpu_ms_per_block": statistics.median(x[2] for x in samples),
                "root_ms": statistics.median(x[0] for x in samples),
                "commit_ms": statistics.median(x[1] for x in samples),
                "node_growth": statistics.mean(x[3] for x in samples),
                "written_kib": statistics.mean(x[4] for x in samples) / 1024,
                "min_ms": min(totals),
                "max_ms": max(totals),
            }
        rows.append(out)
    return rows


def measure_verify(n_entries: int, others: int, runs: int, workdir: Path, seed: int) -> dict[str, float]:
    rnd = random.Random(seed)
    prefix = b"nlist/tiny-llm/eu-west/"
    listed = [prefix + hashlib.sha256(b"n%d" % i).hexdigest().encode() for i in range(n_entries)]
    rest = [user_key(user_id(i)) for i in range(others)]
    entries_in = sorted((k, record(k[-64:], 0, rnd)) for k in listed + rest)
    store = StateStore(f"sqlite:///{workdir / 'verify.db'}")
    root = store.bulk_load(entries_in, 1)
    t0 = time.perf_counter()
    entries, proof = store.prove_prefix(prefix, n_entries)
    prove_ms = (time.perf_counter() - t0) * 1000
    encoded = proof.encode()
    store.close()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        verify_prefix(root, prefix, entries, PrefixProof.decode(encoded))
        times.append((time.perf_counter() - t0) * 1000)
    return {
        "entries": len(entries),
        "state_keys": len(entries_in),
        "proof_bytes": len(encoded),
        "path_steps": len(proof.steps),
        "server_prove_ms": prove_ms,
        "verify_ms_median": statistics.median(times),
        "verify_ms_min": min(times),
    }


def print_tables(rows: list[dict], verify: dict, blocks: int, warmup: int) -> None:
    for mode in MODES:
        base = rows[0][mode]
        print(
            f"\nCommit cost per block [{mode}]: {BLOCK_KEYS:,} keys ({2 * BLOCK_UPDATE_USERS} updates +"
            f" {3 * BLOCK_NEW_USERS} inserts), SQLite (WAL, synchronous=NORMAL); median of {blocks}"
            f" blocks (each run: {warmup} warm-up first); target: within {TARGET_RATIO:.0f}x of the"
            f" first size"
        )
        hdr = (
            f"{'users':>10} {'state keys':>11} {'ms/block':>9} {'cpu ms':>8} {'root ms':>8}"
            f" {'commit ms':>10} {'min-max ms':>12} {'wall vs 1st':>12} {'cpu vs 1st':>11}"
            f" {'target':>7} {'bulk load s':>12} {'db MiB':>7} {'nodes/block':>12} {'KiB written':>12}"
        )
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            m = r[mode]
            m["ratio"] = m["ms_per_block"] / base["ms_per_block"]
            m["cpu_ratio"] = m["cpu_ms_per_block"] / base["cpu_ms_per_block"]
            ok = "ok" if m["cpu_ratio"] <= TARGET_RATIO else "MISSED"  # judged on CPU time
            span = f"{m['min_ms']:.0f}-{m['max_ms']:.0f}"
            print(
                f"{r['users']:>10,} {r['state_keys']:>11,} {m['ms_per_block']:>9.1f}"
                f" {m['cpu_ms_per_block']:>8.1f} {m['root_ms']:>8.1f} {m['commit_ms']:>10.1f}"
                f" {span:>12} {m['ratio']:>11.2f}x {m['cpu_ratio']:>10.2f}x {ok:>7}"
                f" {r['bulk_load_s']:>12.1f} {r['db_mb']:>7.0f} {m['node_growth']:>12,.0f}"
                f" {m['written_kib']:>12,.0f}"
            )
    v = verify
    print(f"\nClient-side verification of a {v['entries']:,}-entry prefix proof (decode + verify_prefix)")
    hdr2 = (
        f"{'entries':>8} {'state keys':>11} {'proof bytes':>12} {'path steps':>11}"
        f" {'server prove ms':>16} {'verify ms (median)':>19} {'min ms':>7}"
    )
    print(hdr2)
    print("-" * len(hdr2))
    print(
        f"{v['entries']:>8,} {v['state_keys']:>11,} {v['proof_bytes']:>12,} {v['path_steps']:>11}"
        f" {v['server_prove_ms']:>16.1f} {v['verify_ms_median']:>19.1f} {v['verify_ms_min']:>7.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated numbers of users")
    ap.add_argument("--blocks", type=int, default=15, help="measured blocks per size, mode and round")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured blocks first")
    ap.add_argument("--verify-entries", type=int, default=10_000)
    ap.add_argument("--verify-runs", type=int, default=7)
    ap.add_argument("--dir", type=Path, default=None, help="where the databases go (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cache-mib", type=int, default=384, help="the store's node cache (its default: 384)")
    ap.add_argument("--rounds", type=int, default=1, help="repetitions of the whole run on fresh stores")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        assert args.dir is not None
        serve_worker(args.worker, args.dir, args.seed, args.cache_mib)
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        rows = measure(sizes, args.blocks, args.warmup, args.rounds, work, args.seed, args.cache_mib)
        verify = measure_verify(
            args.verify_entries, args.verify_entries * 9, args.verify_runs, work, args.seed
        )

    print_tables(rows, verify, args.blocks * args.rounds, args.warmup)
    if args.json:
        args.json.write_text(json.dumps({"commit": rows, "verify": verify}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
