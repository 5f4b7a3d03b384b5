"""Ids remembered for a window around the time their sender says it made them, so that a replay inside
the window is refused as a replay and one after it as stale: nothing but the window ever removes an id,
and past its limit in all (and any per sender its owner sets by `held_by`) the window refuses new ids
rather than forget old ones (it fails closed). An id made a little after the window (its sender's clock
ahead of ours: `early`) is refused and remembered too, so that a capture of it is refused again when it
enters the window. A relay keeps one for path setups, a model node's gateway one for prompts."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Hashable


class ReplayWindow:
    def __init__(self, max_age: float, max_ahead: float, capacity: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.max_age = max_age
        self.max_ahead = max_ahead
        self.capacity = capacity
        self.clock = clock
        """Wall clock (ids carry their sender's time); read through `now`, which never goes back."""
        self._latest = 0.0
        self._senders: dict[bytes, Hashable] = {}
        """Each id within the window, and who sent it."""
        self._by_sender: dict[Hashable, int] = {}
        self._order: list[tuple[float, bytes]] = []
        """(made, id), a heap: what leaves the window first."""

    def __len__(self) -> int:
        return len(self._senders)

    def __contains__(self, key: bytes) -> bool:
        return key in self._senders

    def now(self) -> float:
        """The wall clock, never going back (a clock set back must not let a forgotten id in again)."""
        self._latest = max(self._latest, self.clock())
        return self._latest

    def held_by(self, sender: Hashable) -> int:
        return self._by_sender.get(sender, 0)

    def full(self) -> bool:
        return len(self._senders) >= self.capacity

    def in_window(self, made: float, now: float) -> bool:
        return now - self.max_age <= made <= now + self.max_ahead

    def early(self, made: float, now: float) -> bool:
        """Made after the window, but within one window's age of it: refused now, remembered (until it
        leaves the window like any other), so that a capture replayed once it enters is refused too. An
        id made further ahead is refused without being kept, which bounds how long any id is held."""
        return now + self.max_ahead < made <= now + self.max_ahead + self.max_age

    def outside(self, key: bytes, made: float, now: float, sender: Hashable = None) -> bool:
        """Whether an id made at `made` is outside the window, so to be refused; an early one is
        remembered first, where the limits leave room (the caller checked its sender's)."""
        if self.in_window(made, now):
            return False
        if self.early(made, now) and not self.full():
            self.remember(key, made, sender)
        return True

    def remember(self, key: bytes, made: float, sender: Hashable = None) -> None:
        """Keep an id its sender made at `made`, checked against the window and the limits before."""
        self._senders[key] = sender
        self._by_sender[sender] = self._by_sender.get(sender, 0) + 1
        heapq.heappush(self._order, (made, key))

    def forget(self, now: float) -> int:
        """Forget the ids that left the window (a replay of one is stale now); returns how many."""
        cutoff = now - self.max_age
        forgotten = 0
        while self._order and self._order[0][0] < cutoff:
            _, key = heapq.heappop(self._order)
            sender = self._senders.pop(key)
            left = self._by_sender[sender] - 1
            if left:
                self._by_sender[sender] = left
            else:
                del self._by_sender[sender]
            forgotten += 1
        return forgotten
