"""The authenticated state: a canonical compressed binary Patricia (crit-bit) Merkle trie.

Pure code: no I/O. The state store (`planetserve.chain.store`) keeps the nodes in a database and
injects a loader; the client side only needs `verify_prefix` / `verify_key`.

Keys and bits
    A state key is a non-empty byte string of at most `MAX_KEY_LEN` bytes in 0x01..0x7f (ASCII
    without NUL). Inside the trie every key is *terminated* with one 0x00 byte, so that no
    terminated key is a prefix of another. Bits are numbered from 0, most significant bit of byte 0
    first. Values are arbitrary byte strings.

Structure (canonical: the node set depends only on the set of (key, value) pairs)
    * a leaf holds one key;
    * an inner node has exactly two children and a *prefix*: the longest common bit-prefix of all
      terminated keys below it, of length L bits. Its left child holds the keys whose bit L is 0,
      the right child those whose bit L is 1.

Hashes (SHA-256, H; integers big-endian; "||" is concatenation)
    leaf  = H(0x00 || u32 len(key) || key || H(value))          (key without the terminator)
    inner = H(0x01 || u16 L || prefix || left || right)
            where prefix is the first L bits of the terminated keys packed into ceil(L/8) bytes,
            the unused low bits of the last byte zero, and left/right are the children's hashes.
    EMPTY_ROOT = H(0x02)                                         (the root of the empty trie)
    The root hash is the app hash.

Node bodies (what a node store keeps)
    inner: exactly the inner hash pre-image above, so hash = H(body);
    leaf:  the leaf hash pre-image followed by the value itself, so hash = H(body[:37 + len(key)]).
    Where a body is stored is the node store's business: the trie code passes opaque node
    references (`Ref`) around, loads nodes through a `Loader` and returns new nodes with their
    children's refs (`NewNode`). `MemoryNodes` is a content-addressed store (ref = hash) in a dict;
    the state store uses row ids.

Prefix queries
    The answer to "every entry whose key starts with P" is the leaf set of one subtree: the
    highest node whose keys all start with P (terminated keys; a single key K is the prefix K||0x00),
    or nothing. A `PrefixProof` is the path from the root down to that node: for each ancestor the
    length L of its prefix (the prefix bits themselves are the first L bits of P, and the side taken
    is bit L of P, so neither is sent) and the hash of the sibling on the other side; then a
    terminal part:
      SUBTREE        the client recomputes the subtree root from the returned entries;
      EMPTY          the trie is empty (no path; the root is EMPTY_ROOT);
      INNER_OPENING  (for an empty answer) the node where the path leaves P: its prefix and child
                     hashes, showing that its prefix disagrees with P within both lengths;
      LEAF_OPENING   (for an empty answer) the leaf where the path ends: its key and value hash,
                     showing that the key does not start with P.
    Every ancestor must have a prefix strictly shorter than P (with strictly increasing lengths),
    so the terminal node is the highest node under P: no entry can be left out.

Proof encoding (msgpack, canonical: decoding and re-encoding gives back the same bytes)
    [1, kind, steps, opening]
    kind     0 SUBTREE, 1 EMPTY, 2 INNER_OPENING, 3 LEAF_OPENING
    steps    bin: root first, per step u16 L || sibling hash (34 bytes per step)
    opening  nil for SUBTREE and EMPTY; [L, prefix, left, right] for INNER_OPENING;
             [key, value_hash] for LEAF_OPENING.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack

__all__ = [
    "EMPTY_ROOT",
    "HASH_LEN",
    "MAX_KEY_LEN",
    "InnerOpening",
    "LeafOpening",
    "MemoryNodes",
    "ProofError",
    "ProofKind",
    "PrefixProof",
    "TrieBuilder",
    "apply_changes",
    "check_key",
    "check_prefix",
    "collect_leaves",
    "inner_body",
    "leaf_body",
    "leaf_hash",
    "make_prefix_proof",
    "node_hash",
    "parse_inner",
    "parse_leaf",
    "subtree_root",
    "verify_key",
    "verify_prefix",
]

HASH_LEN = 32
MAX_KEY_LEN = 1024
"""Longest state key in bytes (without the terminator)."""
MAX_KEY_BITS = 8 * (MAX_KEY_LEN + 1)
"""Longest terminated key in bits; every prefix length in the trie is below it."""
MAX_STEPS = MAX_KEY_BITS
STEP_LEN = 2 + HASH_LEN
MAX_PROOF_BYTES = 64 + MAX_STEPS * STEP_LEN + 2 * (MAX_KEY_LEN + 64)
"""Upper bound on an encoded proof; anything longer is rejected before decoding."""
PROOF_VERSION = 1

_sha256 = hashlib.sha256
EMPTY_ROOT = _sha256(b"\x02").digest()
"""The root of the empty trie: H(0x02)."""

_LEAF = 0
_INNER = 1


class ProofError(Exception):
    """A proof (or the answer it comes with) does not check out against the app hash."""


# -- keys and bits -------------------------------------------------------------------------------


def check_key(key: bytes) -> None:
    """Raise ValueError unless `key` is a valid state key (1..MAX_KEY_LEN bytes in 0x01..0x7f)."""
    if not isinstance(key, bytes):
        raise TypeError(f"state key must be bytes, not {type(key).__name__}")
    if not key:
        raise ValueError("state key must not be empty")
    if len(key) > MAX_KEY_LEN:
        raise ValueError(f"state key is {len(key)} bytes, longer than {MAX_KEY_LEN}")
    if not key.isascii() or b"\x00" in key:
        raise ValueError(f"state key {key[:80]!r} is not ASCII without NUL")


def check_prefix(prefix: bytes) -> None:
    """Raise ValueError unless `prefix` can start a terminated key: ASCII without NUL, optionally
    followed by one final NUL (a prefix ending in NUL selects exactly one key)."""
    if not isinstance(prefix, bytes):
        raise TypeError(f"prefix must be bytes, not {type(prefix).__name__}")
    body = prefix[:-1] if prefix.endswith(b"\x00") else prefix
    if len(body) > MAX_KEY_LEN:
        raise ValueError(f"prefix is {len(prefix)} bytes, longer than a key can be")
    if not body.isascii() or b"\x00" in body:
        raise ValueError(f"prefix {prefix[:80]!r} is not ASCII with at most one final NUL")
    if prefix == b"\x00":
        raise ValueError("prefix b'\\x00' selects the empty key, which cannot exist")


def _pack(bits: bytes, nbits: int) -> bytes:
    """The first `nbits` bits of `bits`, packed, the unused low bits of the last byte zero."""
    nb = (nbits + 7) >> 3
    r = nbits & 7
    if not r:
        return bits[:nb]
    return bits[: nb - 1] + bytes((bits[nb - 1] & (0xFF00 >> r) & 0xFF,))


def _common_bits(a: bytes, b: bytes) -> int:
    """Number of leading bits `a` and `b` agree on, looking at most at their common byte length."""
    n = min(len(a), len(b))
    x = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
    return 8 * n - x.bit_length()


def _bit(data: bytes, i: int) -> int:
    return (data[i >> 3] >> (7 - (i & 7))) & 1


# -- hashes and node bodies ----------------------------------------------------------------------


def leaf_hash(key: bytes, value: bytes) -> bytes:
    return _sha256(b"\x00" + len(key).to_bytes(4, "big") + key + _sha256(value).digest()).digest()


def leaf_body(key: bytes, value: bytes) -> bytes:
    return b"\x00" + len(key).to_bytes(4, "big") + key + _sha256(value).digest() + value


def inner_body(nbits: int, bits: bytes, left: bytes, right: bytes) -> bytes:
    """An inner node's body (= its hash pre-image); `bits` holds at least `nbits` bits."""
    return b"\x01" + nbits.to_bytes(2, "big") + _pack(bits, nbits) + left + right


def node_hash(body: bytes) -> bytes:
    if body[0] == _INNER:
        return _sha256(body).digest()
    klen = int.from_bytes(body[1:5], "big")
    return _sha256(body[: 37 + klen]).digest()


def parse_inner(body: bytes) -> tuple[int, bytes, bytes, bytes]:
    """(prefix length in bits, packed prefix, left hash, right hash) of an inner node body."""
    nbits = int.from_bytes(body[1:3], "big")
    nb = (nbits + 7) >> 3
    return nbits, body[3 : 3 + nb], body[3 + nb : 35 + nb], body[35 + nb : 67 + nb]


def parse_leaf(body: bytes) -> tuple[bytes, bytes, bytes]:
    """(key, value hash, value) of a leaf body."""
    klen = int.from_bytes(body[1:5], "big")
    return body[5 : 5 + klen], body[5 + klen : 37 + klen], body[37 + klen :]


# -- building ------------------------------------------------------------------------------------

Ref = Any
"""Where a node is stored: whatever the node store uses (the store: a row id; `MemoryNodes`: the
node's hash). The trie code only passes references around."""
NodeRecord = tuple[bytes, Ref, Ref]
"""A loaded node: (body, left child's ref, right child's ref); the refs are None for a leaf."""
NewNode = tuple[Ref, bytes, bytes, Ref, Ref]
"""A node made by an update: (ref, hash, body, left ref, right ref), children before parents."""
Loader = Callable[[list[Ref]], Mapping[Ref, NodeRecord]]
"""Returns the records of the nodes with the given refs (all of them, or raises)."""


def _hash_ref(h: bytes) -> Ref:
    return h


class TrieBuilder:
    """Builds the canonical trie bottom-up, in one pass, from items given in increasing key order.

    An item is a leaf or a whole existing subtree, given as (rep, nbits, hash, ref): `rep` holds at
    least the first `nbits` bits of the keys below it (for a leaf: its terminated key). Items must
    be disjoint subtrees of the final trie, so consecutive items diverge within both `nbits`; then
    the trie above them is the Cartesian tree of the neighbours' common-prefix lengths, built with
    a stack. With `collect=True` every inner node made is appended to `nodes` as a `NewNode`, its
    ref given by `new_ref(hash)` (default: the hash itself, i.e. content addressing).
    """

    __slots__ = (
        "_stack", "_rep", "_int", "_len", "_bits", "_cur", "_cur_ref", "nodes", "new_ref",
        "root_ref", "root_bits", "count",
    )  # fmt: skip

    def __init__(self, collect: bool = False, new_ref: Callable[[bytes], Ref] | None = None) -> None:
        self._stack: list[tuple[int, bytes, Ref]] = []
        self._rep = b""
        self._int = 0
        self._len = 0
        self._bits = 0
        self._cur: bytes | None = None
        self._cur_ref: Ref = None
        self.nodes: list[NewNode] | None = [] if collect else None
        self.new_ref = new_ref or _hash_ref
        self.root_ref: Ref = None
        self.root_bits = MAX_KEY_BITS
        """After finish(): the length in bits of the root's prefix."""
        self.count = 0

    def _close(self, c: int) -> None:
        """Make the inner nodes on the stack whose prefix is longer than `c` bits."""
        stack = self._stack
        nodes = self.nodes
        prev = self._rep
        cur = self._cur
        cur_ref = self._cur_ref
        while stack and stack[-1][0] > c:
            nb, left, left_ref = stack.pop()
            body = b"\x01" + nb.to_bytes(2, "big") + _pack(prev, nb) + left + cur
            cur = _sha256(body).digest()  # type: ignore[operator]
            if nodes is not None:
                ref = self.new_ref(cur)
                nodes.append((ref, cur, body, left_ref, cur_ref))
                cur_ref = ref
        self._cur = cur
        self._cur_ref = cur_ref

    def add(self, rep: bytes, nbits: int, item_hash: bytes, item_ref: Ref = None) -> None:
        ri = int.from_bytes(rep, "big")
        lr = len(rep)
        if self._cur is not None:
            lp = self._len
            if lp == lr:
                x = self._int ^ ri
                w = 8 * lr
                new_aligned = ri
            elif lp < lr:
                x = (self._int << (8 * (lr - lp))) ^ ri
                w = 8 * lr
                new_aligned = ri
            else:
                new_aligned = ri << (8 * (lp - lr))
                x = self._int ^ new_aligned
                w = 8 * lp
            c = w - x.bit_length()
            if c >= nbits or c >= self._bits:
                raise ValueError("trie items overlap (a key or subtree is repeated or nested)")
            if not (new_aligned >> (w - 1 - c)) & 1:
                raise ValueError("trie items are not in increasing key order")
            stack = self._stack
            if stack and stack[-1][0] > c:
                self._close(c)
            if stack and stack[-1][0] == c:
                raise ValueError("trie items do not form a binary trie")
            stack.append((c, self._cur, self._cur_ref))
            if c < self.root_bits:
                self.root_bits = c
        self._cur = item_hash
        self._cur_ref = item_ref
        self._rep = rep
        self._int = ri
        self._len = lr
        self._bits = nbits
        self.count += 1
        if self.count == 1:
            self.root_bits = nbits

    def add_leaf(self, key: bytes, value: bytes) -> None:
        """Add a new leaf (key checked by the caller); with `collect`, record it in `nodes`."""
        body = b"\x00" + len(key).to_bytes(4, "big") + key + _sha256(value).digest()
        h = _sha256(body).digest()
        ref = None
        if self.nodes is not None:
            ref = self.new_ref(h)
            self.nodes.append((ref, h, body + value, None, None))
        tk = key + b"\x00"
        self.add(tk, 8 * len(tk), h, ref)

    def finish(self) -> bytes:
        """The root hash (EMPTY_ROOT when nothing was added); its ref is then in `root_ref`."""
        if self._cur is None:
            return EMPTY_ROOT
        self._close(-1)
        self.root_ref = self._cur_ref
        return self._cur  # type: ignore[return-value]


def subtree_root(entries: Sequence[tuple[bytes, bytes]]) -> bytes:
    """Root hash of the trie holding exactly `entries` (sorted by key, no duplicates; ValueError
    otherwise); EMPTY_ROOT for no entries. This is what a client runs over every entry of a signed
    list, hence the specialised path below rather than `TrieBuilder`."""
    return _leaves_root(*_leaves(entries))


def _leaves(entries: Iterable[tuple[bytes, bytes]]) -> tuple[list[bytes], list[bytes]]:
    """The terminated keys and leaf hashes of `entries`, checking each (the checks of `check_key`
    are inlined) and their strictly increasing order; ValueError or TypeError naming the first
    offence."""
    tks: list[bytes] = []
    hashes: list[bytes] = []
    sha = _sha256
    prev = b""
    for key, value in entries:
        if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_LEN or not key.isascii() or b"\x00" in key:
            check_key(key)  # raises with the precise reason
        if type(value) is not bytes:
            raise TypeError(f"value must be bytes, not {type(value).__name__}")
        if key <= prev:
            raise ValueError(f"entries not in strictly increasing key order at {key[:80]!r}")
        prev = key
        tks.append(key + b"\x00")
        hashes.append(sha(b"\x00" + len(key).to_bytes(4, "big") + key + sha(value).digest()).digest())
    return tks, hashes


def _leaves_root(tks: list[bytes], hashes: list[bytes]) -> bytes:
    """Root hash over leaves in strictly increasing order of terminated key: the Cartesian tree of
    the neighbours' common-prefix lengths, as `TrieBuilder` makes it, without its per-item checks
    (distinct sorted keys cannot violate them). Keys are compared as integers left-aligned to the
    longest one; since no terminated key is a prefix of another, padding never hides a difference."""
    if not tks:
        return EMPTY_ROOT
    width = max(map(len, tks))
    ints = [int.from_bytes(tk, "big") << (8 * (width - len(tk))) for tk in tks]
    top = 8 * width
    sha = _sha256
    lengths: list[int] = []
    lefts: list[bytes] = []
    cur = hashes[0]
    splits = [top - (a ^ b).bit_length() for a, b in zip(ints, ints[1:], strict=False)]
    splits.append(-1)  # after the last key every open node closes
    for i, c in enumerate(splits):
        while lengths and lengths[-1] > c:
            nb = lengths.pop()
            cur = sha(b"\x01" + nb.to_bytes(2, "big") + _pack(tks[i], nb) + lefts.pop() + cur).digest()
        if c < 0:
            break
        lengths.append(c)
        lefts.append(cur)
        cur = hashes[i + 1]
    return cur


class MemoryNodes:
    """A content-addressed node store in a dict (refs are hashes): for tests and tools."""

    def __init__(self) -> None:
        self.bodies: dict[bytes, bytes] = {}

    def record(self, h: bytes) -> NodeRecord:
        body = self.bodies[h]
        if body[0] == _INNER:
            _, _, left, right = parse_inner(body)
            return body, left, right
        return body, None, None

    def load(self, refs: list[Ref]) -> dict[Ref, NodeRecord]:
        return {h: self.record(h) for h in refs}

    def add(self, nodes: Iterable[NewNode]) -> None:
        for _, h, body, _, _ in nodes:
            self.bodies[h] = body


# -- updating ------------------------------------------------------------------------------------


def apply_changes(
    root: bytes,
    root_ref: Ref,
    changes: Sequence[tuple[bytes, bytes | None]],
    load: Loader,
    new_ref: Callable[[bytes], Ref] | None = None,
) -> tuple[bytes, Ref, list[NewNode]]:
    """Apply sorted, distinct (key, value) changes (value None deletes) to the trie `root`, whose
    root node is stored at `root_ref`.

    Returns the new root hash, its ref and every node made (children before parents; refs from
    `new_ref`, by default the hash). Only the nodes on the paths of the changed keys are loaded,
    one `load` call per trie level (a loader may return leaf bodies without their value).

    Each touched node is rebuilt from its children's results. When changes fall outside a node's
    prefix (inserts that split it), the node's new subtree and the new leaves are merged by a
    `TrieBuilder`; untouched children go into it as opaque items whose rep is their parent's
    prefix plus the side bit, which is enough bits to tell them from every neighbour.
    """
    n = len(changes)
    if not n:
        return root, root_ref, []
    new_ref = new_ref or _hash_ref
    # Keys become integers left-aligned to W bits, W the longest terminated key among the changes,
    # so that "starts with prefix q" is a range of integers (bisect). A node prefix or leaf key
    # longer than W bits cannot equal or contain a change key (it would hold a whole NUL byte),
    # so comparing its first W bits decides which side of it each change lies.
    W = 8 * (max(len(k) for k, _ in changes) + 1)
    tks: list[bytes] = []
    ints: list[int] = []
    prev = b""
    for key, value in changes:
        check_key(key)
        if value is not None and not isinstance(value, bytes):
            raise TypeError(f"value must be bytes or None, not {type(value).__name__}")
        if key <= prev:
            raise ValueError("changes not in strictly increasing key order")
        prev = key
        tk = key + b"\x00"
        tks.append(tk)
        ints.append(int.from_bytes(tk, "big") << (W - 8 * len(tk)))

    # Phase 1: load, level by level, every node whose region holds a change, and split each
    # inner node's region [lo, hi) of changes into before / left / right / after its prefix.
    records: dict[Ref, NodeRecord] = {}
    splits: dict[Ref, tuple[int, bytes, bytes, bytes, int, int, int, int]] = {}
    if root != EMPTY_ROOT:
        frontier = [(root_ref, 0, n)]
        while frontier:
            need = [r for r, _, _ in frontier if r not in records]
            if need:
                got = load(need)
                records.update(got)
                if len(got) != len(need) and any(r not in got for r in need):
                    missing = next(r for r in need if r not in got)
                    raise LookupError(f"trie node {missing!r} is missing")
            nxt = []
            for r, lo, hi in frontier:
                body, left_ref, right_ref = records[r]
                if body[0] == _INNER:
                    L = int.from_bytes(body[1:3], "big")
                    nb = (L + 7) >> 3
                    packed = body[3 : 3 + nb]
                    qi = int.from_bytes(packed, "big") >> (8 * nb - L)
                    shift = W - L
                    if hi - lo == 1:  # one change: compare its bits directly
                        x = ints[lo]
                        top = x >> shift if shift > 0 else -1
                        if top == qi:
                            a, b = lo, hi
                            mid = lo if (x >> (shift - 1)) & 1 else hi
                        elif (top if shift > 0 else x) < (qi if shift > 0 else qi >> -shift):
                            a = b = mid = hi
                        else:
                            a = b = mid = lo
                    elif shift > 0:
                        a = bisect_left(ints, qi << shift, lo, hi)
                        b = bisect_left(ints, (qi + 1) << shift, a, hi)
                        mid = bisect_left(ints, ((qi << 1) | 1) << (shift - 1), a, b)
                    else:
                        a = b = mid = bisect_left(ints, qi >> -shift, lo, hi)
                    splits[r] = (L, packed, body[3 + nb : 35 + nb], body[35 + nb : 67 + nb], qi, a, mid, b)
                    if a < mid:
                        nxt.append((left_ref, a, mid))
                    if mid < b:
                        nxt.append((right_ref, mid, b))
            frontier = nxt

    # Phase 2: rebuild bottom-up. A region's result is one subtree item (rep, nbits, hash, ref),
    # or None when it ends up empty.
    nodes: list[NewNode] = []
    Item = tuple[bytes, int, bytes, Ref]

    def leaf(i: int) -> Item | None:
        key, value = changes[i]
        if value is None:
            return None
        body = b"\x00" + len(key).to_bytes(4, "big") + key + _sha256(value).digest()
        h = _sha256(body).digest()
        ref = new_ref(h)
        nodes.append((ref, h, body + value, None, None))
        tk = tks[i]
        return tk, 8 * len(tk), h, ref

    def merge(items: list[Item | None]) -> Item | None:
        present = [it for it in items if it is not None]
        if len(present) <= 1:
            return present[0] if present else None
        builder = TrieBuilder(collect=True, new_ref=new_ref)
        for it in present:
            builder.add(*it)
        h = builder.finish()
        nodes.extend(builder.nodes or [])
        return present[0][0], builder.root_bits, h, builder.root_ref

    def with_outside(lo: int, a: int, inside: Item | None, b: int, hi: int) -> Item | None:
        if lo == a and b == hi:
            return inside
        return merge([*(leaf(i) for i in range(lo, a)), inside, *(leaf(i) for i in range(b, hi))])

    def single(h: bytes, ref: Ref, i: int) -> Item | None:
        """A region holding the one change i: walk down its path, then rehash back up."""
        path = []
        while True:
            sp = splits.get(ref)
            if sp is None:  # a leaf
                body = records[ref][0]
                tk = body[5 : 5 + int.from_bytes(body[1:5], "big")] + b"\x00"
                if tk == tks[i]:
                    bottom = leaf(i)
                else:
                    old: Item = (tk, 8 * len(tk), h, ref)
                    bottom = merge([leaf(i), old] if tks[i] < tk else [old, leaf(i)])
                break
            L, packed, lh, rh, qi, a, mid, b = sp
            if a == b:  # the change lies outside this node's prefix
                node_item: Item = (packed, L, h, ref)
                bottom = merge([leaf(i), node_item] if a == i + 1 else [node_item, leaf(i)])
                break
            _, left_ref, right_ref = records[ref]
            if mid == a:
                path.append((L, packed, qi, lh, left_ref, 1))
                h, ref = rh, right_ref
            else:
                path.append((L, packed, qi, rh, right_ref, 0))
                h, ref = lh, left_ref
        cur = bottom
        for L, packed, qi, sib, sib_ref, side in reversed(path):
            if cur is None:  # the changed side is gone: the sibling takes this node's place
                nb = (L + 8) >> 3
                rep = (((qi << 1) | (1 - side)) << (8 * nb - L - 1)).to_bytes(nb, "big")
                cur = (rep, L + 1, sib, sib_ref)
                continue
            if side:
                body = b"\x01" + L.to_bytes(2, "big") + packed + sib + cur[2]
                lr, rr = sib_ref, cur[3]
            else:
                body = b"\x01" + L.to_bytes(2, "big") + packed + cur[2] + sib
                lr, rr = cur[3], sib_ref
            nh = _sha256(body).digest()
            nref = new_ref(nh)
            nodes.append((nref, nh, body, lr, rr))
            cur = (packed, L, nh, nref)
        return cur

    if root == EMPTY_ROOT:
        result = merge([leaf(i) for i in range(n)])
        if result is None:
            return EMPTY_ROOT, None, nodes
        return result[2], result[3], nodes

    results: list[Item | None] = []
    # work items: (0, hash, ref, lo, hi, rep, nbits) visit; (1, ref, lo, hi) combine children
    work: list[tuple] = [(0, root, root_ref, 0, n, b"", 0)]
    while work:
        op = work.pop()
        if op[0] == 1:
            _, ref, lo, hi = op
            right = results.pop()
            left = results.pop()
            L, packed, _, _, _, a, _, b = splits[ref]
            if left is not None and right is not None:
                body = b"\x01" + L.to_bytes(2, "big") + packed + left[2] + right[2]
                h = _sha256(body).digest()
                nref = new_ref(h)
                nodes.append((nref, h, body, left[3], right[3]))
                inside: Item | None = (packed, L, h, nref)
            else:
                inside = left if left is not None else right
            results.append(with_outside(lo, a, inside, b, hi))
            continue
        _, h, ref, lo, hi, rep, nbits = op
        if lo == hi:
            results.append((rep, nbits, h, ref))
            continue
        if hi - lo == 1:
            results.append(single(h, ref, lo))
            continue
        sp = splits.get(ref)
        if sp is not None:
            L, packed, lh, rh, qi, a, mid, b = sp
            if a == b:  # every change lies outside this node's prefix
                results.append(with_outside(lo, a, (packed, L, h, ref), b, hi))
                continue
            _, left_ref, right_ref = records[ref]
            nb = (L + 8) >> 3
            pad = 8 * nb - L - 1
            work.append((1, ref, lo, hi))
            right_rep = b"" if mid < b else (((qi << 1) | 1) << pad).to_bytes(nb, "big")
            work.append((0, rh, right_ref, mid, b, right_rep, L + 1))
            left_rep = b"" if a < mid else ((qi << 1) << pad).to_bytes(nb, "big")
            work.append((0, lh, left_ref, a, mid, left_rep, L + 1))
            continue
        body = records[ref][0]
        klen = int.from_bytes(body[1:5], "big")
        tk = body[5 : 5 + klen] + b"\x00"
        shift = W - 8 * len(tk)
        ti = int.from_bytes(tk, "big") << shift if shift >= 0 else -1
        j = (
            bisect_left(ints, ti, lo, hi)
            if shift >= 0
            else bisect_left(ints, int.from_bytes(tk, "big") >> -shift, lo, hi)
        )
        if j < hi and ints[j] == ti:  # the leaf itself is replaced or deleted
            results.append(merge([leaf(i) for i in range(lo, hi)]))
        else:
            old: Item = (tk, 8 * len(tk), h, ref)
            results.append(merge([*(leaf(i) for i in range(lo, j)), old, *(leaf(i) for i in range(j, hi))]))
    (result,) = results
    if result is None:
        return EMPTY_ROOT, None, nodes
    return result[2], result[3], nodes


# -- proofs --------------------------------------------------------------------------------------


class ProofKind(IntEnum):
    SUBTREE = 0
    EMPTY = 1
    INNER_OPENING = 2
    LEAF_OPENING = 3


@dataclass(frozen=True)
class InnerOpening:
    """The inner node where the path leaves the prefix: its prefix (nbits, packed) and children."""

    nbits: int
    prefix: bytes
    left: bytes
    right: bytes


@dataclass(frozen=True)
class LeafOpening:
    """The leaf where the path ends, whose key does not start with the prefix."""

    key: bytes
    value_hash: bytes


@dataclass(frozen=True)
class PrefixProof:
    """Proof of the answer to a prefix query; see the module docstring."""

    kind: ProofKind
    steps: tuple[tuple[int, bytes], ...] = ()
    """Root first: (prefix length in bits of the ancestor, hash of the sibling)."""
    opening: InnerOpening | LeafOpening | None = None

    def encode(self) -> bytes:
        _check_shape(self)
        steps = b"".join(nbits.to_bytes(2, "big") + sib for nbits, sib in self.steps)
        op = self.opening
        if isinstance(op, InnerOpening):
            opening: list | None = [op.nbits, op.prefix, op.left, op.right]
        elif isinstance(op, LeafOpening):
            opening = [op.key, op.value_hash]
        else:
            opening = None
        return msgpack.packb([PROOF_VERSION, int(self.kind), steps, opening], use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> PrefixProof:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ProofError(f"proof must be bytes, not {type(data).__name__}")
        data = bytes(data)
        if len(data) > MAX_PROOF_BYTES:
            raise ProofError(f"proof is {len(data)} bytes, more than {MAX_PROOF_BYTES}")
        try:
            obj = msgpack.unpackb(
                data,
                raw=False,
                use_list=True,
                strict_map_key=True,
                max_bin_len=MAX_PROOF_BYTES,
                max_str_len=0,
                max_array_len=4,
                max_map_len=0,
                max_ext_len=0,
            )
        except Exception as exc:  # msgpack raises many types on hostile input
            raise ProofError(f"proof is not valid msgpack: {type(exc).__name__}") from None
        if not isinstance(obj, list) or len(obj) != 4:
            raise ProofError("proof must be a 4-element array")
        version, kind, steps_blob, opening = obj
        if type(version) is not int or version != PROOF_VERSION:
            raise ProofError(f"unknown proof version {version!r}")
        if type(kind) is not int or kind not in ProofKind._value2member_map_:
            raise ProofError(f"unknown proof kind {kind!r}")
        if not isinstance(steps_blob, bytes) or len(steps_blob) % STEP_LEN:
            raise ProofError("proof path is not a whole number of steps")
        steps = tuple(
            (int.from_bytes(steps_blob[i : i + 2], "big"), steps_blob[i + 2 : i + STEP_LEN])
            for i in range(0, len(steps_blob), STEP_LEN)
        )
        k = ProofKind(kind)
        op: InnerOpening | LeafOpening | None
        if k in (ProofKind.SUBTREE, ProofKind.EMPTY):
            if opening is not None:
                raise ProofError(f"{k.name} proof must not carry an opening")
            op = None
        elif k is ProofKind.INNER_OPENING:
            if not isinstance(opening, list) or len(opening) != 4:
                raise ProofError("inner opening must be [nbits, prefix, left, right]")
            nbits, prefix, left, right = opening
            if type(nbits) is not int:
                raise ProofError("inner opening prefix length must be an integer")
            op = InnerOpening(nbits, prefix, left, right)
        else:
            if not isinstance(opening, list) or len(opening) != 2:
                raise ProofError("leaf opening must be [key, value_hash]")
            op = LeafOpening(opening[0], opening[1])
        proof = cls(k, steps, op)
        _check_shape(proof)
        if proof.encode() != data:
            raise ProofError("proof encoding is not canonical")
        return proof


def _is_hash(h: object) -> bool:
    return isinstance(h, bytes) and len(h) == HASH_LEN


def _check_shape(proof: PrefixProof) -> None:
    """Structural checks that do not need the root or the prefix."""
    if not isinstance(proof, PrefixProof):
        raise ProofError(f"not a PrefixProof: {type(proof).__name__}")
    if not isinstance(proof.kind, ProofKind):
        raise ProofError(f"unknown proof kind {proof.kind!r}")
    if not isinstance(proof.steps, tuple) or len(proof.steps) > MAX_STEPS:
        raise ProofError("proof path is malformed or too long")
    last = -1
    for step in proof.steps:
        if not isinstance(step, tuple) or len(step) != 2:
            raise ProofError("proof step must be (nbits, sibling hash)")
        nbits, sib = step
        if type(nbits) is not int or not last < nbits < MAX_KEY_BITS:
            raise ProofError("path prefix lengths are not strictly increasing")
        if not _is_hash(sib):
            raise ProofError("path sibling is not a 32-byte hash")
        last = nbits
    op = proof.opening
    if proof.kind is ProofKind.INNER_OPENING:
        if not isinstance(op, InnerOpening):
            raise ProofError("inner-opening proof without an inner opening")
        if type(op.nbits) is not int or not last < op.nbits < MAX_KEY_BITS:
            raise ProofError("inner opening prefix length is out of range")
        if not isinstance(op.prefix, bytes) or len(op.prefix) != (op.nbits + 7) >> 3:
            raise ProofError("inner opening prefix does not match its length")
        if _pack(op.prefix, op.nbits) != op.prefix:
            raise ProofError("inner opening prefix has non-zero padding bits")
        if not (_is_hash(op.left) and _is_hash(op.right)):
            raise ProofError("inner opening child is not a 32-byte hash")
    elif proof.kind is ProofKind.LEAF_OPENING:
        if not isinstance(op, LeafOpening):
            raise ProofError("leaf-opening proof without a leaf opening")
        try:
            check_key(op.key)
        except (TypeError, ValueError) as exc:
            raise ProofError(f"leaf opening key is invalid: {exc}") from None
        if not _is_hash(op.value_hash):
            raise ProofError("leaf opening value hash is not a 32-byte hash")
    elif op is not None:
        raise ProofError(f"{proof.kind.name} proof must not carry an opening")
    if proof.kind is ProofKind.EMPTY and proof.steps:
        raise ProofError("empty-trie proof must not carry a path")


def verify_prefix(root: bytes, prefix: bytes, entries: list[tuple[bytes, bytes]], proof: PrefixProof) -> None:
    """Check that `entries` is exactly the set of entries whose key starts with `prefix` in the
    trie with root `root`. Raises ProofError (with the reason) when it is not proven; ValueError
    when `prefix` itself is not a valid prefix."""
    check_prefix(prefix)
    if not _is_hash(root):
        raise ProofError("app hash is not a 32-byte hash")
    _check_shape(proof)
    if not isinstance(entries, list | tuple):
        raise ProofError("entries must be a list")
    lp = 8 * len(prefix)
    steps = proof.steps
    if steps and steps[-1][0] >= lp:
        raise ProofError("path reaches below the prefix: an ancestor's prefix is not shorter than it")
    last = steps[-1][0] if steps else -1
    kind = proof.kind
    if kind is ProofKind.SUBTREE:
        if not entries:
            raise ProofError("subtree proof with no entries")
        try:
            tks, hashes = _leaves(entries)
        except (TypeError, ValueError) as exc:
            raise ProofError(f"malformed entry: {exc}") from None
        outside = [tk for tk in (tks[0], tks[-1]) if not tk.startswith(prefix)]  # sorted: all between
        if outside:
            raise ProofError(f"entry key outside prefix: {outside[0][:-1][:80]!r}")
        h = _leaves_root(tks, hashes)
    else:
        if entries:
            raise ProofError(f"{kind.name} proof (an absence proof) with entries")
        if kind is ProofKind.EMPTY:
            h = EMPTY_ROOT
        elif kind is ProofKind.INNER_OPENING:
            op = proof.opening
            assert isinstance(op, InnerOpening)
            lim = min(op.nbits, lp)
            agree = min(_common_bits(op.prefix, prefix), lim)
            if agree >= lim:
                raise ProofError("absence proof does not diverge from prefix")
            if agree <= last:
                raise ProofError("absence proof opening is inconsistent with the path")
            h = _sha256(inner_body(op.nbits, op.prefix, op.left, op.right)).digest()
        else:
            op = proof.opening
            assert isinstance(op, LeafOpening)
            tk = op.key + b"\x00"
            if tk.startswith(prefix):
                raise ProofError("absence proof does not diverge from prefix")
            if _common_bits(tk, prefix) <= last:
                raise ProofError("absence proof opening is inconsistent with the path")
            h = _sha256(b"\x00" + len(op.key).to_bytes(4, "big") + op.key + op.value_hash).digest()
    for nbits, sib in reversed(steps):
        if _bit(prefix, nbits):
            body = b"\x01" + nbits.to_bytes(2, "big") + _pack(prefix, nbits) + sib + h
        else:
            body = b"\x01" + nbits.to_bytes(2, "big") + _pack(prefix, nbits) + h + sib
        h = _sha256(body).digest()
    if h != root:
        raise ProofError("recomputed root does not match app hash")


def verify_key(root: bytes, key: bytes, value: bytes | None, proof: PrefixProof) -> None:
    """Check that `key` holds `value` (None: that `key` is absent) under `root`."""
    check_key(key)
    verify_prefix(root, key + b"\x00", [(key, value)] if value is not None else [], proof)


# -- proving (server side) -----------------------------------------------------------------------


def make_prefix_proof(
    root: bytes, root_ref: Ref, prefix: bytes, get_node: Callable[[Ref], NodeRecord]
) -> tuple[PrefixProof, tuple[bytes, Ref] | None]:
    """The proof for `prefix` in the trie `root` (stored at `root_ref`), and the (hash, ref) of
    the answer's subtree (None when the answer is empty)."""
    check_prefix(prefix)
    if root == EMPTY_ROOT:
        return PrefixProof(ProofKind.EMPTY), None
    lp = 8 * len(prefix)
    steps: list[tuple[int, bytes]] = []
    h = root
    ref = root_ref
    while True:
        body, left_ref, right_ref = get_node(ref)
        if body[0] == _INNER:
            nbits, packed, left, right = parse_inner(body)
            lim = min(nbits, lp)
            if min(_common_bits(packed, prefix), lim) < lim:
                opening = InnerOpening(nbits, packed, left, right)
                return PrefixProof(ProofKind.INNER_OPENING, tuple(steps), opening), None
            if nbits >= lp:
                return PrefixProof(ProofKind.SUBTREE, tuple(steps)), (h, ref)
            if _bit(prefix, nbits):
                steps.append((nbits, left))
                h, ref = right, right_ref
            else:
                steps.append((nbits, right))
                h, ref = left, left_ref
        else:
            key, value_hash, _ = parse_leaf(body)
            if (key + b"\x00").startswith(prefix):
                return PrefixProof(ProofKind.SUBTREE, tuple(steps)), (h, ref)
            opening2 = LeafOpening(key, value_hash)
            return PrefixProof(ProofKind.LEAF_OPENING, tuple(steps), opening2), None


def collect_leaves(
    subtree_ref: Ref, load: Loader, max_entries: int | None = None
) -> list[tuple[bytes, bytes]]:
    """Every (key, value) under the node at `subtree_ref`, in key order, loading one level at a
    time. Raises OverflowError as soon as there are more than `max_entries`."""
    records: dict[Ref, NodeRecord] = {}
    frontier = [subtree_ref]
    leaves = 0
    while frontier:
        got = load(frontier)
        nxt = []
        for r in frontier:
            try:
                rec = got[r]
            except KeyError:
                raise LookupError(f"trie node {r!r} is missing") from None
            records[r] = rec
            if rec[0][0] == _INNER:
                nxt.append(rec[1])
                nxt.append(rec[2])
            else:
                leaves += 1
                if max_entries is not None and leaves > max_entries:
                    raise OverflowError(f"more than {max_entries} entries")
        frontier = nxt
    out: list[tuple[bytes, bytes]] = []
    stack = [subtree_ref]
    while stack:
        body, left_ref, right_ref = records[stack.pop()]
        if body[0] == _INNER:
            stack.append(right_ref)
            stack.append(left_ref)
        else:
            key, _, value = parse_leaf(body)
            out.append((key, value))
    return out
