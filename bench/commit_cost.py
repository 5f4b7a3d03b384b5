"""Commit cost per block against state size (SQLite), and client-side proof verification time.

Each block changes 1,000 keys: 500 updates of existing user records and 500 inserts of new ones
(keys b"user/<64 hex>", values ~200-byte records). The base state is bulk-loaded as height 1; a few
warm-up blocks run first, then the median over the measured blocks is reported. Target: the block
cost at 1M keys within 2x of the cost at 10k keys.

Two ways of making a block are measured:
  write  the block only writes: batch.set() x 1,000, root(), commit()
  rmw    as the chain's handlers do: each update reads the record first and each insert checks
         that the key is absent (batch.get() x 1,000), then the same writes, root(), commit()

    .venv/bin/python bench/commit_cost.py                      # 10k, 100k, 1M
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
from pathlib import Path

from planetserve.chain.store import StateStore
from planetserve.chain.trie import PrefixProof, verify_prefix

BLOCK_UPDATES = 500
BLOCK_INSERTS = 500
REGIONS = ("eu-west", "us-east", "ap-south", "sa-east")
MODES = ("write", "rmw")


def user_key(i: int, tag: bytes = b"base") -> bytes:
    return b"user/" + hashlib.sha256(tag + i.to_bytes(8, "big")).hexdigest().encode()


def record(key: bytes, version: int, rnd: random.Random) -> bytes:
    """A user-like record of about 200 bytes."""
    body = b'{"pubkey":"%s","region":"%s","org":"org-%03d","expires_at":%d,"rep_ppm":%d,"v":%d}' % (
        key[5:],
        rnd.choice(REGIONS).encode(),
        rnd.randrange(1000),
        1_700_000_000 + rnd.randrange(10**7),
        rnd.randrange(10**6),
        version,
    )
    return body + b" " * max(0, 200 - len(body))


def run_block(
    store: StateStore, mode: str, updates: list[bytes], inserts: list[bytes], j: int, rnd: random.Random
) -> tuple[float, float]:
    """One block; returns (ms until the root is known, ms of commit)."""
    t0 = time.perf_counter()
    b = store.batch()
    for k in updates:
        if mode == "rmw" and b.get(k) is None:
            raise AssertionError("update of a missing key")
        b.set(k, record(k, j, rnd))
    for k in inserts:
        if mode == "rmw" and b.get(k) is not None:
            raise AssertionError("insert of a present key")
        b.set(k, record(k, j, rnd))
    b.root()
    t1 = time.perf_counter()
    store.commit(b, store.height + 1)
    t2 = time.perf_counter()
    return (t1 - t0) * 1000, (t2 - t1) * 1000


class Subject:
    """One store of a given size and the keys it holds."""

    def __init__(self, n: int, workdir: Path, seed: int) -> None:
        self.n = n
        self.rnd = random.Random(seed)
        self.keys = sorted(user_key(i) for i in range(n))
        self.path = workdir / f"state-{n}.db"
        self.store = StateStore(f"sqlite:///{self.path}")
        t0 = time.perf_counter()
        self.store.bulk_load(((k, record(k, 0, self.rnd)) for k in self.keys), 1)
        self.bulk_load_s = time.perf_counter() - t0
        self.inserted = 0
        self.samples: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}

    def block(self, mode: str, j: int, keep: bool) -> None:
        rnd = self.rnd
        updates = [self.keys[i] for i in rnd.sample(range(len(self.keys)), BLOCK_UPDATES)]
        inserts = [user_key(self.inserted + t, b"new") for t in range(BLOCK_INSERTS)]
        self.inserted += BLOCK_INSERTS
        root_ms, commit_ms = run_block(self.store, mode, updates, inserts, j, rnd)
        self.keys.extend(inserts)
        if keep:
            self.samples[mode].append((root_ms, commit_ms))

    def result(self) -> dict[str, object]:
        self.store.close()
        files = list(self.path.parent.glob(self.path.name + "*"))
        out: dict[str, object] = {
            "state_keys": self.n,
            "bulk_load_s": self.bulk_load_s,
            "db_mb": sum(p.stat().st_size for p in files) / 2**20,
        }
        for p in files:
            p.unlink()
        return out


def run_worker(n: int, blocks: int, warmup: int, workdir: Path, seed: int) -> dict[str, object]:
    """Measure one size in this process: bulk load, then `warmup + blocks` blocks per mode."""
    subject = Subject(n, workdir, seed)
    j = 0
    for mode in MODES:
        for r in range(warmup + blocks):
            j += 1
            subject.block(mode, j, keep=r >= warmup)
    samples = {m: subject.samples[m] for m in MODES}
    out = subject.result()
    out["samples"] = samples
    return out


def measure(sizes: list[int], blocks: int, warmup: int, rounds: int, workdir: Path, seed: int) -> list[dict]:
    """Each size runs in a fresh interpreter (so no size pays for another's memory), `rounds`
    times in alternating order (so that load from other processes spreads over every size); the
    medians are over the blocks of all rounds."""
    merged: dict[int, dict] = {}
    for r in range(rounds):
        for n in sizes if r % 2 == 0 else list(reversed(sizes)):
            cmd = [sys.executable, __file__, "--worker", str(n), "--blocks", str(blocks),
                   "--warmup", str(warmup), "--seed", str(seed + r), "--dir", str(workdir)]  # fmt: skip
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            print(f"  round {r + 1}: {n:,} keys done", file=sys.stderr, flush=True)
            if n not in merged:
                merged[n] = {"state_keys": n, "bulk_load_s": [], "db_mb": res["db_mb"],
                             "samples": {m: [] for m in MODES}}  # fmt: skip
            merged[n]["bulk_load_s"].append(res["bulk_load_s"])
            for m in MODES:
                merged[n]["samples"][m].extend(res["samples"][m])
    rows = []
    for n in sizes:
        row = merged[n]
        out: dict[str, object] = {
            "state_keys": n,
            "bulk_load_s": statistics.median(row["bulk_load_s"]),
            "db_mb": row["db_mb"],
        }
        for m in MODES:
            samples = row["samples"][m]
            totals = [r + c for r, c in samples]
            out[m] = {
                "blocks": len(samples),
                "ms_per_block": statistics.median(totals),
                "root_ms": statistics.median(r for r, _ in samples),
                "commit_ms": statistics.median(c for _, c in samples),
                "min_ms": min(totals),
                "max_ms": max(totals),
            }
        rows.append(out)
    return rows


def measure_verify(n_entries: int, others: int, runs: int, workdir: Path, seed: int) -> dict[str, float]:
    rnd = random.Random(seed)
    prefix = b"nlist/tiny-llm/eu-west/"
    listed = [prefix + hashlib.sha256(b"n%d" % i).hexdigest().encode() for i in range(n_entries)]
    rest = [user_key(i) for i in range(others)]
    entries_in = sorted((k, record(k, 0, rnd)) for k in listed + rest)
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
        base = rows[0][mode]["ms_per_block"]
        print(
            f"\nCommit cost per block [{mode}]: {BLOCK_UPDATES} updates + {BLOCK_INSERTS} inserts, "
            f"SQLite (WAL, synchronous=NORMAL); median of {blocks} blocks (each run: {warmup} warm-up first)"
        )
        hdr = (
            f"{'state keys':>12} {'ms/block':>9} {'root ms':>8} {'commit ms':>10} {'min-max ms':>12}"
            f" {'vs first':>9} {'bulk load s':>12} {'db MiB':>7}"
        )
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            m = r[mode]
            m["ratio"] = m["ms_per_block"] / base
            span = f"{m['min_ms']:.0f}-{m['max_ms']:.0f}"
            print(
                f"{r['state_keys']:>12,} {m['ms_per_block']:>9.1f} {m['root_ms']:>8.1f}"
                f" {m['commit_ms']:>10.1f} {span:>12} {m['ratio']:>8.2f}x"
                f" {r['bulk_load_s']:>12.1f} {r['db_mb']:>7.0f}"
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
    ap.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated state sizes")
    ap.add_argument("--blocks", type=int, default=9, help="measured blocks per size, mode and round")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured blocks first")
    ap.add_argument("--verify-entries", type=int, default=10_000)
    ap.add_argument("--verify-runs", type=int, default=7)
    ap.add_argument("--dir", type=Path, default=None, help="where the databases go (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="repetitions of every size, alternating order")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        assert args.dir is not None
        print(json.dumps(run_worker(args.worker, args.blocks, args.warmup, args.dir, args.seed)))
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        rows = measure(sizes, args.blocks, args.warmup, args.rounds, work, args.seed)
        verify = measure_verify(
            args.verify_entries, args.verify_entries * 9, args.verify_runs, work, args.seed
        )

    print_tables(rows, verify, args.blocks * args.rounds, args.warmup)
    if args.json:
        args.json.write_text(json.dumps({"commit": rows, "verify": verify}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
