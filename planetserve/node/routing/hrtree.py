"""The Hash-Radix tree (seed planetserve.md 3.3): the group's KV-cache state as a tree of short chunk hashes.

A prompt is cut into chunks by the group's `ChunkPlan`; each chunk becomes a `hash_bits`-bit value of a
keyed hash (blake2b keyed with the group key, truncated), and the sequence of those values is the
prompt's *path*. A tree node is one path prefix and records which model nodes hold the KV cache of that
prefix. Holding is prefix-closed: a node that holds a path holds each of its prefixes, and evicting a
path evicts everything below it (an engine cannot keep a block without the blocks before it).

Short hashes keep the tree and the sync traffic small and reveal little: a false match needs d chunk
collisions in a row (1/2^(bits·d) against one stored path); without the group key nobody can test a
guessed prompt against a path.

Per tree node, holders are two bitmasks over node-table slots: `conf` (the holder said so) and `spec`
(we forwarded a request there and assume it now holds the prefix, until an expiry). A reverse index
slot -> tree nodes makes dropping or replacing one holder's entries cost only that holder's entries.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from planetserve.node.routing.balance import LoadReport
from planetserve.node.routing.sentry import ChunkPlan

Path = tuple[int, ...]

MAX_KEY_BYTES = 64  # blake2b's key size
HASH_PERSON = b"ps-hrtree-v1"


class ChunkHasher:
    """Chunk hashes under one plan, one group key and one hash width."""

    def __init__(self, plan: ChunkPlan, key: bytes, hash_bits: int = 8) -> None:
        if isinstance(hash_bits, bool) or not isinstance(hash_bits, int) or not 1 <= hash_bits <= 32:
            raise ValueError(f"hash_bits must be in [1, 32], got {hash_bits!r}")
        if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"the group key must be 1 to {MAX_KEY_BYTES} bytes")
        self.plan = plan
        self.hash_bits = hash_bits
        self.width = path_width(hash_bits)
        self._shift = 32 - hash_bits
        self._base = hashlib.blake2b(digest_size=4, key=key, person=HASH_PERSON)

    def hash_chunk(self, token_ids: Sequence[int]) -> int:
        h = self._base.copy()
        h.update(_pack(token_ids))
        return int.from_bytes(h.digest(), "big") >> self._shift

    def iter_path(self, token_ids: Sequence[int]) -> Iterator[int]:
        """The path lazily: a search that stops at the first unmatched chunk hashes no further."""
        for start, end in self.plan.spans(len(token_ids)):
            yield self.hash_chunk(token_ids[start:end])

    def path(self, token_ids: Sequence[int]) -> Path:
        return tuple(self.iter_path(token_ids))


def path_width(hash_bits: int) -> int:
    """Bytes per hash on the wire."""
    return 1 if hash_bits <= 8 else 2 if hash_bits <= 16 else 4


_PATH_FORMAT = {1: "B", 2: "H", 4: "I"}


def encode_path(path: Path, width: int) -> bytes:
    return bytes(path) if width == 1 else struct.pack(f">{len(path)}{_PATH_FORMAT[width]}", *path)


def decode_path(data: bytes, width: int, hash_bits: int) -> Path:
    """ValueError unless `data` is a whole number of hashes that each fit in `hash_bits`."""
    if len(data) % width:
        raise ValueError(f"path of {len(data)} bytes is not a whole number of {width}-byte hashes")
    path = tuple(data) if width == 1 else struct.unpack(f">{len(data) // width}{_PATH_FORMAT[width]}", data)
    if path and max(path) >> hash_bits:
        raise ValueError(f"path holds a hash wider than {hash_bits} bits")
    return path


def _pack(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2^32): {exc}") from None


@dataclass
class NodeEntry:
    """A model node of the group: kept apart from the tree, which only points at it by slot."""

    node_id: str
    address: str = ""
    trusted: bool = False
    reputation: int = 0
    """Parts per million, as the ledger keeps it."""
    load: LoadReport | None = None
    slot: int = field(default=-1, repr=False)


class NodeTable:
    """node id -> entry, each with a small slot number that the tree's holder bitmasks index."""

    def __init__(self, max_nodes: int = 1024) -> None:
        self.max_nodes = max_nodes
        self._entries: dict[str, NodeEntry] = {}
        self._by_slot: dict[int, NodeEntry] = {}
        self._free: list[int] = []

    def upsert(self, node_id: str, *, address: str | None = None, trusted: bool | None = None,
               reputation: int | None = None, load: LoadReport | None = None) -> NodeEntry:
        entry = self._entries.get(node_id)
        if entry is None:
            if len(self._entries) >= self.max_nodes:
                raise ValueError(f"node table is full ({self.max_nodes} nodes)")
            slot = self._free.pop() if self._free else len(self._entries)
            entry = self._entries[node_id] = self._by_slot[slot] = NodeEntry(node_id, slot=slot)
        if address is not None:
            entry.address = address
        if trusted is not None:
            entry.trusted = trusted
        if reputation is not None:
            entry.reputation = reputation
        if load is not None:
            entry.load = load
        return entry

    def get(self, node_id: str) -> NodeEntry | None:
        return self._entries.get(node_id)

    def ids(self, mask: int) -> frozenset[str]:
        out = []
        while mask:
            low = mask & -mask
            out.append(self._by_slot[low.bit_length() - 1].node_id)
            mask ^= low
        return frozenset(out)

    def _remove(self, node_id: str) -> None:
        entry = self._entries.pop(node_id)
        del self._by_slot[entry.slot]
        self._free.append(entry.slot)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._entries

    def __iter__(self) -> Iterator[NodeEntry]:
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)


class _Node:
    __slots__ = ("key", "parent", "children", "conf", "spec")

    def __init__(self, key: int, parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] | None = None
        self.conf = 0
        self.spec = 0


@dataclass(frozen=True)
class SearchResult:
    depth: int
    """Chunks matched from the start of the prompt."""
    holders: frozenset[str]
    """Nodes holding the deepest matched prefix (speculative holders included)."""
    matched: bool
    """depth reached the tree's match threshold."""


class HRTree:
    """The tree, its node table, and the reverse index. Not thread-safe: one owner drives it."""

    def __init__(self, hasher: ChunkHasher, *, min_depth: int = 1, table: NodeTable | None = None,
                 max_speculative: int = 4096) -> None:
        if min_depth < 1:
            raise ValueError(f"min_depth must be at least 1, got {min_depth}")
        self.hasher = hasher
        self.min_depth = min_depth
        self.table = table or NodeTable()
        self.max_speculative = max_speculative
        self._root = _Node(-1, None)
        self._size = 0
        self._by_holder: dict[int, set[_Node]] = {}
        self._spec: dict[int, dict[_Node, float]] = {}
        self._expiry: list[tuple[float, int, int, _Node]] = []
        self._ticket = itertools.count()

    def __len__(self) -> int:
        """Tree nodes (distinct cached prefixes of the group)."""
        return self._size

    def rehash(self, hasher: ChunkHasher) -> None:
        """Switch to a new plan or key: every path changes, so every entry goes (the table stays)."""
        self.hasher = hasher
        self._root = _Node(-1, None)
        self._size = 0
        self._by_holder.clear()
        self._spec.clear()
        self._expiry.clear()

    # -- token-level operations --

    def insert(self, node_id: str, token_ids: Sequence[int]) -> int:
        return self.insert_path(node_id, self.hasher.path(token_ids))

    def evict(self, node_id: str, token_ids: Sequence[int]) -> int:
        """The node lost `token_ids`: its last complete chunk and everything below it go. When the prompt
        ends inside a chunk this also drops the shorter prefix, which is safe (a missed hit, never a false
        one); cachesync.LocalCache tracks tokens to evict exactly."""
        return self.evict_path(node_id, self.hasher.path(token_ids))

    def search(self, token_ids: Sequence[int]) -> SearchResult:
        return self._search(self.hasher.iter_path(token_ids))

    # -- path-level operations (what sync messages carry) --

    def insert_path(self, node_id: str, path: Path, *, speculative_until: float | None = None) -> int:
        """Record that `node_id` holds `path` (and so each prefix); the number of new entries.

        A speculative insert (an expiry time given) marks only prefixes the node has not confirmed, and
        stops at `max_speculative` such marks per node; a confirmed insert clears speculative marks."""
        slot = self._slot(node_id)
        bit = 1 << slot
        confirmed = self._by_holder.setdefault(slot, set())
        spec = self._spec.get(slot)
        node = self._root
        added = 0
        for key in path:
            node = self._child(node, key)
            if speculative_until is None:
                if not node.conf & bit:
                    node.conf |= bit
                    confirmed.add(node)
                    added += 1
                if node.spec & bit:
                    node.spec &= ~bit
                    if spec is not None:
                        spec.pop(node, None)
            elif not node.conf & bit:
                spec = self._spec.setdefault(slot, {})
                if node not in spec:
                    if len(spec) >= self.max_speculative:
                        self._prune(node)
                        break
                    node.spec |= bit
                    added += 1
                spec[node] = speculative_until
                heapq.heappush(self._expiry, (speculative_until, next(self._ticket), slot, node))
        return added

    def evict_path(self, node_id: str, path: Path) -> int:
        """`node_id` no longer holds `path` nor anything below it (the empty path: nothing at all); the
        number of confirmed entries dropped. Speculative marks stay until they expire: the eviction may
        predate the request we forwarded."""
        entry = self.table.get(node_id)
        if entry is None or not self._by_holder.get(entry.slot):
            return 0
        bit = 1 << entry.slot
        node: _Node | None = self._root
        for key in path:
            node = node.children.get(key) if node.children else None
            if node is None or not node.conf & bit:
                return 0
        confirmed = self._by_holder[entry.slot]
        if not path:
            dropped = list(confirmed)
        else:
            dropped, stack = [], [node]
            while stack:
                n = stack.pop()
                dropped.append(n)
                if n.children:
                    stack.extend(c for c in n.children.values() if c.conf & bit)
        for n in dropped:
            n.conf &= ~bit
            confirmed.discard(n)
        for n in dropped:
            self._prune(n)
        return len(dropped)

    def replace(self, node_id: str, paths: Iterable[Path]) -> tuple[int, int]:
        """Make `paths` all that `node_id` holds (confirmed), touching only its old and new entries;
        (entries added, entries dropped)."""
        slot = self._slot(node_id)
        bit = 1 << slot
        old = self._by_holder.pop(slot, set())
        new = self._by_holder[slot] = set()
        spec = self._spec.get(slot)
        added = 0
        for path in paths:
            node = self._root
            for key in path:
                node = self._child(node, key)
                if not node.conf & bit:
                    node.conf |= bit
                    added += 1
                if node.spec & bit:
                    node.spec &= ~bit
                    if spec is not None:
                        spec.pop(node, None)
                new.add(node)
        stale = old - new
        for n in stale:
            n.conf &= ~bit
        for n in stale:
            self._prune(n)
        return added, len(stale)

    def remove_node(self, node_id: str) -> None:
        """Forget a node: its entries, speculative marks and table entry."""
        entry = self.table.get(node_id)
        if entry is None:
            return
        self.clear_node(node_id)
        self._by_holder.pop(entry.slot, None)
        self.table._remove(node_id)

    def clear_node(self, node_id: str) -> None:
        """Drop every entry of a node, speculative ones too (it left, restarted or went silent)."""
        entry = self.table.get(node_id)
        if entry is None:
            return
        self.evict_path(node_id, ())
        bit = 1 << entry.slot
        marks = self._spec.pop(entry.slot, {})
        for n in marks:
            n.spec &= ~bit
        for n in marks:
            self._prune(n)

    def expire(self, now: float) -> int:
        """Drop speculative marks whose time has come unconfirmed; how many."""
        dropped = 0
        while self._expiry and self._expiry[0][0] <= now:
            until, _, slot, node = heapq.heappop(self._expiry)
            marks = self._spec.get(slot)
            if marks is None or marks.get(node) != until:
                continue  # confirmed, cleared or refreshed since
            del marks[node]
            node.spec &= ~(1 << slot)
            self._prune(node)
            dropped += 1
        return dropped

    def search_path(self, path: Iterable[int]) -> SearchResult:
        return self._search(iter(path))

    def entries(self, node_id: str) -> int:
        """Confirmed prefixes a node holds."""
        entry = self.table.get(node_id)
        return len(self._by_holder.get(entry.slot, ())) if entry else 0

    def held_depth(self, node_id: str, path: Iterable[int]) -> int:
        """How many leading chunks of `path` the node holds (confirmed); an iterator is read only as far
        as that."""
        entry = self.table.get(node_id)
        if entry is None:
            return 0
        bit = 1 << entry.slot
        node: _Node | None = self._root
        depth = 0
        for key in path:
            node = node.children.get(key) if node.children else None
            if node is None or not node.conf & bit:
                break
            depth += 1
        return depth

    def speculative(self, node_id: str) -> int:
        entry = self.table.get(node_id)
        return len(self._spec.get(entry.slot, ())) if entry else 0

    def paths(self, node_id: str) -> set[Path]:
        """The maximal paths a node holds (confirmed): what a snapshot of it would list."""
        entry = self.table.get(node_id)
        if entry is None:
            return set()
        bit = 1 << entry.slot
        return {root_path(n) for n in self._by_holder.get(entry.slot, ())
                if not (n.children and any(c.conf & bit for c in n.children.values()))}

    # -- internals --

    def _search(self, hashes: Iterator[int]) -> SearchResult:
        node = self._root
        depth = 0
        for key in hashes:
            child = node.children.get(key) if node.children else None
            if child is None:
                break
            node = child
            depth += 1
        holders = self.table.ids(node.conf | node.spec) if depth else frozenset()
        return SearchResult(depth, holders, depth >= self.min_depth)

    def _slot(self, node_id: str) -> int:
        entry = self.table.get(node_id)
        if entry is None:
            raise KeyError(f"unknown node {node_id!r}: add it to the node table first")
        return entry.slot

    def _child(self, node: _Node, key: int) -> _Node:
        if node.children is None:
            node.children = {}
        child = node.children.get(key)
        if child is None:
            child = node.children[key] = _Node(key, node)
            self._size += 1
        return child

    def _prune(self, node: _Node) -> None:
        """Unlink a node nobody holds and that has no children, then its parent if that is now bare."""
        while node.parent is not None and not node.conf and not node.spec and not node.children:
            parent = node.parent
            if parent.children is not None and parent.children.get(node.key) is node:
                del parent.children[node.key]
                if not parent.children:
                    parent.children = None
                self._size -= 1
            node.parent = None
            node = parent


class Linked(Protocol):
    @property
    def key(self) -> int: ...

    @property
    def parent(self) -> Linked | None: ...


def root_path(node: Linked) -> Path:
    """The chunk hashes from the root down to `node` (any tree whose nodes know key and parent)."""
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return tuple(reversed(keys))
