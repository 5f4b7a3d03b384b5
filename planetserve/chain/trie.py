"""The authenticated state: a canonical compressed byte-wide (256-ary) Patricia Merkle trie.

Pure code: no I/O. The state store (`planetserve.chain.abci.store`) keeps the nodes in a database and
injects a loader; the client side only needs `verify_prefix` / `verify_key`.

Keys
    A state key is a non-empty byte string of at most `MAX_KEY_LEN` bytes in 0x01..0x7f (ASCII
    without NUL). Inside the trie every key is *terminated* with one 0x00 byte, so that no
    terminated key is a prefix of another. Byte positions are numbered from 0. Values are
    arbitrary byte strings.

Structure (canonical: the node set depends only on the set of (key, value) pairs)
    * a leaf holds one key;
    * an inner node has a *depth* d and a *prefix*: the d bytes that every terminated key below
      it starts with, d being the longest such length. Its children (at least two) hold the keys
      by their byte at position d, one child per distinct byte, in increasing byte order. Since
      key bytes are below 0x80, a node has at most 128 children.
    A byte-wide node stands for the up to 7 levels of binary nodes that would split inside one
    byte, so a path is a few nodes per key byte where keys differ rather than one per bit: a block
    rewrites about three times fewer nodes at a million users (`bench/trie_shape.py`).

Hashes (SHA-256, H; integers big-endian; "||" is concatenation)
    leaf  = H(0x00 || u32 len(key) || key || H(value))          (key without the terminator)
    inner = H(0x01 || u16 d || prefix || u8 (n - 1) || n × (byte || child hash))
            for the n children in increasing order of their byte.
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
    or nothing. A `PrefixProof` is the path from the root down to that node: for each ancestor its
    depth d (its prefix is the first d bytes of P, and the child taken is the one for byte P[d], so
    neither is sent) and its other children as (byte, hash); then a terminal part:
      SUBTREE        the client recomputes the subtree root from the returned entries;
      EMPTY          the trie is empty (no path; the root is EMPTY_ROOT);
      INNER_OPENING  (for an empty answer) the node where the path leaves P: its depth, prefix and
                     children, showing either that its prefix disagrees with P within both lengths
                     or that it has no child for P's next byte;
      LEAF_OPENING   (for an empty answer) the leaf where the path ends: its key and value hash,
                     showing that the key does not start with P.
    Every ancestor must be shallower than P is long (with strictly increasing depths), so the
    terminal node is the highest node under P: no entry can be left out.

Proof encoding (msgpack, canonical: decoding and re-encoding gives back the same bytes)
    [2, kind, steps, opening]
    kind     0 SUBTREE, 1 EMPTY, 2 INNER_OPENING, 3 LEAF_OPENING
    steps    bin: root first, per step u16 d || u8 (k - 1) || k × (byte || sibling hash), the k
             siblings in increasing byte order
    opening  nil for SUBTREE and EMPTY; [d, prefix, children] for INNER_OPENING, children being
             n × (byte || hash) in increasing byte order; [key, value_hash] for LEAF_OPENING.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import msgpack

from planetserve.registry import codec

__all__ = [
    "CHILD_LEN",
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
    "Update",
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
MAX_DEPTH = MAX_KEY_LEN + 1
"""Longest terminated key in bytes; every node depth is below it."""
MAX_CHILDREN = 128
"""Most children of a node: key bytes are 0x00..0x7f."""
CHILD_LEN = 1 + HASH_LEN
MAX_STEPS = MAX_DEPTH
MAX_PROOF_BYTES = 64 + MAX_STEPS * (3 + (MAX_CHILDREN - 1) * CHILD_LEN) + MAX_DEPTH + MAX_CHILDREN * CHILD_LEN
_PROOF_LIMITS = codec.Limits(max_objects=16, max_depth=2, max_len=4, max_str=0, max_bin=MAX_PROOF_BYTES)
"""A proof is [version, kind, steps, opening of at most 3]: eight values, two levels."""
"""Upper bound on an encoded proof; anything longer is rejected before decoding."""
PROOF_VERSION = 2

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


def _common(a: bytes, b: bytes) -> int:
    """Number of leading bytes `a` and `b` agree on."""
    n = min(len(a), len(b))
    x = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
    return n - ((x.bit_length() + 7) >> 3)


# -- hashes and node bodies ----------------------------------------------------------------------


def leaf_hash(key: bytes, value: bytes) -> bytes:
    return _sha256(b"\x00" + len(key).to_bytes(4, "big") + key + _sha256(value).digest()).digest()


def leaf_body(key: bytes, value: bytes) -> bytes:
    return b"\x00" + len(key).to_bytes(4, "big") + key + _sha256(value).digest() + value


def _pack_children(children: Iterable[tuple[int, bytes]]) -> bytes:
    return b"".join(bytes((c,)) + h for c, h in children)


def inner_body(depth: int, prefix: bytes, children: Sequence[tuple[int, bytes]]) -> bytes:
    """An inner node's body (= its hash pre-image); `prefix` holds at least `depth` bytes and
    `children` are (byte, hash) in increasing byte order."""
    head = b"\x01" + depth.to_bytes(2, "big") + prefix[:depth] + bytes((len(children) - 1,))
    return head + _pack_children(children)


def node_hash(body: bytes) -> bytes:
    if body[0] == _INNER:
        return _sha256(body).digest()
    klen = int.from_bytes(body[1:5], "big")
    return _sha256(body[: 37 + klen]).digest()


def _split_children(blob: bytes) -> list[tuple[int, bytes]]:
    return [(blob[i], blob[i + 1 : i + CHILD_LEN]) for i in range(0, len(blob), CHILD_LEN)]


def parse_inner(body: bytes) -> tuple[int, bytes, list[tuple[int, bytes]]]:
    """(depth, prefix, children as (byte, hash)) of an inner node body."""
    d = int.from_bytes(body[1:3], "big")
    return d, body[3 : 3 + d], _split_children(body[4 + d :])


def parse_leaf(body: bytes) -> tuple[bytes, bytes, bytes]:
    """(key, value hash, value) of a leaf body."""
    klen = int.from_bytes(body[1:5], "big")
    return body[5 : 5 + klen], body[5 + klen : 37 + klen], body[37 + klen :]


# -- building ------------------------------------------------------------------------------------

Ref = Any
"""Where a node is stored: whatever the node store uses (the store: a row id; `MemoryNodes`: the
node's hash). The trie code only passes references around."""
NodeRecord = tuple[bytes, tuple[Ref, ...]]
"""A loaded node: (body, its children's refs in byte order); no refs for a leaf."""
NewNode = tuple[Ref, bytes, bytes, tuple[Ref, ...]]
"""A node made by an update: (ref, hash, body, children's refs), children before parents."""
Loader = Callable[[list[Ref]], Mapping[Ref, NodeRecord]]
"""Returns the records of the nodes with the given refs (all of them, or raises)."""
Item = tuple[bytes, int, bytes, Ref]
"""A subtree given to `TrieBuilder`: (rep, depth, hash, ref); see there."""


def _hash_ref(h: bytes) -> Ref:
    return h


class TrieBuilder:
    """Builds the canonical trie bottom-up, in one pass, from items given in increasing key order.

    An item is a leaf or a whole existing subtree, given as (rep, depth, hash, ref): the keys below
    it all start with the first `depth` bytes of `rep` (for a leaf: its terminated key, whole).
    Items must be disjoint subtrees of the final trie, so consecutive items differ within both
    depths; then the trie above them is the tree of the neighbours' common-prefix lengths, built
    with a stack of open nodes (neighbours splitting at the same length are siblings). With
    `collect=True` every inner node made is appended to `nodes` as a `NewNode`, its ref given by
    `new_ref(hash)` (default: the hash itself, i.e. content addressing).
    """

    __slots__ = (
        "_depths", "_kids", "_refs", "_rep", "_depth", "_cur", "_cur_ref", "nodes", "new_ref",
        "root_ref", "root_depth", "count",
    )  # fmt: skip

    def __init__(self, collect: bool = False, new_ref: Callable[[bytes], Ref] | None = None) -> None:
        self._depths: list[int] = []
        self._kids: list[list[bytes]] = []
        self._refs: list[list[Ref]] = []
        self._rep = b""
        self._depth = 0
        self._cur: bytes | None = None
        self._cur_ref: Ref = None
        self.nodes: list[NewNode] | None = [] if collect else None
        self.new_ref = new_ref or _hash_ref
        self.root_ref: Ref = None
        self.root_depth = MAX_DEPTH
        """After finish(): the depth of the root (for a lone item, its own depth)."""
        self.count = 0

    def _close(self, c: int) -> None:
        """Make the open nodes deeper than `c`."""
        depths = self._depths
        nodes = self.nodes
        rep = self._rep
        cur = self._cur
        cur_ref = self._cur_ref
        while depths and depths[-1] > c:
            d = depths.pop()
            kids = self._kids.pop()
            refs = self._refs.pop()
            kids.append(rep[d : d + 1] + cur)  # type: ignore[operator]
            refs.append(cur_ref)
            body = b"\x01" + d.to_bytes(2, "big") + rep[:d] + bytes((len(kids) - 1,)) + b"".join(kids)
            cur = _sha256(body).digest()
            if nodes is not None:
                ref = self.new_ref(cur)
                nodes.append((ref, cur, body, tuple(refs)))
                cur_ref = ref
        self._cur = cur
        self._cur_ref = cur_ref

    def add(self, rep: bytes, depth: int, item_hash: bytes, item_ref: Ref = None) -> None:
        if self._cur is not None:
            prev = self._rep
            c = _common(prev, rep)
            if c >= depth or c >= self._depth:
                raise ValueError("trie items overlap (a key or subtree is repeated or nested)")
            if rep[c] < prev[c]:
                raise ValueError("trie items are not in increasing key order")
            depths = self._depths
            if depths and depths[-1] > c:
                self._close(c)
            edge = prev[c : c + 1] + self._cur  # type: ignore[operator]
            if depths and depths[-1] == c:
                self._kids[-1].append(edge)
                self._refs[-1].append(self._cur_ref)
            else:
                depths.append(c)
                self._kids.append([edge])
                self._refs.append([self._cur_ref])
            if c < self.root_depth:
                self.root_depth = c
        self._cur = item_hash
        self._cur_ref = item_ref
        self._rep = rep
        self._depth = depth
        self.count += 1
        if self.count == 1:
            self.root_depth = depth

    def add_leaf(self, key: bytes, value: bytes) -> None:
        """Add a new leaf (key checked by the caller); with `collect`, record it in `nodes`."""
        body = b"\x00" + len(key).to_bytes(4, "big") + key + _sha256(value).digest()
        h = _sha256(body).digest()
        ref = None
        if self.nodes is not None:
            ref = self.new_ref(h)
            self.nodes.append((ref, h, body + value, ()))
        tk = key + b"\x00"
        self.add(tk, len(tk), h, ref)

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
    """Root hash over leaves in strictly increasing order of terminated key: the tree of the
    neighbours' common-prefix lengths, as `TrieBuilder` makes it, without its per-item checks
    (distinct sorted keys cannot violate them). Keys are compared as integers left-aligned to the
    longest one; since no terminated key is a prefix of another, padding never hides a difference."""
    if not tks:
        return EMPTY_ROOT
    width = max(map(len, tks))
    ints = [int.from_bytes(tk, "big") << (8 * (width - len(tk))) for tk in tks]
    sha = _sha256
    depths: list[int] = []
    kids: list[list[bytes]] = []
    cur = hashes[0]
    splits = [width - (((a ^ b).bit_length() + 7) >> 3) for a, b in zip(ints, ints[1:], strict=False)]
    splits.append(-1)  # after the last key every open node closes
    for i, c in enumerate(splits):
        tk = tks[i]
        while depths and depths[-1] > c:
            d = depths.pop()
            ks = kids.pop()
            ks.append(tk[d : d + 1] + cur)
            cur = sha(b"\x01" + d.to_bytes(2, "big") + tk[:d] + bytes((len(ks) - 1,)) + b"".join(ks)).digest()
        if c < 0:
            break
        if depths and depths[-1] == c:
            kids[-1].append(tk[c : c + 1] + cur)
        else:
            depths.append(c)
            kids.append([tk[c : c + 1] + cur])
        cur = hashes[i + 1]
    return cur


class MemoryNodes:
    """A content-addressed node store in a dict (refs are hashes): for tests and tools."""

    def __init__(self) -> None:
        self.bodies: dict[bytes, bytes] = {}

    def record(self, h: bytes) -> NodeRecord:
        body = self.bodies[h]
        if body[0] == _INNER:
            return body, tuple(ch for _, ch in parse_inner(body)[2])
        return body, ()

    def load(self, refs: list[Ref]) -> dict[Ref, NodeRecord]:
        return {h: self.record(h) for h in refs}

    def add(self, nodes: Iterable[NewNode]) -> None:
        for _, h, body, _ in nodes:
            self.bodies[h] = body


# -- updating ------------------------------------------------------------------------------------


class Update(NamedTuple):
    """What `apply_changes` made of a trie."""

    root: bytes
    root_ref: Ref
    nodes: list[NewNode]
    """Every node made, children before parents."""
    replaced: list[Ref]
    """The old nodes the new trie no longer holds."""
    previous: dict[bytes, bytes | None]
    """The value every changed key had (None: absent)."""


def apply_changes(
    root: bytes,
    root_ref: Ref,
    changes: Sequence[tuple[bytes, bytes | None]],
    load: Loader,
    new_ref: Callable[[bytes], Ref] | None = None,
    current: Mapping[bytes, bytes | None] | None = None,
) -> Update:
    """Apply sorted, distinct (key, value) changes (value None deletes) to the trie `root`, whose
    root node is stored at `root_ref`; new nodes get their refs from `new_ref` (by default the
    hash).

    Only the nodes on the paths of the changed keys are loaded, one `load` call per trie level
    (leaf bodies with their value: the changed keys' previous values come from them, so a caller
    needs no other read to undo the changes). `current` may give the present values of some
    changed keys: a child whose hash is the leaf of a lone change's key with its present value is
    that leaf, and is not loaded (a large state's updates are mostly such leaves).

    A touched node whose children stay the same bytes is rewritten by splicing the changed
    children's hashes into its body, so its cost does not grow with its width. Otherwise it is
    rebuilt from its children: a byte keeps its subtree, takes its changed subtree's result or
    takes the new keys of a byte the node had no child for. Changes outside a node's prefix
    (inserts that split it) are merged with the node's new subtree by a `TrieBuilder`.
    """
    n = len(changes)
    if not n:
        return Update(root, root_ref, [], [], {})
    new_ref = new_ref or _hash_ref
    tks: list[bytes] = []
    prev = b""
    for key, value in changes:
        check_key(key)
        if value is not None and not isinstance(value, bytes):
            raise TypeError(f"value must be bytes or None, not {type(value).__name__}")
        if key <= prev:
            raise ValueError("changes not in strictly increasing key order")
        prev = key
        tks.append(key + b"\x00")
    previous: dict[bytes, bytes | None] = dict.fromkeys((k for k, _ in changes), None)
    nodes: list[NewNode] = []

    def leaf(i: int) -> Item | None:
        key, value = changes[i]
        if value is None:
            return None
        body = b"\x00" + len(key).to_bytes(4, "big") + key + _sha256(value).digest()
        h = _sha256(body).digest()
        ref = new_ref(h)
        nodes.append((ref, h, body + value, ()))
        tk = tks[i]
        return tk, len(tk), h, ref

    def merge(items: Iterable[Item | None]) -> Item | None:
        present = [it for it in items if it is not None]
        if len(present) <= 1:
            return present[0] if present else None
        builder = TrieBuilder(collect=True, new_ref=new_ref)
        for it in present:
            builder.add(*it)
        h = builder.finish()
        nodes.extend(builder.nodes or [])
        return present[0][0], builder.root_depth, h, builder.root_ref

    def rebuilt(
        body: bytes, kids: tuple[Ref, ...], d: int, q: bytes, groups: list[tuple[int, int, int, int]]
    ) -> Item | None:
        """The new subtree of an inner node (depth `d`, prefix `q`) whose children change by
        `groups` (phase 1 below), given the results of its changed children."""
        subs: list[tuple[int, Item | None]] = []
        added: list[tuple[int, Item]] = []
        same_bytes = True
        for k, c, i, j in groups:
            if k >= 0:
                item = results[kids[k]]
                same_bytes = same_bytes and item is not None
                subs.append((k, item))
            else:
                item = merge(leaf(x) for x in range(i, j))
                if item is not None:
                    added.append((c, item))
                    same_bytes = False
        refs = list(kids)
        if same_bytes:  # splice the changed children's hashes into the body
            pieces = []
            pos = 0
            for k, item in subs:
                off = 5 + d + CHILD_LEN * k
                pieces += (body[pos:off], item[2])  # type: ignore[index]
                pos = off + HASH_LEN
                refs[k] = item[3]  # type: ignore[index]
            pieces.append(body[pos:])
            nb = b"".join(pieces)
        else:
            children = _split_children(body[4 + d :])
            slots = {c: (ch, ref, None) for (c, ch), ref in zip(children, kids, strict=True)}
            for k, item in subs:
                c = body[4 + d + CHILD_LEN * k]
                if item is None:
                    del slots[c]
                else:
                    slots[c] = (item[2], item[3], item)
            for c, new in added:
                slots[c] = (new[2], new[3], new)
            if len(slots) < 2:
                if not slots:
                    return None
                ((c, (ch, ref, item)),) = slots.items()  # one child left: it takes the node's place
                return item if item is not None else (q + bytes((c,)), d + 1, ch, ref)
            order = sorted(slots)
            nb = inner_body(d, q, [(c, slots[c][0]) for c in order])
            refs = [slots[c][1] for c in order]
        nh = _sha256(nb).digest()
        nref = new_ref(nh)
        nodes.append((nref, nh, nb, tuple(refs)))
        return q, d, nh, nref

    if root == EMPTY_ROOT:
        result = merge(leaf(i) for i in range(n))
        if result is None:
            return Update(EMPTY_ROOT, None, nodes, [], previous)
        return Update(result[2], result[3], nodes, [], previous)

    # Phase 1: load, level by level, every node whose region [lo, hi) of changes is not empty, and
    # split each inner node's region: [lo, a) and [b, hi) lie outside its prefix; inside, the
    # changes of each byte form a group (child index or -1 for a byte without a child, byte, i, j).
    records: dict[Ref, NodeRecord] = {}
    plans: dict[Ref, tuple[int, bytes, int, int, list[tuple[int, int, int, int]]]] = {}
    visits: list[tuple[Ref, bytes, int, int]] = []
    frontier = [(root_ref, root, 0, n)]
    while frontier:
        need = [r for r, _, _, _ in frontier if r not in records]
        got = load(need)
        for r in need:
            try:
                records[r] = got[r]
            except KeyError:
                raise LookupError(f"trie node {r!r} is missing") from None
        nxt = []
        for region in frontier:
            visits.append(region)
            r, _, lo, hi = region
            body, kids = records[r]
            if body[0] != _INNER:
                continue
            d = int.from_bytes(body[1:3], "big")
            q = body[3 : 3 + d]
            a = bisect_left(tks, q, lo, hi)
            b = bisect_left(tks, q + b"\xff", a, hi)
            groups = []
            if a < b:
                child_bytes = body[4 + d :: CHILD_LEN]
                i = a
                while i < b:
                    c = tks[i][d]
                    j = b if i + 1 == b else bisect_left(tks, q + bytes((c + 1,)), i + 1, b)
                    k = child_bytes.find(c)
                    if k >= 0:
                        off = 5 + d + CHILD_LEN * k
                        child = (kids[k], body[off : off + HASH_LEN], i, j)
                        known = _known_leaf(changes[i][0], current, child[1]) if j == i + 1 else None
                        if known is None:
                            nxt.append(child)
                        else:
                            records[child[0]] = (known, ())
                            visits.append(child)
                    groups.append((k, c, i, j))
                    i = j
            plans[r] = (d, q, a, b, groups)
        frontier = nxt

    # Phase 2: rebuild bottom-up (deepest regions first). A region's result is one subtree item,
    # or None when it ends up empty.
    results: dict[Ref, Item | None] = {}
    replaced: list[Ref] = []
    for r, h, lo, hi in reversed(visits):
        body, kids = records[r]
        if body[0] != _INNER:
            klen = int.from_bytes(body[1:5], "big")
            tk = body[5 : 5 + klen] + b"\x00"
            j = bisect_left(tks, tk, lo, hi)
            if j < hi and tks[j] == tk:  # the leaf itself is replaced or deleted
                previous[changes[j][0]] = body[37 + klen :]
                replaced.append(r)
                results[r] = merge(leaf(i) for i in range(lo, hi))
            else:
                old: Item = (tk, len(tk), h, r)
                results[r] = merge([*(leaf(i) for i in range(lo, j)), old, *(leaf(i) for i in range(j, hi))])
            continue
        d, q, a, b, groups = plans[r]
        inside: Item | None
        if a == b:
            inside = (q, d, h, r)
        else:
            replaced.append(r)
            inside = rebuilt(body, kids, d, q, groups)
        if lo == a and b == hi:
            results[r] = inside
        else:
            results[r] = merge([*(leaf(i) for i in range(lo, a)), inside, *(leaf(i) for i in range(b, hi))])
    result = results[root_ref]
    if result is None:
        return Update(EMPTY_ROOT, None, nodes, replaced, previous)
    return Update(result[2], result[3], nodes, replaced, previous)


def _known_leaf(key: bytes, current: Mapping[bytes, bytes | None] | None, h: bytes) -> bytes | None:
    """The body of the leaf with hash `h`, if it is `key` with its current value."""
    value = current.get(key) if current is not None else None
    if value is None:
        return None
    body = b"\x00" + len(key).to_bytes(4, "big") + key + _sha256(value).digest()
    return body + value if _sha256(body).digest() == h else None


# -- proofs --------------------------------------------------------------------------------------


class ProofKind(IntEnum):
    SUBTREE = 0
    EMPTY = 1
    INNER_OPENING = 2
    LEAF_OPENING = 3


Children = tuple[tuple[int, bytes], ...]
"""(byte, hash) pairs in increasing byte order."""


@dataclass(frozen=True)
class InnerOpening:
    """The inner node where the path leaves the prefix: its depth, prefix and children."""

    depth: int
    prefix: bytes
    children: Children


@dataclass(frozen=True)
class LeafOpening:
    """The leaf where the path ends, whose key does not start with the prefix."""

    key: bytes
    value_hash: bytes


@dataclass(frozen=True)
class PrefixProof:
    """Proof of the answer to a prefix query; see the module docstring."""

    kind: ProofKind
    steps: tuple[tuple[int, Children], ...] = ()
    """Root first: (depth of the ancestor, its children other than the one on the path)."""
    opening: InnerOpening | LeafOpening | None = None

    def encode(self) -> bytes:
        _check_shape(self)
        steps = b"".join(
            d.to_bytes(2, "big") + bytes((len(sibs) - 1,)) + _pack_children(sibs) for d, sibs in self.steps
        )
        op = self.opening
        if isinstance(op, InnerOpening):
            opening: list | None = [op.depth, op.prefix, _pack_children(op.children)]
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
            obj = codec.unpack_bounded(data, _PROOF_LIMITS)
        except codec.CodecError as exc:
            raise ProofError(f"proof is not valid msgpack: {exc}") from None
        if not isinstance(obj, list) or len(obj) != 4:
            raise ProofError("proof must be a 4-element array")
        version, kind, steps_blob, opening = obj
        if type(version) is not int or version != PROOF_VERSION:
            raise ProofError(f"unknown proof version {version!r}")
        if type(kind) is not int or kind not in ProofKind._value2member_map_:
            raise ProofError(f"unknown proof kind {kind!r}")
        if not isinstance(steps_blob, bytes):
            raise ProofError("proof path must be bytes")
        k = ProofKind(kind)
        op: InnerOpening | LeafOpening | None
        if k in (ProofKind.SUBTREE, ProofKind.EMPTY):
            if opening is not None:
                raise ProofError(f"{k.name} proof must not carry an opening")
            op = None
        elif k is ProofKind.INNER_OPENING:
            if not isinstance(opening, list) or len(opening) != 3:
                raise ProofError("inner opening must be [depth, prefix, children]")
            depth, prefix, blob = opening
            if type(depth) is not int:
                raise ProofError("inner opening depth must be an integer")
            if not isinstance(blob, bytes) or len(blob) % CHILD_LEN:
                raise ProofError("inner opening children are not a whole number of (byte, hash)")
            op = InnerOpening(depth, prefix, tuple(_split_children(blob)))
        else:
            if not isinstance(opening, list) or len(opening) != 2:
                raise ProofError("leaf opening must be [key, value_hash]")
            op = LeafOpening(opening[0], opening[1])
        proof = cls(k, _decode_steps(steps_blob), op)
        _check_shape(proof)
        if proof.encode() != data:
            raise ProofError("proof encoding is not canonical")
        return proof


def _decode_steps(blob: bytes) -> tuple[tuple[int, Children], ...]:
    steps = []
    i = 0
    while i < len(blob):
        if i + 3 > len(blob) or len(steps) >= MAX_STEPS:
            raise ProofError("proof path is truncated or too long")
        d = int.from_bytes(blob[i : i + 2], "big")
        end = i + 3 + (blob[i + 2] + 1) * CHILD_LEN
        if end > len(blob):
            raise ProofError("proof path is truncated or too long")
        steps.append((d, tuple(_split_children(blob[i + 3 : end]))))
        i = end
    return tuple(steps)


def _is_hash(h: object) -> bool:
    return isinstance(h, bytes) and len(h) == HASH_LEN


def _check_children(children: object, least: int, what: str) -> None:
    if not isinstance(children, tuple) or not least <= len(children) <= MAX_CHILDREN:
        raise ProofError(f"{what} must be {least} to {MAX_CHILDREN} (byte, hash) pairs")
    last = -1
    for child in children:
        if not isinstance(child, tuple) or len(child) != 2:
            raise ProofError(f"{what} must be (byte, hash) pairs")
        c, h = child
        if type(c) is not int or not last < c < MAX_CHILDREN:
            raise ProofError(f"{what} are not in strictly increasing order of key byte")
        if not _is_hash(h):
            raise ProofError(f"{what} include a hash that is not 32 bytes")
        last = c


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
            raise ProofError("proof step must be (depth, siblings)")
        d, sibs = step
        if type(d) is not int or not last < d < MAX_DEPTH:
            raise ProofError("path depths are not strictly increasing")
        _check_children(sibs, 1, "path siblings")
        last = d
    op = proof.opening
    if proof.kind is ProofKind.INNER_OPENING:
        if not isinstance(op, InnerOpening):
            raise ProofError("inner-opening proof without an inner opening")
        if type(op.depth) is not int or not last < op.depth < MAX_DEPTH:
            raise ProofError("inner opening depth is out of range")
        if not isinstance(op.prefix, bytes) or len(op.prefix) != op.depth:
            raise ProofError("inner opening prefix does not match its depth")
        _check_children(op.children, 2, "inner opening children")
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


def _opening_hash(kind: ProofKind, op: InnerOpening | LeafOpening | None, prefix: bytes, last: int) -> bytes:
    """The hash of an absence proof's terminal node, once it is shown to leave `prefix` below the
    path's last ancestor (at depth `last`)."""
    if kind is ProofKind.EMPTY:
        return EMPTY_ROOT
    lp = len(prefix)
    if isinstance(op, InnerOpening):
        lim = min(op.depth, lp)
        agree = min(_common(op.prefix, prefix), lim)
        if agree >= lim and (op.depth >= lp or prefix[op.depth] in {c for c, _ in op.children}):
            raise ProofError("absence proof does not diverge from prefix")
        if agree <= last:
            raise ProofError("absence proof opening is inconsistent with the path")
        return _sha256(inner_body(op.depth, op.prefix, op.children)).digest()
    assert isinstance(op, LeafOpening)
    tk = op.key + b"\x00"
    if tk.startswith(prefix):
        raise ProofError("absence proof does not diverge from prefix")
    if _common(tk, prefix) <= last:
        raise ProofError("absence proof opening is inconsistent with the path")
    return _sha256(b"\x00" + len(op.key).to_bytes(4, "big") + op.key + op.value_hash).digest()


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
    steps = proof.steps
    if steps and steps[-1][0] >= len(prefix):
        raise ProofError("path reaches below the prefix: an ancestor is not shallower than it is long")
    last = steps[-1][0] if steps else -1
    if proof.kind is ProofKind.SUBTREE:
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
            raise ProofError(f"{proof.kind.name} proof (an absence proof) with entries")
        h = _opening_hash(proof.kind, proof.opening, prefix, last)
    for d, sibs in reversed(steps):
        c = prefix[d]
        k = bisect_left(sibs, (c,))
        if k < len(sibs) and sibs[k][0] == c:
            raise ProofError("path sibling has the byte of the path itself")
        children = (*sibs[:k], (c, h), *sibs[k:])
        h = _sha256(inner_body(d, prefix, children)).digest()
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
    lp = len(prefix)
    steps: list[tuple[int, Children]] = []
    h = root
    ref = root_ref
    while True:
        body, kids = get_node(ref)
        if body[0] == _INNER:
            d, q, children = parse_inner(body)
            here = InnerOpening(d, q, tuple(children))
            lim = min(d, lp)
            if q[:lim] != prefix[:lim]:
                return PrefixProof(ProofKind.INNER_OPENING, tuple(steps), here), None
            if d >= lp:
                return PrefixProof(ProofKind.SUBTREE, tuple(steps)), (h, ref)
            c = prefix[d]
            k = next((k for k, (b, _) in enumerate(children) if b == c), None)
            if k is None:
                return PrefixProof(ProofKind.INNER_OPENING, tuple(steps), here), None
            steps.append((d, tuple(children[:k] + children[k + 1 :])))
            h, ref = children[k][1], kids[k]
        else:
            key, value_hash, _ = parse_leaf(body)
            if (key + b"\x00").startswith(prefix):
                return PrefixProof(ProofKind.SUBTREE, tuple(steps)), (h, ref)
            return PrefixProof(ProofKind.LEAF_OPENING, tuple(steps), LeafOpening(key, value_hash)), None


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
        nxt: list[Ref] = []
        for r in frontier:
            try:
                rec = got[r]
            except KeyError:
                raise LookupError(f"trie node {r!r} is missing") from None
            records[r] = rec
            if rec[0][0] == _INNER:
                nxt.extend(rec[1])
            else:
                leaves += 1
                if max_entries is not None and leaves > max_entries:
                    raise OverflowError(f"more than {max_entries} entries")
        frontier = nxt
    out: list[tuple[bytes, bytes]] = []
    stack = [subtree_ref]
    while stack:
        body, kids = records[stack.pop()]
        if body[0] == _INNER:
            stack.extend(reversed(kids))
        else:
            key, _, value = parse_leaf(body)
            out.append((key, value))
    return out
