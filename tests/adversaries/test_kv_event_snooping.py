"""Another account on a model node's machine (or, with the wildcard, anyone who reaches the port) reads
the KV-cache events of the engine behind the node: vLLM's `BlockStored` events carry the token ids of
every cached prompt block, users' prompts and challenges alike, and its replay endpoint hands out the
last 10,000 batches to whoever asks, with no authentication. The documented vLLM configuration bound
both on `tcp://*`. It now puts them on `ipc://` sockets in a directory only the engine's user may enter
(docs/operators.md), which the node subscribes to; this test runs the publisher (vLLM's wire format)
both ways and a process that dropped root for nobody asks each for a replay."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from nobody import as_nobody, as_root, shared_directory
from test_kvevents import Collector, publish_until_seen
from waiting import run

from planetserve.node.engine.kvevents import KVEventPublisher

pytestmark = as_root


def replay_of(endpoint: str, timeout: float = 2.0) -> Callable[[], str]:
    """Asking `endpoint` for a replay of the events from 0: "replayed" if it answers in time."""

    def attempt() -> str:
        context = zmq.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        answered = dealer.poll(int(timeout * 1000)) and len(dealer.recv_multipart()) == 3
        dealer.close()
        context.term()
        return "replayed" if answered else "nothing"

    return attempt


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    with shared_directory("ps-kv-") as path:
        yield path


def publish_and_check(events: str, replay: str) -> tuple[KVEventPublisher, bool]:
    """A publisher at `events`/`replay` holding a batch; whether the node's subscriber receives it."""
    publisher = KVEventPublisher(events, replay_endpoint=replay)
    got = Collector()

    async def body() -> None:
        subscriber = got.subscriber(publisher)
        try:
            subscriber.start()
            await publish_until_seen(publisher, got)
        finally:
            await subscriber.close()

    run(body(), 30)
    return publisher, bool(got.batches)


def test_on_the_wildcard_any_account_reads_the_engines_cached_prompts():
    publisher, node_reads = publish_and_check("tcp://*:*", "tcp://*:*")
    try:
        assert node_reads
        port = publisher.replay_endpoint.rpartition(":")[2]
        assert as_nobody(replay_of(f"tcp://127.0.0.1:{port}")) == "replayed"
    finally:
        publisher.close()


def test_on_sockets_in_a_private_directory_only_the_engines_account_reads_them(shared_tmp):
    private = shared_tmp / "kv"
    private.mkdir(mode=0o700)
    events, replay = f"ipc://{private}/events.sock", f"ipc://{private}/replay.sock"
    publisher, node_reads = publish_and_check(events, replay)
    try:
        assert node_reads
        assert as_nobody(replay_of(replay)) == "nothing"
        private.chmod(0o755)  # the directory is what keeps others out: opened, the socket answers
        (private / "replay.sock").chmod(0o777)
        assert as_nobody(replay_of(replay)) == "replayed"
    finally:
        publisher.close()
