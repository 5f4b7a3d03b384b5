"""Background tasks are stopped for good, even one that swallows a cancellation (as Python 3.11's
asyncio.wait_for can when its inner result arrives with the cancellation)."""

from __future__ import annotations

import asyncio
import logging

from waiting import run

from planetserve.node.tasks import stop_tasks


def test_a_task_that_swallows_a_cancellation_is_cancelled_again_until_it_ends():
    async def main():
        swallowed = []

        async def stubborn() -> None:
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    if len(swallowed) < 2:  # carries on, as a loop whose wait_for ate the cancel would
                        swallowed.append(asyncio.current_task().uncancel())
                        continue
                    raise

        async def finished() -> str:
            return "done"

        tasks = [asyncio.create_task(stubborn()), asyncio.create_task(finished())]
        await asyncio.sleep(0)
        await asyncio.wait_for(stop_tasks(tasks), 10)
        assert len(swallowed) == 2 and tasks[0].cancelled() and tasks[1].result() == "done"

    run(main(), 30)


def test_a_task_that_had_failed_is_logged_not_raised(caplog):
    async def main():
        async def broken() -> None:
            raise ValueError("the loop broke")

        task = asyncio.create_task(broken(), name="sync-loop")
        await asyncio.sleep(0)
        with caplog.at_level(logging.WARNING, logger="planetserve.node.tasks"):
            await stop_tasks([task])
        assert "task sync-loop had failed: ValueError('the loop broke')" in caplog.text

    run(main(), 30)
