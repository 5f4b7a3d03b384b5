"""Roles in processes of their own, as on machines of their own, each with a pipe the benchmark
talks to it through: one role's Python (its GIL, its event loop) never slows another's."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess


class Processes:
    """The roles' processes, each started with a pipe to talk to it."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.started: list[tuple[BaseProcess, Connection]] = []

    def start(self, target: object, *args: object) -> tuple[BaseProcess, Connection]:
        parent, child = self.context.Pipe()
        process = self.context.Process(target=target, args=(child, *args), daemon=True)
        process.start()
        self.started.append((process, parent))
        return process, parent

    @staticmethod
    async def answer(process: BaseProcess, pipe: Connection, what: str) -> object:
        deadline = time.monotonic() + 300
        while not await asyncio.to_thread(pipe.poll, 0.5):
            if not process.is_alive() or time.monotonic() > deadline:
                raise SystemExit(f"the {what} did not start (its error is above)")
        return pipe.recv()

    async def stop(self) -> None:
        for process, pipe in self.started:
            if process.is_alive():
                pipe.send("stop")
        for process, _ in self.started:
            await asyncio.to_thread(process.join, 60)
