"""A prefix KV cache in fixed-size blocks, addressed by chained block hashes.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal whole
prefixes; the hash is a stable sha256 prefix, so every process (the HR-tree of other nodes included)
computes the same value from the same token ids. Every change is reported as vLLM-style block events.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from planetserve.node.engine.base import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    CacheListeners,
)

log = logging.getLogger(__name__)

_ROOT = b"planetserve-kv-root"


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """The 64-bit hash of a block given its parent's hash (None at the root): the first 8 bytes, as a
    big-endian int, of sha256(parent as 8 big-endian bytes, or `_ROOT` ‖ each token id as 4 big-endian
    bytes)."""
    head = _ROOT if parent is None else struct.pack(">Q", parent)
    body = struct.pack(f">{len(token_ids)}I", *token_ids)
    return int.from_bytes(hashlib.sha256(head + body).digest()[:8], "big")


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hash chain of every full block of `token_ids` (a trailing partial block has none)."""
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(eq=False)
class Block:
    hash: int
    parent: int | None
    token_ids: tuple[int, ...]
    kv: torch.Tensor
    """[layers, 2 (K, V), kv_heads, block_size, head_dim]."""
    refs: int = 0
    children: int = 0


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    """Lookups that found at least one block."""
    misses: int = 0
    hit_tokens: int = 0
    """Prompt tokens whose KV the cache supplied."""
    stored: int = 0
    evictions: int = 0


@dataclass
class _EventLog:
    """Pending events, with consecutive stores of one chain (and consecutive removals) merged, so a
    listener gets one event per chain rather than one per block."""

    block_size: int
    events: list[CacheEvent] = field(default_factory=list)

    def stored(self, block: Block) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == block.parent:
            self.events[-1] = BlockStored(
                last.block_hashes + (block.hash,), last.parent_block_hash,
                last.token_ids + block.token_ids, self.block_size,
            )
        else:
            self.events.append(BlockStored((block.hash,), block.parent, block.token_ids, self.block_size))

    def removed(self, h: int) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            self.events[-1] = BlockRemoved(last.block_hashes + (h,))
        else:
            self.events.append(BlockRemoved((h,)))

    def take(self) -> list[CacheEvent]:
        events, self.events = self.events, []
        return events


def _guarded(callback: Callable[[list[CacheEvent]], None]) -> Callable[[list[CacheEvent]], None]:
    """A failing listener is logged, not allowed to stop the engine step that emitted to it."""

    def call(events: list[CacheEvent]) -> None:
        try:
            callback(events)
        except Exception:
            log.exception("cache event listener %r failed", callback)

    return call


class PrefixCache:
    """Blocks of KV keyed by chained hash, bounded by `capacity_tokens`.

    Referenced (pinned) blocks and blocks with cached children are never evicted: a child is only
    reachable through its parent, so eviction goes leaf-first in least-recently-used order. Events
    accumulate until `flush`, which the engine calls once per step.
    """

    def __init__(self, block_size: int = 16, capacity_tokens: int = 16384) -> None:
        if block_size < 1 or capacity_tokens < block_size:
            raise ValueError("block_size must be >= 1 and capacity_tokens >= block_size")
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self.stats = CacheStats()
        self._blocks: OrderedDict[int, Block] = OrderedDict()
        self._log = _EventLog(block_size)
        self._listeners = CacheListeners()
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[int]:
        with self._lock:
            return iter(list(self._blocks))

    def __contains__(self, h: int) -> bool:
        return h in self._blocks

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.kv.numel() * b.kv.element_size() for b in self._blocks.values())

    def block(self, h: int) -> Block:
        return self._blocks[h]

    def lookup(self, token_ids: Sequence[int], max_blocks: int | None = None) -> list[Block]:
        """The longest run of cached full blocks that starts `token_ids`, marked as just used."""
        with self._lock:
            found: list[Block] = []
            parent = None
            limit = len(token_ids) // self.block_size
            if max_blocks is not None:
                limit = min(limit, max_blocks)
            for i in range(limit):
                parent = block_hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
                block = self._blocks.get(parent)
                if block is None:
                    break
                found.append(block)
            self._touch([b.hash for b in found])
            self.stats.lookups += 1
            self.stats.hits += bool(found)
            self.stats.misses += not found
            self.stats.hit_tokens += len(found) * self.block_size
            return found

    def insert(
        self, token_ids: Sequence[int], kv_of: Callable[[int], torch.Tensor], pin: bool = False
    ) -> list[int]:
        """Cache every full block of `token_ids`; `kv_of(i)` gives block i's KV as a tensor the cache
        may keep, and is only called for blocks not cached yet. Stops where memory cannot be freed.
        Returns the hashes now cached (pinned once more each when `pin`)."""
        with self._lock:
            chain: list[int] = []
            parent = None
            for i, h in enumerate(block_hashes(token_ids, self.block_size)):
                if h not in self._blocks:
                    if len(self._blocks) >= self.capacity_blocks and not self._evict_one(keep=parent):
                        break
                    tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
                    block = Block(h, parent, tokens, kv_of(i))
                    self._blocks[h] = block
                    if parent is not None:
                        self._blocks[parent].children += 1
                    self._log.stored(block)
                    self.stats.stored += 1
                if pin:
                    self._blocks[h].refs += 1
                chain.append(h)
                parent = h
            self._touch(chain)
            return chain

    def pin(self, hashes: Sequence[int]) -> None:
        with self._lock:
            for h in hashes:
                self._blocks[h].refs += 1

    def unpin(self, hashes: Sequence[int]) -> None:
        """Release blocks a finished sequence held; they count as used now."""
        with self._lock:
            for h in hashes:
                self._blocks[h].refs -= 1
            self._touch(hashes)

    def clear(self) -> bool:
        """Drop every block, unless one is pinned; False then, and nothing changes."""
        with self._lock:
            if any(b.refs for b in self._blocks.values()):
                return False
            if self._blocks:
                self._blocks.clear()
                self._log.events.append(AllBlocksCleared())
            return True

    def subscribe(self, callback: Callable[[list[CacheEvent]], None]) -> None:
        """Add a listener, first handing it the current content, so it sees neither a gap nor a repeat."""
        with self._lock:
            self.flush()
            snapshot = _EventLog(self.block_size)
            for block in self._preorder():
                snapshot.stored(block)
            if snapshot.events:
                callback(snapshot.events)
            self._listeners.add(_guarded(callback))

    def flush(self) -> None:
        with self._lock:
            self._listeners.emit(self._log.take())

    def _touch(self, chain: Sequence[int]) -> None:
        # The chain's tail becomes least recent of the chain, so its leaves go before their parents.
        for h in reversed(chain):
            self._blocks.move_to_end(h)

    def _evict_one(self, keep: int | None) -> bool:
        """Evict the least recently used free leaf other than `keep` (the parent about to get a child)."""
        victim = next(
            (b for b in self._blocks.values() if b.refs == 0 and b.children == 0 and b.hash != keep), None
        )
        if victim is None:
            return False
        del self._blocks[victim.hash]
        if victim.parent is not None:
            self._blocks[victim.parent].children -= 1
        self._log.removed(victim.hash)
        self.stats.evictions += 1
        return True

    def _preorder(self) -> Iterator[Block]:
        """Every block after its parent, each chain contiguous, so snapshot events merge per chain."""
        kids: dict[int | None, list[Block]] = {}
        for block in self._blocks.values():
            kids.setdefault(block.parent, []).append(block)
        stack = list(reversed(kids.get(None, [])))
        while stack:
            block = stack.pop()
            yield block
            stack.extend(reversed(kids.get(block.hash, [])))
