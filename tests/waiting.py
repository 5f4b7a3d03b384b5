"""Waiting in tests: for a condition with a deadline (never a fixed sleep before an assertion), and for a
coroutine with a time limit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.2) -> None:
    """Poll `predicate` until it holds; fail the test once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout} s")
        time.sleep(interval)


async def until(predicate: Callable[[], object], timeout: float = 15.0, interval: float = 0.02) -> None:
    """`wait_until` inside an event loop: the loop keeps running between polls."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout} s")
        await asyncio.sleep(interval)


def run(coro: Coroutine[Any, Any, T], timeout: float = 240.0) -> T:
    """Run a test's coroutine in a fresh event loop; a hang fails it after `timeout` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))
