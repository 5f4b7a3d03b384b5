"""A token bucket: what a relay or model node lets the network make it do on its own account (look up a
knocking key, answer a prompt it is too busy to serve) at most `rate` times a second, `burst` at once."""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self._tokens = float(burst)
        self._filled = clock()

    def take(self) -> bool:
        """Whether one more may go now (and count it)."""
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._filled) * self.rate)
        self._filled = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True
