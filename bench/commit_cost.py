"""Commit cost per block against state size (SQLite), and client-side proof verification time.

Each block changes 1,000 keys: 500 updates of existing user records and 500 inserts of new ones
(keys b"user/<64 hex>", values ~200-byte records). The base state is bulk-loaded as height 1; a few
warm-up blocks run first, then the median over the measured blocks is reported. Target: the block
cost at 1M keys within 2x of the cost at 10k keys.

    .venv/bin/python bench/commit_cost.py                      # 10k, 100k, 1M
    .venv/bin/python bench/commit_cost.py --sizes 10000,100000 --blocks 5 --json out.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from planetserve.chain.store import StateStore
from planetserve.chain.trie import PrefixProof, verify_prefix

BLOCK_UPDATES = 500
BLOCK_INSERTS = 500
REGIONS = ("eu-west", "us-east", "ap-south", "sa-east")


def user_key(i: int, tag: bytes = b"base") -> bytes:
    return b"user/" + hashlib.sha256(tag + i.to_bytes(8, "big")).hexdigest().encode()


def record(key: bytes, version: int, rnd: random.Random) -> bytes:
    """A user-like record of about 200 bytes."""
    body = (
        b'{"pubkey":"'
        + key[5:]
        + b'","region":"'
        + rnd.choice(REGIONS).encode()
        + b'","org":"org-%03d","expires_at":%d,"reputation_ppm":%d,"version":%d}'
        % (rnd.randrange(1000), 1_700_000_000 + rnd.randrange(10**7), rnd.randrange(10**6), version)
    )
    return body + b" " * max(0, 200 - len(body))


def measure_size(n: int, blocks: int, warmup: int, workdir: Path, seed: int) -> dict[str, float]:
    rnd = random.Random(seed)
    keys = sorted(user_key(i) for i in range(n))
    db = workdir / f"state-{n}.db"
    store = StateStore(f"sqlite:///{db}")
    t0 = time.perf_counter()
    store.bulk_load(((k, record(k, 0, rnd)) for k in keys), 1)
    load_s = time.perf_counter() - t0
    totals, roots, writes = [], [], []
    for j in range(warmup + blocks):
        batch_updates = rnd.sample(range(len(keys)), BLOCK_UPDATES)
        new_keys = [user_key(j * BLOCK_INSERTS + t, b"new") for t in range(BLOCK_INSERTS)]
        t0 = time.perf_counter()
        b = store.batch()
        for i in batch_updates:
            b.set(keys[i], record(keys[i], j + 1, rnd))
        for k in new_keys:
            b.set(k, record(k, j + 1, rnd))
        b.root()
        t1 = time.perf_counter()
        store.commit(b, store.height + 1)
        t2 = time.perf_counter()
        keys.extend(new_keys)
        if j >= warmup:
            totals.append((t2 - t0) * 1000)
            roots.append((t1 - t0) * 1000)
            writes.append((t2 - t1) * 1000)
    store.close()
    size_mb = sum(p.stat().st_size for p in workdir.glob(f"state-{n}.db*")) / 2**20
    for p in workdir.glob(f"state-{n}.db*"):
        p.unlink()
    return {
        "state_keys": n,
        "ms_per_block": statistics.median(totals),
        "root_ms": statistics.median(roots),
        "write_ms": statistics.median(writes),
        "min_ms": min(totals),
        "max_ms": max(totals),
        "bulk_load_s": load_s,
        "db_mb": size_mb,
    }


def measure_verify(n_entries: int, others: int, runs: int, workdir: Path, seed: int) -> dict[str, float]:
    rnd = random.Random(seed)
    prefix = b"nlist/tiny-llm/eu-west/"
    listed = sorted(prefix + hashlib.sha256(b"n%d" % i).hexdigest().encode() for i in range(n_entries))
    rest = [user_key(i) for i in range(others)]
    entries_in = sorted([(k, record(k, 0, rnd)) for k in listed] + [(k, record(k, 0, rnd)) for k in rest])
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated state sizes")
    ap.add_argument("--blocks", type=int, default=7, help="measured blocks per size")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured blocks first")
    ap.add_argument("--verify-entries", type=int, default=10_000)
    ap.add_argument("--verify-runs", type=int, default=7)
    ap.add_argument("--dir", type=Path, default=None, help="where the databases go (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        rows = []
        for n in sizes:
            rows.append(measure_size(n, args.blocks, args.warmup, work, args.seed))
            print(f"  measured {n:,} keys", file=sys.stderr, flush=True)
        verify = measure_verify(
            args.verify_entries, args.verify_entries * 9, args.verify_runs, work, args.seed
        )

    base = rows[0]["ms_per_block"]
    print(
        f"\nCommit cost per block: {BLOCK_UPDATES} updates + {BLOCK_INSERTS} inserts, SQLite (WAL, synchronous=NORMAL)"
    )
    print(f"median of {args.blocks} blocks after {args.warmup} warm-up blocks\n")
    hdr = f"{'state keys':>12} {'ms/block':>9} {'root ms':>8} {'write ms':>9} {'min-max ms':>14} {'vs first':>9} {'bulk load s':>12} {'db MiB':>8}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        r["ratio"] = r["ms_per_block"] / base
        span = f"{r['min_ms']:.0f}-{r['max_ms']:.0f}"
        print(
            f"{r['state_keys']:>12,} {r['ms_per_block']:>9.1f} {r['root_ms']:>8.1f} {r['write_ms']:>9.1f}"
            f" {span:>14} {r['ratio']:>8.2f}x {r['bulk_load_s']:>12.1f} {r['db_mb']:>8.0f}"
        )
    print(
        f"\nClient-side verification of a {verify['entries']:,}-entry prefix proof (verify_prefix, decode included)\n"
    )
    hdr2 = f"{'entries':>8} {'state keys':>11} {'proof bytes':>12} {'path steps':>11} {'server prove ms':>16} {'verify ms (median)':>19} {'min':>6}"
    print(hdr2)
    print("-" * len(hdr2))
    v = verify
    print(
        f"{v['entries']:>8,} {v['state_keys']:>11,} {v['proof_bytes']:>12,} {v['path_steps']:>11}"
        f" {v['server_prove_ms']:>16.1f} {v['verify_ms_median']:>19.1f} {v['verify_ms_min']:>6.1f}"
    )
    if args.json:
        args.json.write_text(json.dumps({"commit": rows, "verify": verify}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
