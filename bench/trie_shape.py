"""How many trie nodes a 1,000-key block rewrites: a binary trie against the state's byte-wide one.

The commit cost of a block is mostly Python's work per rewritten node (`bench/commit_cost.py`), so
the number of nodes on the changed keys' paths decides how the cost grows with the state. This
counts them, for the chain's key layout and block of `commit_cost.py`, in two shapes of compressed
trie over the same terminated keys:

  binary  a crit-bit trie: an inner node wherever the keys below a bit prefix differ in the next
          bit (the state's earlier format, which missed the commit-cost target)
  byte    one node per byte prefix where the keys below it differ in the next byte, up to 128
          children (what `planetserve.chain.trie` builds)

Leaves are one per changed key in both. Nothing is hashed or stored: the counts come from the
sorted key set alone (a node sits at prefix p iff the first and last key starting with p differ
at p's next bit or byte). Byte-wide nodes are wider (16 children on a level of hex digits), which
costs little only because the store rewrites a node by splicing the changed child hashes into it.

    .venv/bin/python bench/trie_shape.py [--sizes 10000,100000,1000000]
"""

from __future__ import annotations

import argparse
import random
from bisect import bisect_left

from commit_cost import BLOCK_NEW_USERS, BLOCK_UPDATE_USERS, ulist_key, user_id, user_key, user_keys

TARGET_RATIO = 2.0


def block_keys(uids: list[bytes], rnd: random.Random) -> list[bytes]:
    """The terminated keys a commit_cost block changes: 251 records rewritten, 166 users added."""
    updated = [uids[i] for i in rnd.sample(range(len(uids)), BLOCK_UPDATE_USERS)]
    added = [user_id(t, b"new") for t in range(BLOCK_NEW_USERS)]
    keys = {k for u in updated for k in (user_key(u), ulist_key(u))}
    keys |= {k for u in added for k in user_keys(u)}
    return sorted(k + b"\x00" for k in keys)


def byte_nodes(state: list[bytes], changed: list[bytes]) -> int:
    """Inner nodes of the byte-wide trie on the changed keys' paths."""
    nodes = set()
    for key in changed:
        for depth in range(len(key)):
            p = key[:depth]
            lo = bisect_left(state, p)
            hi = bisect_left(state, p + b"\xff") - 1
            if state[lo][depth] != state[hi][depth]:
                nodes.add(p)
            elif lo == hi:
                break
    return len(nodes)


def binary_nodes(state: list[bytes], changed: list[bytes]) -> int:
    """Inner nodes of the binary trie on the changed keys' paths: keys are integers left-aligned
    to the longest, and a bit prefix's keys form a range of them."""
    width = 8 * max(map(len, state))
    ints = [int.from_bytes(k, "big") << (width - 8 * len(k)) for k in state]
    nodes = set()
    for key in changed:
        x = int.from_bytes(key, "big") << (width - 8 * len(key))
        for depth in range(8 * len(key)):
            shift = width - depth
            lo = bisect_left(ints, (x >> shift) << shift)
            hi = bisect_left(ints, ((x >> shift) + 1) << shift) - 1
            if lo == hi:
                break
            if (ints[lo] >> (shift - 1)) & 1 != (ints[hi] >> (shift - 1)) & 1:
                nodes.add((depth, x >> shift))
    return len(nodes)


def measure(users: int, seed: int) -> dict[str, int]:
    rnd = random.Random(seed)
    uids = sorted(user_id(i) for i in range(users))
    changed = block_keys(uids, rnd)
    state = sorted({k + b"\x00" for u in uids for k in user_keys(u)} | set(changed))
    return {"users": users, "state_keys": len(state), "changed": len(changed),
            "binary": binary_nodes(state, changed), "byte": byte_nodes(state, changed)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated numbers of users")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rows = [measure(int(n), args.seed) for n in args.sizes.split(",")]
    print("Nodes a 1,000-key block rewrites (inner nodes on the changed paths + one leaf per key)")
    hdr = (f"{'users':>10} {'state keys':>11} {'binary':>8} {'byte':>8} {'binary/byte':>12}"
           f" {'binary vs 1st':>14} {'byte vs 1st':>12}")  # fmt: skip
    print(hdr)
    print("-" * len(hdr))
    first = rows[0]
    for r in rows:
        b, w = r["binary"] + r["changed"], r["byte"] + r["changed"]
        b0, w0 = first["binary"] + first["changed"], first["byte"] + first["changed"]
        print(f"{r['users']:>10,} {r['state_keys']:>11,} {b:>8,} {w:>8,} {b / w:>11.2f}x"
              f" {b / b0:>13.2f}x {w / w0:>11.2f}x")  # fmt: skip
    last = rows[-1]
    b_ratio = (last["binary"] + last["changed"]) / (first["binary"] + first["changed"])
    w_ratio = (last["byte"] + last["changed"]) / (first["byte"] + first["changed"])
    print(f"node-count growth from {first['users']:,} to {last['users']:,} users: binary {b_ratio:.2f}x,"
          f" byte {w_ratio:.2f}x (the commit-cost target is {TARGET_RATIO:.0f}x in time)")


if __name__ == "__main__":
    main()
