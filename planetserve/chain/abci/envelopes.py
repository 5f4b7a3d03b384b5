"""Transactions whose signature verified, decoded: a transaction is seen by CheckTx, by the recheck
after every block it waits through, by proposals and by FinalizeBlock, and its decoding, its message
and its signature are functions of its bytes alone, so each is worked out once.

Bounded in entries and in the bytes of the transactions held, and only a transaction whose signature
verified gets in: a client flooding CheckTx with undecodable, unsigned or badly signed transactions
stores nothing here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from planetserve.chain.messages.base import Message
from planetserve.chain.tx import Tx

MAX_ENTRIES = 100_000
MAX_BYTES = 64 << 20
"""The transactions' own bytes: the decoded forms take a small multiple of them."""


@dataclass(slots=True)
class Verified:
    tx: Tx
    size: int
    message: Message | None = None
    """The body's message once parsed (None until then, or while it does not parse)."""


class VerifiedEnvelopes:
    """Verified transactions by the SHA-256 of their bytes, least recently used out first."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[bytes, Verified] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: bytes) -> Verified | None:
        found = self._entries.get(digest)
        if found is not None:
            self._entries.move_to_end(digest)
        return found

    def add(self, digest: bytes, tx: Tx, size: int) -> Verified:
        """Remember a transaction of `size` bytes whose signature verified; a larger one than the
        whole budget is not kept."""
        entry = Verified(tx, size)
        if size > self.max_bytes or digest in self._entries:
            return entry
        while self._entries and (len(self._entries) >= self.max_entries
                                 or self.bytes + size > self.max_bytes):
            self.bytes -= self._entries.popitem(last=False)[1].size
        self._entries[digest] = entry
        self.bytes += size
        return entry
