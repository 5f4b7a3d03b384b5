"""What one streamed answer costs the overlay: a model node's reply parts are joined when tokens come
faster than the part linger (each part is an S-IDA round and n cloves through every relay of n paths),
never held back when they come slower; a request's used-up paths are replaced once its answer has
begun, not while its prompt is on its way (bench/overlay_cost.py measures both)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

from planetserve.chain.keys import KeySet
from planetserve.node.overlay.gateway import batched
from planetserve.node.overlay.paths import Path, PathManager, PathSettings


async def produced(count: int, every: float, size: int = 10) -> AsyncIterator[bytes]:
    for i in range(count):
        await asyncio.sleep(every)
        yield bytes([i]) * size


async def collect(parts: AsyncIterator[bytes]) -> list[tuple[float, bytes]]:
    return [(time.monotonic(), part) async for part in parts]


async def stamped(parts: AsyncIterator[bytes], timed: list[float]) -> AsyncIterator[bytes]:
    """`parts`, the time each one was made appended to `timed`."""
    async for part in parts:
        timed.append(time.monotonic())
        yield part


def test_fast_tokens_travel_a_few_to_a_part_and_the_first_at_once():
    """Tokens 2 ms apart, a 20 ms linger: the first token goes alone (held for the linger, it would carry
    about ten), and the rest in parts at least the linger apart, so no more parts than the time the tokens
    took allows, however slowly a loaded machine made them."""
    async def main():
        timed: list[float] = []
        out = await collect(batched(stamped(produced(40, 0.002), timed), linger=0.02))
        expected = b"".join(bytes([i]) * 10 for i in range(40))
        assert b"".join(part for _, part in out) == expected  # nothing lost, nothing reordered
        assert out[0][1] == bytes([0]) * 10  # the first token alone, at once
        assert len(out) <= 2 + (timed[-1] - timed[0]) / 0.02
        assert len(out) < len(expected) // 10
        gaps = [b[0] - a[0] for a, b in zip(out, out[1:], strict=False)]
        assert min(gaps) >= 0.018

    asyncio.run(main())


def test_slow_tokens_go_one_by_one_without_waiting_for_the_linger():
    async def main():
        timed: list[float] = []
        out = await collect(batched(stamped(produced(6, 0.15), timed), linger=0.1))
        assert [part for _, part in out] == [bytes([i]) * 10 for i in range(6)]
        assert max(sent - made for (sent, _), made in zip(out, timed, strict=True)) < 0.05  # not the linger's 0.1

    asyncio.run(main())


def test_a_part_never_exceeds_its_limit_by_more_than_one_chunk():
    async def main():
        out = await collect(batched(produced(50, 0.0, size=100), limit=1000, linger=0.05))
        assert b"".join(p for _, p in out) == b"".join(bytes([i]) * 100 for i in range(50))
        assert all(len(p) <= 1100 for _, p in out) and len(out) >= 5

    asyncio.run(main())


def test_a_used_up_path_is_replaced_once_the_answer_begins_not_while_the_prompt_leaves():
    async def main():
        sent: list[str] = []

        async def send(_peer: bytes, msg_type: str, _body: object) -> None:
            sent.append(msg_type)

        relays = [KeySet.generate().public for _ in range(6)]
        manager = PathManager(secrets.token_bytes(32), send, lambda: relays,
                              settings=PathSettings(target=1, uses=1, setup_timeout=0.2))
        path = Path(secrets.token_bytes(16), tuple(relays[:3]), secrets.token_bytes(16), secrets.token_bytes(32),
                    listed=len(relays))
        path.state = "live"
        manager.paths[(path.first, path.link)] = path
        manager.use([path])
        await asyncio.sleep(0.1)
        assert path.state != "live" and "setup" not in sent  # retired, and nothing built yet
        manager.replenish()
        await asyncio.sleep(0.1)
        assert sent.count("setup") == 1  # its replacement, now
        await asyncio.sleep(0.3)  # the setup times out (no relay answers here)
        assert manager.counters["setup_failures"] == 1

    asyncio.run(main())
