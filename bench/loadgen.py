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

import httpx

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
    wait_check: bool = False, batch: int = 1,
) -> LoadResult:
    """Broadcast every tx (round-robin over the endpoints, from `threads` workers) and wait until all
    are committed or the timeout passes.

    By default the load is open loop (broadcast_tx_async), `batch` transactions per JSON-RPC batch
    request, so that the offered load is not capped by this Python client. With `wait_check` each
    worker sends one tx at a time and waits for CheckTx's answer (broadcast_tx_sync), which ties the
    offered load to the ABCI round trip (over a socket, CometBFT flushes requests every 20 ms)."""
    start_height = RpcClient(rpc_urls[0]).latest_height()
    watcher = BlockWatcher(rpc_urls[0], start_height)
    watcher.start()
    clients = [RpcClient(url, timeout=30) for url in rpc_urls]
    http = httpx.Client(timeout=60)
    size = 1 if wait_check else batch
    chunks = [range(i, min(i + size, len(txs))) for i in range(0, len(txs), size)]
    submitted: dict[bytes, float] = {}
    rejected = 0
    lock = threading.Lock()

    def send_one(i: int) -> int:
        client = clients[i % len(clients)]
        answer = client.broadcast_tx_sync(txs[i]) if wait_check else client.broadcast_tx_async(txs[i])
        return answer.code

    def send_batch(chunk: range) -> list[int]:
        body = [{"jsonrpc": "2.0", "id": i, "method": "broadcast_tx_async",
                 "params": {"tx": base64.b64encode(txs[i]).decode()}} for i in chunk]
        answers = http.post(rpc_urls[chunk[0] % len(rpc_urls)], json=body).json()
        if not isinstance(answers, list) or len(answers) != len(chunk):
            raise RuntimeError(f"batch of {len(chunk)} answered with {str(answers)[:200]}")
        return [0 if "result" in a and int(a["result"].get("code", 0)) == 0 else 1 for a in answers]

    def send(chunk: range) -> None:
        nonlocal rejected
        t = time.monotonic()
        for attempt in range(3):  # a connection reset under load is retried, not counted as a refusal
            try:
                codes = [send_one(chunk[0])] if len(chunk) == 1 else send_batch(chunk)
                break
            except (RpcUnreachable, httpx.TransportError):
                if attempt == 2:
                    raise
                time.sleep(0.1)
        with lock:
            for i, code in zip(chunk, codes, strict=True):
                if code == 0:
                    submitted[hashlib.sha256(txs[i]).digest()] = t
                else:
                    rejected += 1

    began = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(send, chunks))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(h in watcher.seen for h in submitted):
        time.sleep(0.05)
    watcher.stop.set()
    watcher.join()
    http.close()
    done = [h for h in submitted if h in watcher.seen]
    last = max((watcher.seen[h] for h in done), default=began)
    if rejected:
        print(f"  warning: {rejected} transactions refused")
    return LoadResult(
        txs=len(txs),
        committed=len(done),
        seconds=last - began,
        latencies_ms=[(watcher.seen[h] - submitted[h]) * 1000 for h in done],
    )
