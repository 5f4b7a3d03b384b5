"""Stopping background tasks so that they really stop.

On Python 3.11, `asyncio.wait_for` returns its inner result instead of raising when a cancellation
arrives just as that result does (fixed in 3.12), so a loop cancelled once may carry on and a close
that awaits it never returns. `stop_tasks` cancels again until every task has ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)

RECANCEL_S = 0.5


async def stop_tasks(tasks: Iterable[asyncio.Task]) -> None:
    """Cancel `tasks` and return once each has ended; a failure one of them ended with is logged."""
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.warning("task %s had failed: %r", task.get_name(), task.exception())
