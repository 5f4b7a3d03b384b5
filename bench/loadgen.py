"""Open-loop transaction load against a running network, with commit times observed from blocks."""

from __future__ import annotations

import base64
import hashlib
import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from planetserve.chain.rpc import RpcClient, RpcUnreachable


@dataclass(frozen=True)
class LoadResult:
    txs: int
    committed: int
    seconds: float
    latencies_ms: list[float]

    @property
    def tx_per_s(self) -> float:
        return self.committed / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.latencies_ms) if self.latencies_ms else float("nan")


class BlockWatcher(threading.Thread):
    """Polls one node for new blocks and records when each transaction was first seen committed."""

    def __init__(self, rpc_url: str, start_height: int) -> None:
        super().__init__(daemon=True)
        self.rpc = RpcClient(rpc_url, timeout=10)
        self.next_height = start_height + 1
        self.seen: dict[bytes, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            latest = self.rpc.latest_height()
            while self.next_height <= latest:
                block = self.rpc.block(self.next_height)
                now = time.monotonic()
                for tx in block["block"]["data"]["txs"] or []:
                    self.seen.setdefault(hashlib.sha256(base64.b64decode(tx)).digest(), now)
                self.next_height += 1
            time.sleep(0.02)


def run_load(
    rpc_urls: Sequence[str], txs: Sequence[bytes], threads: int = 8, timeout: float = 300.0,
    wait_check: bool = False,
) -> LoadResult:
    """Broadcast every tx (round-robin over the endpoints, from `threads` workers) and wait until all
    are committed or the timeout passes. By default the load is open-loop (broadcast_tx_async):
    with `wait_check` each worker waits for CheckTx's answer (broadcast_tx_sync), which ties the
    offered load to the ABCI round trip (over a socket, CometBFT flushes requests every 20 ms)."""
    start_height = RpcClient(rpc_urls[0]).latest_height()
    watcher = BlockWatcher(rpc_urls[0], start_height)
    watcher.start()
    clients = [RpcClient(url, timeout=30) for url in rpc_urls]
    submitted: dict[bytes, float] = {}
    rejected = 0
    lock = threading.Lock()

    def send(i: int) -> None:
        nonlocal rejected
        raw = txs[i]
        t = time.monotonic()
        for attempt in range(3):  # a connection reset under load is retried, not counted as a refusal
            try:
                client = clients[i % len(clients)]
                answer = client.broadcast_tx_sync(raw) if wait_check else client.broadcast_tx_async(raw)
                break
            except RpcUnreachable:
                if attempt == 2:
                    raise
                time.sleep(0.1)
        with lock:
            if answer.code == 0:
                submitted[hashlib.sha256(raw).digest()] = t
            else:
                rejected += 1

    began = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(send, range(len(txs))))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(h in watcher.seen for h in submitted):
        time.sleep(0.05)
    watcher.stop.set()
    watcher.join()
    done = [h for h in submitted if h in watcher.seen]
    last = max((watcher.seen[h] for h in done), default=began)
    if rejected:
        print(f"  warning: {rejected} transactions refused by CheckTx")
    return LoadResult(
        txs=len(txs),
        committed=len(done),
        seconds=last - began,
        latencies_ms=[(watcher.seen[h] - submitted[h]) * 1000 for h in done],
    )
