"""The peer transport over real TLS sockets on loopback: pinning, mutual authentication, framing,
streams, limits and failure handling."""

from __future__ import annotations

import asyncio
import gc
import ssl
import struct
import sys
import warnings

import pytest
from waiting import run

from planetserve.chain.keys import KeySet
from planetserve.node.overlay.transport import (
    MAX_FRAME,
    MAX_HELD_BYTES,
    MAX_HELD_TOTAL,
    MAX_IN_FLIGHT,
    STREAM_QUEUE,
    ByteBudget,
    Peering,
    RemoteError,
    TransportError,
    decode_frame,
    read_frame,
)
from planetserve.registry import codec


async def echo_handler(peer: bytes, msg_type: str, body):
    if msg_type == "echo":
        return {"from": peer, "body": body}
    if msg_type == "count":
        async def stream():
            for i in range(body):
                yield i
        return stream()
    if msg_type == "boom":
        raise ValueError("handler refused the request")
    return None


def peers(allowed_for_a=None, allowed_for_b=None):
    a_keys, b_keys = KeySet.generate(), KeySet.generate()
    a = Peering(a_keys, echo_handler, allowed_for_a or (lambda key: key == b_keys.public))
    b = Peering(b_keys, echo_handler, allowed_for_b or (lambda key: key == a_keys.public))
    return a, b


def test_call_stream_and_reuse():
    async def main():
        a, b = peers()
        port = await b.listen("127.0.0.1", 0)
        conn = await a.connect(b.keys.public, f"127.0.0.1:{port}")
        assert await conn.call("echo", [1, "x", b"y"]) == {"from": a.keys.public, "body": [1, "x", b"y"]}
        assert [v async for v in conn.request("count", 5)] == [0, 1, 2, 3, 4]
        # concurrent streams over the one connection
        results = await asyncio.gather(*(conn.call("echo", i) for i in range(20)))
        assert [r["body"] for r in results] == list(range(20))
        assert await a.connect(b.keys.public, f"127.0.0.1:{port}") is conn
        # the listener can use the same connection in the other direction
        await asyncio.sleep(0.05)
        back = b.connections[a.keys.public]
        assert (await back.call("echo", "back"))["from"] == b.keys.public
        await a.close()
        await b.close()

    run(main(), 30)


def test_remote_error_is_reported_and_connection_survives():
    async def main():
        a, b = peers()
        port = await b.listen("127.0.0.1", 0)
        conn = await a.connect(b.keys.public, f"127.0.0.1:{port}")
        with pytest.raises(RemoteError, match="handler refused the request"):
            await conn.call("boom", None)
        assert (await conn.call("echo", 7))["body"] == 7
        await a.close()
        await b.close()

    run(main(), 30)


def test_pinning_refuses_a_listener_with_another_key():
    async def main():
        a, b = peers()
        impostor = KeySet.generate()
        port = await b.listen("127.0.0.1", 0)
        trusting = Peering(a.keys, echo_handler, lambda key: True)
        with pytest.raises(TransportError, match="presented key"):
            await trusting.connect(impostor.public, f"127.0.0.1:{port}")
        await b.close()

    run(main(), 30)


def test_listener_refuses_unlisted_dialler():
    async def main():
        a, b = peers(allowed_for_b=lambda key: False)
        port = await b.listen("127.0.0.1", 0)
        with pytest.raises(TransportError, match="refused: .*not in the verified list"):
            await a.connect(b.keys.public, f"127.0.0.1:{port}")
        assert b.connections == {} and a.connections == {}
        await a.close()
        await b.close()

    run(main(), 30)


def test_listener_rereads_its_list_once_for_an_unknown_dialler():
    async def main():
        listed: set[bytes] = set()
        reads = []
        a, b = peers(allowed_for_b=lambda key: key in listed)

        async def knock(key: bytes) -> None:  # the dialler registered a moment ago
            reads.append(key)
            listed.add(key)

        b.knock = knock
        port = await b.listen("127.0.0.1", 0)
        conn = await a.connect(b.keys.public, f"127.0.0.1:{port}")
        assert (await conn.call("echo", 7))["body"] == 7 and reads == [a.keys.public]
        await a.close()
        await b.close()

    run(main(), 30)


def test_a_closed_peering_dials_and_adopts_nothing():
    """A node that stopped serving (its handler's work shut down) must not be reached through it: a
    task still pinging its peers, or a handshake under way while it closed, would otherwise leave a
    live connection whose requests meet the stopped handler."""
    async def main():
        listed: set[bytes] = set()
        gate = asyncio.Event()
        served = []

        async def handler(peer: bytes, msg_type: str, body):
            served.append(msg_type)
            return body

        a_keys, b_keys = KeySet.generate(), KeySet.generate()
        a = Peering(a_keys, handler, lambda key: key == b_keys.public)
        b = Peering(b_keys, handler, lambda key: key in listed)

        async def knock(key: bytes) -> None:  # holds b's handshake with a dialler until the test lets it go
            await gate.wait()
            listed.add(key)

        b.knock = knock
        port = await b.listen("127.0.0.1", 0)

        # a dial under way on both sides when each side closes
        dialling = asyncio.create_task(a.connect(b_keys.public, f"127.0.0.1:{port}"))
        await asyncio.sleep(0.3)
        await a.close()
        await b.close()
        gate.set()
        with pytest.raises(TransportError):
            await dialling
        await asyncio.sleep(0.1)
        assert a.connections == {} and b.connections == {} and served == []

        # and nothing dialled once closed, though the listener is up
        c = Peering(KeySet.generate(), handler, lambda key: True)
        port = await c.listen("127.0.0.1", 0)
        with pytest.raises(TransportError, match="peer transport is closed"):
            await a.connect(c.keys.public, f"127.0.0.1:{port}")
        assert a.connections == {} and c.connections == {}
        await c.close()

    run(main(), 30)


def test_dialler_refuses_unlisted_peer_before_connecting():
    async def main():
        a, _ = peers(allowed_for_a=lambda key: False)
        with pytest.raises(TransportError, match="not in the verified list"):
            await a.connect(KeySet.generate().public, "127.0.0.1:1")

    run(main(), 30)


def test_unreachable_peer_is_a_clear_error():
    async def main():
        a = Peering(KeySet.generate(), echo_handler, lambda key: True)
        with pytest.raises(TransportError, match="cannot reach"):
            await a.connect(KeySet.generate().public, "127.0.0.1:1")

    run(main(), 30)


def test_oversized_and_garbage_frames_close_only_that_connection():
    async def main():
        a, b = peers()
        port = await b.listen("127.0.0.1", 0)
        conn = await a.connect(b.keys.public, f"127.0.0.1:{port}")
        # a frame header announcing more than the limit
        conn.writer.write(struct.pack(">I", MAX_FRAME + 1))
        await conn.writer.drain()
        await asyncio.wait_for(conn.closed.wait(), 5)
        # the listener keeps serving new connections
        conn2 = await a.connect(b.keys.public, f"127.0.0.1:{port}")
        assert conn2 is not conn
        assert (await conn2.call("echo", 1))["body"] == 1
        # a well-sized frame of garbage
        conn2.writer.write(struct.pack(">I", 3) + b"\xc1\xc1\xc1")
        await conn2.writer.drain()
        await asyncio.wait_for(conn2.closed.wait(), 5)
        conn3 = await a.connect(b.keys.public, f"127.0.0.1:{port}")
        assert (await conn3.call("echo", 2))["body"] == 2
        await a.close()
        await b.close()

    run(main(), 30)


class Holding:
    """A handler that holds every message until released, counting how many it holds at once; a
    message's number is its body, or its body's first item."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.running, self.most = 0, 0
        self.handled: list[int] = []

    async def __call__(self, peer, msg_type, body) -> None:
        self.running += 1
        self.most = max(self.most, self.running)
        await self.release.wait()
        self.running -= 1
        self.handled.append(body if isinstance(body, int) else body[0])

    async def all_handled(self, total: int) -> None:
        for _ in range(200):
            if len(self.handled) == total:
                return
            await asyncio.sleep(0.05)


async def connected(handler) -> tuple[Peering, Peering, object]:
    """A dialler and a listener that handles messages with `handler`, and the dialler's connection."""
    a_keys, b_keys = KeySet.generate(), KeySet.generate()
    a = Peering(a_keys, echo_handler, lambda key: key == b_keys.public)
    b = Peering(b_keys, handler, lambda key: key == a_keys.public)
    port = await b.listen("127.0.0.1", 0)
    return a, b, await a.connect(b_keys.public, f"127.0.0.1:{port}")


async def members_connected(handler, count: int) -> tuple[Peering, list[Peering], list]:
    """A listener that handles messages with `handler`, and `count` members each with a connection
    to it: their diallers and connections."""
    b_keys = KeySet.generate()
    senders = [KeySet.generate() for _ in range(count)]
    members = {k.public for k in senders}
    b = Peering(b_keys, handler, lambda key: key in members)
    port = await b.listen("127.0.0.1", 0)
    dialers = [Peering(k, echo_handler, lambda key: key == b_keys.public) for k in senders]
    return b, dialers, [await d.connect(b_keys.public, f"127.0.0.1:{port}") for d in dialers]


def test_a_flood_of_messages_waits_for_free_handlers_and_none_is_lost():
    """A peer sending faster than its messages are handled is held back by TCP: at most
    MAX_IN_FLIGHT handlers run for one connection, and every message is handled in the end."""
    async def main():
        holding = Holding()
        a, b, conn = await connected(holding)
        total = 3 * MAX_IN_FLIGHT
        for i in range(total):
            await conn.notify("hold", i)
        await asyncio.sleep(0.3)
        served = b.connections[a.keys.public]
        assert (holding.running, len(served.tasks), holding.handled) == (MAX_IN_FLIGHT, MAX_IN_FLIGHT, [])
        holding.release.set()
        await holding.all_handled(total)
        assert sorted(holding.handled) == list(range(total)) and holding.most == MAX_IN_FLIGHT
        assert (await served.call("echo", "still open"))["body"] == "still open"
        await a.close()
        await b.close()

    run(main(), 30)


LARGE = 3 * 1024 * 1024
"""A body near the frame limit: MAX_HELD_BYTES holds five such frames, not MAX_IN_FLIGHT."""


def test_a_flood_of_large_messages_holds_at_most_the_byte_budget_and_none_is_lost():
    """A peer sending 3 MiB messages faster than they are handled: the listener reads a frame's body only
    when it has room for it, so its handlers hold at most MAX_HELD_BYTES (five such frames, where 64 slots
    would let 192 MiB of bodies in); every message is handled once room frees."""
    async def main():
        holding = Holding()
        a, b, conn = await connected(holding)
        total, payload = 12, bytes(LARGE)
        sending = asyncio.gather(*(conn.notify("hold", [i, payload]) for i in range(total)))
        await asyncio.sleep(1.0)
        served = b.connections[a.keys.public]
        fits = MAX_HELD_BYTES // (LARGE + 64)
        assert (holding.running, holding.handled) == (fits, []) and served.budget.held <= MAX_HELD_BYTES
        holding.release.set()
        await asyncio.wait_for(sending, 20)
        await holding.all_handled(total)
        assert sorted(holding.handled) == list(range(total)) and holding.most == fits and served.budget.held == 0
        assert (await served.call("echo", "still open"))["body"] == "still open"
        await a.close()
        await b.close()

    run(main(), 60)


def test_many_peers_flooding_one_node_hold_at_most_its_total_and_the_rest_are_refused():
    """Seven members each send five 3 MiB requests that the node holds: each connection's own budget
    would let 35 in (105 MiB). The node holds what MAX_HELD_TOTAL fits and refuses the rest at once
    with a clear error, rather than waiting (which could wait on a reply one of its handlers needs);
    once its handlers finish, a refused peer is served on the same connection."""
    async def main():
        holding = Holding()
        b, dialers, conns = await members_connected(holding, 7)
        payload = bytes(LARGE)
        calls = [asyncio.ensure_future(conn.call("hold", [10 * i + j, payload]))
                 for i, conn in enumerate(conns) for j in range(5)]
        fits = MAX_HELD_TOTAL // (LARGE + 64)
        for _ in range(200):
            if sum(c.done() for c in calls) == len(calls) - fits:
                break
            await asyncio.sleep(0.05)
        refused = [c for c in calls if c.done()]
        assert len(refused) == len(calls) - fits and holding.running == fits
        assert b.held.held <= MAX_HELD_TOTAL
        for call in refused:
            with pytest.raises(RemoteError, match="overloaded: the node holds"):
                call.result()
        holding.release.set()
        await asyncio.wait_for(asyncio.gather(*(c for c in calls if c not in refused)), 20)
        assert b.held.held == 0 and sorted(holding.handled) == sorted(
            10 * i + j for i in range(7) for j in range(5) if calls[5 * i + j] not in refused)
        unlucky = next(i for i in range(7) if any(calls[5 * i + j] in refused for j in range(5)))
        assert await conns[unlucky].call("hold", [99, b"small"]) is None and 99 in holding.handled
        for d in dialers:
            await d.close()
        await b.close()

    run(main(), 60)


def python_size(value, seen: set[int] | None = None) -> int:
    """The bytes of Python objects `value` is made of, each object once."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    size = sys.getsizeof(value)
    if isinstance(value, list):
        size += sum(python_size(item, seen) for item in value)
    elif isinstance(value, dict):
        size += sum(python_size(k, seen) + python_size(v, seen) for k, v in value.items())
    return size


@pytest.mark.parametrize("body", [
    ["ab"] * 130_000, [2**40 + i for i in range(100_000)], [[]] * 130_000, [[[[]]]] * 50_000,
    [{"k": i} for i in range(50_000)], [{f"key{i}": [1, 2] for i in range(9)}] * 5_000,
    [bytes(3)] * 100_000, [bytes(3 << 20)], [True, None, -1, "x" * 1000, b"y" * 1000] * 1000,
], ids=["short strings", "large ints", "empty arrays", "nested arrays", "small maps", "maps of nine",
        "short bytes", "one large bytes", "mixed"])
def test_a_frame_is_held_at_no_less_than_the_python_it_decodes_into(body):
    """What a connection and its node hold a frame at bounds the Python objects it decoded into, not
    only its bytes (a frame of short strings is 20 times its size in Python); a frame of one large
    byte string costs little more than its bytes."""
    packed = codec.pack(["req", 1, "hold", body])
    value, held = decode_frame(packed)
    assert value == ["req", 1, "hold", body]
    assert python_size(value) <= held <= 129 * len(packed) + 1024


def test_frames_of_many_small_values_are_held_at_what_they_decode_into():
    """Four members each send three requests of 2^17 two-character strings (0.4 MiB each, about 7 MiB
    of Python once decoded), which the node holds. By their bytes all twelve fit every bound (about
    90 MiB of Python); held at what they decode into (16.4 MiB each), three fit the node's total, the
    frames behind a held one wait in their connection, and the requests of the connection that finds
    the total full are refused. The Python the held requests are made of stays within the total, and
    once the handlers finish every request that was not refused is served."""
    async def main():
        bodies: dict[int, list] = {}
        holding = Holding()

        async def keeping(peer, msg_type, body):
            bodies[body[0]] = body
            try:
                await holding(peer, msg_type, body)
            finally:
                del bodies[body[0]]

        b, dialers, conns = await members_connected(keeping, 4)
        strings = ["ab"] * (1 << 17)
        calls = [asyncio.ensure_future(conn.call("hold", [10 * i + j, strings]))
                 for i, conn in enumerate(conns) for j in range(3)]
        for _ in range(200):
            if holding.running == 3 and sum(c.done() for c in calls) == 3:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # nothing more is taken in
        refused = [c for c in calls if c.done()]
        assert holding.running == 3 and len(refused) == 3
        assert sum(python_size(body) for body in bodies.values()) <= b.held.held <= MAX_HELD_TOTAL
        assert all(conn.budget.held <= 1 << 20 for conn in conns)  # what the senders hold of replies
        for call in refused:
            with pytest.raises(RemoteError, match="overloaded: the node holds"):
                call.result()
        holding.release.set()
        await asyncio.wait_for(asyncio.gather(*(c for c in calls if c not in refused)), 30)
        assert b.held.held == 0 and len(holding.handled) == 9
        for d in dialers:
            await d.close()
        await b.close()

    run(main(), 90)


def test_replies_to_a_stream_its_asker_left_are_not_held():
    """The asker reads one reply of many and leaves while the connection waits to queue one more (its
    stream's queue is full): that reply, and every later one, gives its room back."""
    async def main():
        count, part = STREAM_QUEUE + 8, bytes(64 * 1024)

        async def flood(peer, msg_type, body):
            async def replies():
                for i in range(count):
                    yield [i, part]
            return replies()

        a, b, conn = await connected(flood)
        replies = conn.request("flood", None)
        assert (await anext(replies))[0] == 0
        await asyncio.sleep(0.5)  # the queue fills; the connection waits to put the next reply
        assert conn.budget.held > STREAM_QUEUE * len(part)
        await replies.aclose()
        for _ in range(100):
            if conn.budget.held == 0:
                break
            await asyncio.sleep(0.02)
        assert conn.budget.held == 0 and not conn.streams
        await a.close()
        await b.close()

    run(main(), 30)


def test_the_byte_budget_waits_for_room_and_admits_an_oversized_frame_alone():
    async def main():
        budget = ByteBudget(10)
        await budget.take(6)
        waiting = asyncio.ensure_future(budget.take(5))
        await asyncio.sleep(0.01)
        assert not waiting.done() and budget.held == 6
        budget.give(6)
        await asyncio.wait_for(waiting, 1)
        assert budget.held == 5
        oversized = asyncio.ensure_future(budget.take(25))  # larger than the budget: waits for nothing held
        await asyncio.sleep(0.01)
        assert not oversized.done()
        budget.give(5)
        await asyncio.wait_for(oversized, 1)
        assert budget.held == 25

    run(main(), 10)


def test_replies_not_yet_read_hold_at_most_the_byte_budget():
    """A peer answering one request with a stream of 3 MiB replies while the asker reads none: the
    asker's connection takes in what its byte budget holds and leaves the rest in the socket; each
    reply read makes room for the next, and none is lost."""
    async def main():
        count = 12

        async def flood(peer, msg_type, body):
            async def replies():
                for i in range(count):
                    yield [i, bytes(LARGE)]
            return replies()

        a_keys, b_keys = KeySet.generate(), KeySet.generate()
        a = Peering(a_keys, echo_handler, lambda key: key == b_keys.public)
        b = Peering(b_keys, flood, lambda key: key == a_keys.public)
        port = await b.listen("127.0.0.1", 0)
        conn = await a.connect(b_keys.public, f"127.0.0.1:{port}")
        replies = conn.request("flood", None)
        first = await anext(replies)
        await asyncio.sleep(1.0)
        queued = next(iter(conn.streams.values())).qsize()
        assert first[0] == 0 and conn.budget.held <= MAX_HELD_BYTES and queued < count - 1
        rest = [reply[0] async for reply in replies]
        assert rest == list(range(1, count)) and conn.budget.held == 0
        await a.close()
        await b.close()

    run(main(), 60)


def test_a_peer_that_reads_nothing_is_dropped_after_the_write_timeout():
    async def main():
        a_keys, b_keys = KeySet.generate(), KeySet.generate()
        a = Peering(a_keys, echo_handler, lambda key: key == b_keys.public)
        b = Peering(b_keys, echo_handler, lambda key: key == a_keys.public, write_timeout=0.5)
        port = await b.listen("127.0.0.1", 0)
        conn = await a.connect(b_keys.public, f"127.0.0.1:{port}")
        await conn.call("echo", 1)
        conn.writer.transport.pause_reading()  # a stops taking data from its socket
        towards_a = b.connections[a_keys.public]
        with pytest.raises(TransportError, match="took no data for 0.5 s: connection dropped"):
            for _ in range(1000):  # far more than the sockets' buffers hold
                await towards_a.notify("bulk", b"x" * (256 << 10))
        await asyncio.wait_for(towards_a.closed.wait(), 5)
        assert a_keys.public not in b.connections
        await a.close()
        await b.close()

    run(main(), 30)


def test_plain_tcp_and_silent_clients_are_refused():
    async def main():
        _, b = peers()
        port = await b.listen("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 15) == b""
        writer.close()
        # a TLS client whose hello is malformed is dropped
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
        greeting = await read_frame(reader)
        assert greeting[0] == b.keys.public and len(greeting[1]) == 32
        writer.write(struct.pack(">I", 2) + b"\x92\x01")  # a hello of the wrong shape
        await writer.drain()
        assert await read_frame(reader) == ["refused", "malformed frame: not msgpack: ValueError"]
        assert await asyncio.wait_for(reader.read(), 15) == b""
        writer.close()
        assert b.connections == {}
        await b.close()

    run(main(), 30)


def test_a_dial_cancelled_mid_handshake_closes_its_socket():
    async def main():
        gc.collect()  # what earlier tests left to the collector is not this dial's to answer for
        a, b = peers()
        accepted: asyncio.Queue[asyncio.StreamReader] = asyncio.Queue()

        async def silent(reader, writer):  # b's certificate, but no greeting ever
            await accepted.put(reader)
            await asyncio.sleep(30)

        server = await asyncio.start_server(silent, "127.0.0.1", 0, ssl=b.server_ctx)
        port = server.sockets[0].getsockname()[1]
        dial = asyncio.create_task(a.connect(b.keys.public, f"127.0.0.1:{port}"))
        reader = await asyncio.wait_for(accepted.get(), 10)
        await asyncio.sleep(0.1)  # the dial now waits for the greeting
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dial.cancel()
            with pytest.raises(asyncio.CancelledError):
                await dial
            del dial
            assert await asyncio.wait_for(reader.read(), 10) == b""
            gc.collect()
        # closed by the dial itself, not by the collector finding it open
        assert [str(w.message) for w in caught if w.category is ResourceWarning] == []
        assert a.connections == {}
        server.close()
        await a.close()

    run(main(), 30)


def test_a_connection_uvloop_ends_with_a_cancelled_write_closes_without_cancelling_its_closer():
    """uvloop reports a socket operation libuv cancelled (UV_ECANCELED: a write pending when the socket
    went) to the protocol as an asyncio.CancelledError, which the stream raises from wait_closed(),
    drain() and reads. A model node closing its peers on a new assignment died of it (its main task
    ended "cancelled"). Here the protocol is told so, as uvloop tells it: writing gives a connection
    error, closing returns, and the connection and both peers close; a real cancellation of the closer
    still cancels it."""
    async def main():
        a, b, conn = await connected(echo_handler)
        assert (await conn.call("echo", "before"))["body"] == "before"
        conn.writer.transport.get_protocol().connection_lost(asyncio.CancelledError())
        with pytest.raises(ConnectionResetError, match="cancelled socket operation"):
            await conn.notify("echo", "after")
        await conn.close()
        assert conn.closed.is_set()
        await a.close()
        await b.close()

        a, b, conn = await connected(echo_handler)
        closer = asyncio.create_task(conn.close())
        await asyncio.sleep(0)  # it waits for the TLS connection to close
        assert not closer.done()
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closer
        assert conn.closed.is_set()
        await a.close()
        await b.close()

    run(main(), 30)


def test_tls_is_1_3():
    async def main():
        a, b = peers()
        port = await b.listen("127.0.0.1", 0)
        conn = await a.connect(b.keys.public, f"127.0.0.1:{port}")
        assert conn.writer.get_extra_info("ssl_object").version() == "TLSv1.3"
        await a.close()
        await b.close()

    run(main(), 30)
