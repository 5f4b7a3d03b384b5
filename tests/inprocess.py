"""The ledger client over the in-process chain: the real `LedgerClient`'s typed reads, with its two
primitive reads (one key, one prefix) answered from the harness's committed state and each submitted
transaction carried by a block of its own, so that real verifier daemons tick against a chain that a test
drives block by block. Nothing is proven: the state is the app's own."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

from harness import AppHarness

from planetserve.chain.client import LedgerClient, Listing, Submitted
from planetserve.chain.keys import KeySet
from planetserve.chain.messages.base import Message
from planetserve.chain.rpc import TxOutcome


class _Status:
    """What the daemon asks the endpoint directly: the latest height."""

    def __init__(self, h: AppHarness) -> None:
        self.h = h

    def status(self) -> dict[str, Any]:
        return {"sync_info": {"latest_block_height": str(self.h.height)}}

    def close(self) -> None:
        return None


class InProcessLedger(LedgerClient):
    def __init__(self, h: AppHarness) -> None:
        super().__init__(_Status(h), None)  # type: ignore[arg-type]
        self.h = h

    @contextlib.contextmanager
    def snapshot(self, height: int | None = None) -> Iterator[int]:
        yield self.h.height

    def _entries(self, prefix: bytes) -> Listing:
        return Listing(self.h.height, list(self.h.store.batch().iterate(prefix)), False)

    def value(self, key: bytes, since: int | None = None) -> tuple[int, bytes | None]:
        return self.h.height, self.h.store.batch().get(key)

    def submit(self, keys: KeySet, msg: Message, timeout: float = 30.0) -> Submitted:
        raw = self.h.tx(keys, msg.TYPE, msg.body())
        [result] = self.h.block(raw).tx_results
        return Submitted(hashlib.sha256(raw).digest(), self.h.height,
                         TxOutcome(code=result.code, data=result.data, log=result.log))

    def verified_outcome(self, done: Submitted) -> Submitted:
        return done
