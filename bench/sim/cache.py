"""A node's prefix KV cache in blocks: chained block hashes, pins, LRU eviction.

It holds only accounting (no tensors): which prompt blocks are cached and how many blocks running
sequences have reserved. Capacity is shared between the two, so a busy node keeps fewer prefixes.

Eviction takes the least recently used unpinned block. A sequence's blocks are released leaf first,
so a parent is always more recent than its children and eviction only ever removes leaves: a cached
block's whole prefix is cached, as in vLLM. A listener hears which token prefixes the cache gained
and lost, which is what a node's cache-state sync publishes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from planetserve.workloads import Request


class CacheListener(Protocol):
    def stored(self, request: Request, blocks: int) -> None:
        """The cache now holds the first `blocks` blocks of the request's prompt."""

    def evicted(self, request: Request, block: int) -> None:
        """The cache lost block `block` of the request's prompt, and so everything after it."""


class PrefixCache:
    def __init__(self, capacity_blocks: int, block_size: int, listener: CacheListener | None = None) -> None:
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.listener = listener
        self.refs: dict[int, int] = {}
        """Cached block -> sequences pinning it."""
        self.lru: OrderedDict[int, None] = OrderedDict()
        """Unpinned cached blocks, least recently used first."""
        self.origin: dict[int, tuple[Request, int, int | None]] = {}
        """With a listener: block -> (a prompt holding it, its index there, its parent block)."""
        self.reserved = 0
        """Blocks promised to running sequences and not yet cached (their uncached prompt and output)."""
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.refs)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks are cached."""
        n = 0
        for h in hashes:
            if h not in self.refs:
                break
            n += 1
        return n

    def free(self) -> int:
        """Blocks a new sequence could get, counting unpinned cached blocks as evictable."""
        return self.capacity - len(self.refs) - self.reserved + len(self.lru)

    def admit(self, hashes: Sequence[int], matched: int, needed: int) -> bool:
        """Pin the first `matched` blocks and reserve `needed` more, evicting as needed; False (and no
        change) when even a cache emptied of unpinned blocks could not make room."""
        if needed > self.free():
            return False
        for h in hashes[:matched]:
            self._pin(h)
        overflow = len(self.refs) + self.reserved + needed - self.capacity
        if overflow > 0:
            self._evict(overflow)
        self.reserved += needed
        return True

    def store(self, request: Request, hashes: Sequence[int], start: int) -> None:
        """Cache the computed prompt blocks hashes[start:], moving them from the sequence's reservation
        into the cache, pinned by it (a block another sequence cached meanwhile is just pinned)."""
        grew = False
        for i in range(start, len(hashes)):
            h = hashes[i]
            if h in self.refs:
                self._pin(h)
            else:
                self.refs[h] = 1
                grew = True
                if self.listener is not None:
                    self.origin[h] = (request, i, hashes[i - 1] if i else None)
        self.reserved -= len(hashes) - start
        if grew and self.listener is not None:
            self.listener.stored(request, len(hashes))

    def release(self, hashes: Sequence[int], reserved: int) -> None:
        """A sequence finished: unpin its cached blocks, leaf first, and drop its leftover reservation."""
        for h in reversed(hashes):
            refs = self.refs[h] - 1
            self.refs[h] = refs
            if refs == 0:
                self.lru[h] = None
        self.reserved -= reserved

    def _pin(self, h: int) -> None:
        refs = self.refs[h]
        if refs == 0:
            del self.lru[h]
        self.refs[h] = refs + 1

    def _evict(self, count: int) -> None:
        removed = [self.lru.popitem(last=False)[0] for _ in range(count)]
        for h in removed:
            del self.refs[h]
        self.evictions += count
        if self.listener is not None:
            gone = set(removed)
            origins = [self.origin.pop(h) for h in removed]
            for request, index, parent in origins:
                if parent not in gone:  # the topmost lost block of its chain says it all
                    self.listener.evicted(request, index)
