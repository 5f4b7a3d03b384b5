"""The ABCI socket server: framing, ordering, Flush, and bad peers that must not take it down."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from harness import AppHarness, sqlite_url
from hypothesis import given
from hypothesis import strategies as st
from tendermint.abci import types_pb2 as abci

from planetserve.chain.abci.address import TcpAddress
from planetserve.chain.abci.server import (
    MAX_MESSAGE_BYTES,
    AbciServer,
    FrameReader,
    FramingError,
    frame,
    parse_uvarint,
)
from planetserve.chain.varint import encode_uvarint


@given(st.integers(min_value=0, max_value=2**63))
def test_uvarint_round_trip(value):
    raw = encode_uvarint(value)
    assert parse_uvarint(b"x" + raw, 1) == (value, len(raw) + 1)
    assert parse_uvarint(raw[:-1], 0) is None


def test_overlong_uvarint_is_a_framing_error():
    with pytest.raises(FramingError, match="longer than 10 bytes"):
        parse_uvarint(b"\xff" * 11, 0)


def test_requests_split_across_reads_and_packed_into_one():
    """Frames arrive in arbitrary pieces; the reader must reassemble each one exactly."""
    requests = [abci.Request(echo=abci.RequestEcho(message="m" * n)) for n in (0, 1, 200, 70_000)]
    stream = b"".join(frame(r) for r in requests)

    async def read_all(pieces: list[bytes]) -> list[abci.Request]:
        reader = asyncio.StreamReader()
        for piece in pieces:
            reader.feed_data(piece)
        reader.feed_eof()
        frames = FrameReader(reader)
        return [await frames.next() for _ in requests]

    for pieces in ([stream], [stream[i : i + 7] for i in range(0, len(stream), 7)]):
        assert asyncio.run(read_all(pieces)) == requests


LOOPBACK = TcpAddress("127.0.0.1", 0)
"""A free port on loopback."""


@pytest.fixture
def server(tmp_path):
    harness = AppHarness(sqlite_url(tmp_path))
    harness.block()
    srv = AbciServer(harness.app)
    ports: list[int] = []
    ready = threading.Event()

    def on_ready(bound: TcpAddress) -> None:
        ports.append(bound.port)
        ready.set()

    thread = threading.Thread(
        target=asyncio.run, args=(srv.serve(LOOPBACK, handle_signals=False, ready=on_ready),), daemon=True
    )
    thread.start()
    assert ready.wait(10)
    yield ports[0], harness
    srv.stop()
    thread.join(10)


def recv_response(sock: socket.socket) -> abci.Response:
    size, shift = 0, 0
    while True:
        byte = sock.recv(1)[0]
        size |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    body = b""
    while len(body) < size:
        body += sock.recv(size - len(body))
    response = abci.Response()
    response.ParseFromString(body)
    return response


def test_responses_in_request_order_and_flush(server):
    port, harness = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        requests = [
            abci.Request(echo=abci.RequestEcho(message="one")),
            abci.Request(info=abci.RequestInfo()),
            abci.Request(check_tx=abci.RequestCheckTx(tx=b"junk")),
            abci.Request(query=abci.RequestQuery(path="/key", data=b"params")),
            abci.Request(flush=abci.RequestFlush()),
        ]
        sock.sendall(b"".join(frame(r) for r in requests))
        kinds = [recv_response(sock).WhichOneof("value") for _ in requests]
        assert kinds == ["echo", "info", "check_tx", "query", "flush"]


def test_info_reports_committed_height_and_hash(server):
    port, harness = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(frame(abci.Request(info=abci.RequestInfo())) + frame(abci.Request(flush=abci.RequestFlush())))
        info = recv_response(sock).info
        assert info.last_block_height == harness.store.height
        assert info.last_block_app_hash == harness.store.app_hash


@pytest.mark.parametrize(
    "garbage",
    [encode_uvarint(MAX_MESSAGE_BYTES + 1), encode_uvarint(3) + b"\xff\xff\xff", b"\xff" * 11],
    ids=["oversize", "undecodable", "varint-too-long"],
)
def test_bad_peer_is_dropped_and_server_keeps_serving(server, garbage):
    port, _ = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as bad:
        bad.sendall(garbage)
        assert bad.recv(1) == b""  # the server closed this connection
    with socket.create_connection(("127.0.0.1", port), timeout=10) as good:
        good.sendall(frame(abci.Request(echo=abci.RequestEcho(message="still here"))) +
                     frame(abci.Request(flush=abci.RequestFlush())))
        assert recv_response(good).echo.message == "still here"


def test_error_in_a_consensus_method_stops_the_server(tmp_path):
    """Commit without a finalized block is a bug or a confused peer: stop, never answer made-up state."""
    harness = AppHarness(sqlite_url(tmp_path))
    srv = AbciServer(harness.app)
    outcome: list[BaseException] = []
    ready = threading.Event()
    ports: list[int] = []

    def run() -> None:
        try:
            asyncio.run(srv.serve(LOOPBACK, handle_signals=False,
                                  ready=lambda bound: (ports.append(bound.port), ready.set())))
        except SystemExit as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    with socket.create_connection(("127.0.0.1", ports[0]), timeout=10) as sock:
        sock.sendall(frame(abci.Request(commit=abci.RequestCommit())) + frame(abci.Request(flush=abci.RequestFlush())))
        assert sock.recv(1) == b""
    thread.join(10)
    assert not thread.is_alive()
    assert outcome and "Commit without a finalized block" in str(outcome[0])


def test_a_query_in_progress_holds_up_no_other_connection(tmp_path):
    """Queries run on worker threads: while one is being answered, the consensus connection's requests
    (here a block: FinalizeBlock, Commit) are answered; the query's own connection answers in order."""
    harness = AppHarness(sqlite_url(tmp_path))
    harness.block()
    started, release = threading.Event(), threading.Event()
    real_query = harness.app.query

    def slow_query(req: abci.RequestQuery) -> abci.ResponseQuery:
        started.set()
        assert release.wait(20)
        return real_query(req)

    harness.app.query = slow_query  # type: ignore[method-assign]
    srv = AbciServer(harness.app)
    ports: list[int] = []
    ready = threading.Event()
    thread = threading.Thread(target=asyncio.run, daemon=True, args=(srv.serve(
        LOOPBACK, handle_signals=False, ready=lambda bound: (ports.append(bound.port), ready.set())),))
    thread.start()
    assert ready.wait(10)
    flush = frame(abci.Request(flush=abci.RequestFlush()))
    try:
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=10) as query, \
                socket.create_connection(("127.0.0.1", ports[0]), timeout=10) as consensus:
            query.sendall(frame(abci.Request(query=abci.RequestQuery(path="/key", data=b"params"))) +
                          frame(abci.Request(echo=abci.RequestEcho(message="after"))) + flush)
            assert started.wait(10)
            block = abci.RequestFinalizeBlock(height=2, time=Timestamp(seconds=harness.time + 5))
            consensus.sendall(frame(abci.Request(finalize_block=block)) +
                              frame(abci.Request(commit=abci.RequestCommit())) + flush)
            assert recv_response(consensus).finalize_block.app_hash
            assert recv_response(consensus).WhichOneof("value") == "commit"
            assert harness.store.height == 2
            release.set()
            answer = recv_response(query)
            assert answer.query.code == 0 and answer.query.height == 2  # the latest when it ran
            assert recv_response(query).echo.message == "after"
    finally:
        release.set()
        srv.stop()
        thread.join(10)
