"""TLS 1.3 between peers whose identity is an ed25519 key registered on the ledger.

Each peer presents a certificate self-signed with its registered key; the dialler pins it by checking
that the certificate's key is the one the verified list names (no certificate authority is
involved). The dialler then proves its own key by signing the listener's fresh nonce together with
the listener's key, inside the encrypted channel, so a signature made for one listener is useless at
another. The listener answers with its verdict, so a dialler that is not (yet) in the listener's
verified list learns it at once instead of writing into a closed connection; a listener that does not
know a key re-reads the list once before refusing (a peer that registered a moment ago). Frames are
length-prefixed msgpack with a hard size limit and limits on what a frame may decode into
(FRAME_LIMITS: values, nesting, items per container; a frame past them is malformed, which ends
its connection); one connection per peer pair carries many concurrent streams (request id
multiplexing). Memory per connection is bounded both ways: at most
MAX_IN_FLIGHT incoming requests are handled at once, and at most MAX_HELD_BYTES of frames are held
(by handlers, or as replies not yet read); further frames wait in the peer's socket. A frame is held at
its bytes plus VALUE_BYTES for each value it decoded into, so that a frame of many small values counts
as the Python it became. Across all of a node's connections, its handlers hold at most MAX_HELD_TOTAL
of requests and messages: past it, a
request is refused at once ("overloaded") and a message dropped, rather than waited for, since a
reader waiting on room other connections hold could wait on a reply its own handler needs. Writes wait
for the socket to drain, up to WRITE_TIMEOUT, after which the stalled peer is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import hmac
import itertools
import logging
import secrets
import ssl
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

from planetserve.chain.keys import KeySet, verify_signature
from planetserve.registry.codec import CodecError, Limits, unpack_counted

log = logging.getLogger(__name__)

MAX_FRAME = 4 * 1024 * 1024
FRAME_LIMITS = Limits(max_objects=1 << 18, max_depth=8, max_len=1 << 17, max_str=MAX_FRAME, max_bin=MAX_FRAME)
"""What one frame may decode into. Size alone does not bound memory: a 4 MiB frame of empty arrays is
about 256 MiB of Python lists. Honest frames hold a few dozen values (a clove, a cache message: bytes),
a stage request's token ids (at most a model's context) or a streamed chunk's; none nests deeper than
4. A refused frame has built at most these counted values plus one container in progress per level."""
HANDSHAKE_TIMEOUT = 10.0
STREAM_QUEUE = 64
MAX_IN_FLIGHT = 64
"""Requests and messages one connection handles at once; the next frame is read when one ends, so
a peer sending faster than we handle waits on TCP instead of filling our memory."""
VALUE_BYTES = 128
"""What each value a frame decodes into is held at, beside the frame's bytes: at least the Python
object it becomes (a str or bytes of n bytes is 33-49 + n of them, an int 28-36, a list 56 + 8 an item, a
dict up to about 100 a pair), so a held frame of 2^18 two-character strings (0.8 MiB; 15 MiB of Python)
counts as 33 MiB, where its bytes alone let a node hold 80 of them, over a GiB."""
MAX_HELD_BYTES = 4 * MAX_FRAME
"""Bytes of frames one connection holds at once: bodies its handlers are working on, and replies its
streams have not yet read, each with VALUE_BYTES a value. A frame's bytes are counted before its body is
read, so 64 frames of 4 MiB cannot be held at once (four whole frames fit), and its values once it is
decoded, before it is handled or queued."""
MAX_HELD_TOTAL = 16 * MAX_FRAME
"""Bytes of requests and messages one node's handlers hold at once, all its peers together: a few
hundred members each holding MAX_HELD_BYTES would be gigabytes. Honest traffic (cloves, cache-state
messages, prompts) holds a few MiB at most."""
WRITE_TIMEOUT = 60.0
"""A peer that takes none of our bytes for this long is stalled: its connection is dropped."""
HELLO_DOMAIN = b"planetserve/peer-hello/v1"
CROSSED_DIAL_WINDOW = 10.0
"""Two connections to one peer opened this close together were dialled by both sides at once."""
SPARE_CLOSE_DELAY = 5.0
_LENGTH = struct.Struct(">I")


class TransportError(Exception):
    """A peer connection failed: unreachable, wrong identity, refused, malformed or oversized frame."""


class RemoteError(TransportError):
    """The peer answered a request with an error."""


def _certificate(keys: KeySet) -> tuple[bytes, bytes]:
    """A self-signed certificate (PEM) over the identity key, and the key in PKCS#8 PEM."""
    private = Ed25519PrivateKey.from_private_bytes(bytes(keys.identity))
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, keys.public.hex())])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(private, algorithm=None)
    )
    key_pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _context(keys: KeySet, side: int) -> ssl.SSLContext:
    """A TLS 1.3-only context presenting our certificate; peer verification is our own pinning."""
    ctx = ssl.SSLContext(side)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    cert_pem, key_pem = _certificate(keys)
    with tempfile.TemporaryDirectory() as tmp:  # ssl loads key material from files only
        cert_file, key_file = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert_file.write_bytes(cert_pem)
        key_file.touch(mode=0o600)
        key_file.write_bytes(key_pem)
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


def certificate_key(der: bytes | None) -> bytes:
    """The raw ed25519 key of a peer certificate, or TransportError."""
    if not der:
        raise TransportError("peer presented no certificate")
    public = x509.load_der_x509_certificate(der).public_key()
    if not isinstance(public, Ed25519PublicKey):
        raise TransportError("peer certificate key is not ed25519")
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class ByteBudget:
    """Bytes held at once. A connection's one reader takes room for a frame before reading the
    frame's body, waiting while there is none; a node's shared budget is tried, never waited on. A
    frame larger than the whole budget fits only while nothing is held. Handlers and stream readers
    give the room back."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._freed = asyncio.Event()

    def try_take(self, size: int) -> bool:
        if self.held and self.held + size > self.limit:
            return False
        self.held += size
        return True

    async def take(self, size: int) -> None:
        while not self.try_take(size):
            self._freed.clear()
            await self._freed.wait()

    def give(self, size: int) -> None:
        self.held -= size
        self._freed.set()


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME,
                     limits: Limits = FRAME_LIMITS) -> Any:
    """One frame's decoded value; TransportError on a short read, oversize, bad msgpack, or a value
    past `limits`."""
    return decode_frame(await read_body(reader, limit), limits)[0]


async def read_body(reader: asyncio.StreamReader, limit: int = MAX_FRAME, budget: ByteBudget | None = None
                    ) -> bytes:
    """One frame's bytes; TransportError on a short read or oversize. With `budget`, room for the frame
    is taken before its body is read (the caller gives it back once the frame is no longer held)."""
    try:
        header = await reader.readexactly(_LENGTH.size)
        (size,) = _LENGTH.unpack(header)
        if size > limit:
            raise TransportError(f"frame of {size} bytes exceeds the limit of {limit}")
        if budget is not None:
            await budget.take(size)
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise TransportError("connection closed mid-frame" if exc.partial else "connection closed") from exc


def decode_frame(body: bytes, limits: Limits = FRAME_LIMITS) -> tuple[Any, int]:
    """A frame's value and what holding it costs: its bytes, and VALUE_BYTES for each value."""
    try:
        value, values = unpack_counted(body, limits)
        return value, len(body) + VALUE_BYTES * values
    except CodecError as exc:
        raise TransportError(f"malformed frame: {exc}") from exc


@contextlib.contextmanager
def lost_not_cancelled() -> Iterator[None]:
    """A stream's CancelledError that is not this task's own cancellation, as the connection's end
    (ConnectionResetError). uvloop reports a socket operation libuv cancelled (UV_ECANCELED, a write
    still pending when the socket went) to the protocol as an asyncio.CancelledError, which the stream
    then raises from drain(), reads and wait_closed(): a model node closing its peers on a new
    assignment died of it."""
    try:
        yield
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise
        raise ConnectionResetError("the connection ended under a cancelled socket operation") from None


async def write_frame(writer: asyncio.StreamWriter, value: Any, limit: int = MAX_FRAME,
                      timeout: float = WRITE_TIMEOUT) -> None:
    """Write one frame and wait until the socket takes it; a peer that reads nothing for `timeout`
    seconds has its connection aborted (TransportError)."""
    body = msgpack.packb(value, use_bin_type=True)
    if len(body) > limit:
        raise TransportError(f"frame of {len(body)} bytes exceeds the limit of {limit}")
    writer.write(_LENGTH.pack(len(body)) + body)
    transport = writer.transport
    if transport.get_write_buffer_size() <= transport.get_write_buffer_limits()[1]:
        with lost_not_cancelled():
            await writer.drain()  # below the high-water mark drain does not wait: no timer needed
        return
    try:
        with lost_not_cancelled():
            await asyncio.wait_for(writer.drain(), timeout)
    except TimeoutError:
        writer.transport.abort()
        raise TransportError(f"peer took no data for {timeout:g} s: connection dropped") from None


def _hello_message(listener: bytes, nonce: bytes) -> bytes:
    return HELLO_DOMAIN + listener + nonce


# A handler gets (peer key, message type, body) and returns one reply, or an async iterator of
# replies for a streamed answer; None for a one-way message.
Handler = Callable[[bytes, str, Any], Awaitable[Any]]


@dataclass
class Connection:
    """One authenticated connection; requests in both directions are multiplexed by stream id."""

    peer: bytes
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    handler: Handler
    limit: int = MAX_FRAME
    outbound: bool = False
    write_timeout: float = WRITE_TIMEOUT
    created: float = field(default_factory=time.monotonic)
    streams: dict[int, asyncio.Queue] = field(default_factory=dict)
    ids: Any = field(default_factory=lambda: itertools.count(1))
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: set[asyncio.Task] = field(default_factory=set)
    slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(MAX_IN_FLIGHT))
    budget: ByteBudget = field(default_factory=lambda: ByteBudget(MAX_HELD_BYTES))
    shared: ByteBudget | None = None
    """The node's budget for requests and messages across its connections (Peering.held)."""

    async def send(self, frame: list) -> None:
        if self.closed.is_set():
            raise TransportError("connection closed")
        async with self.lock:
            await write_frame(self.writer, frame, self.limit, self.write_timeout)

    async def notify(self, msg_type: str, body: Any) -> None:
        """A one-way message."""
        await self.send(["msg", 0, msg_type, body])

    async def request(self, msg_type: str, body: Any) -> AsyncIterator[Any]:
        """Send a request and yield its replies until the peer ends the stream."""
        stream = next(self.ids)
        queue: asyncio.Queue = asyncio.Queue(STREAM_QUEUE)
        self.streams[stream] = queue
        try:
            await self.send(["req", stream, msg_type, body])
            while True:
                kind, payload, size = await queue.get()
                self.budget.give(size)
                if kind == "rep":
                    yield payload
                elif kind == "end":
                    return
                else:
                    raise RemoteError(str(payload))
        finally:
            self.streams.pop(stream, None)
            while not queue.empty():
                self.budget.give(queue.get_nowait()[2])

    async def call(self, msg_type: str, body: Any) -> Any:
        """A request with exactly one reply; a second one ends it at once (a peer cannot make us
        collect an endless stream)."""
        got: list[Any] = []
        async with contextlib.aclosing(self.request(msg_type, body)) as replies:
            async for reply in replies:
                got.append(reply)
                if len(got) > 1:
                    raise TransportError(f"expected one reply to {msg_type}, got more")
        if not got:
            raise TransportError(f"expected one reply to {msg_type}, got none")
        return got[0]

    async def run(self) -> None:
        """Read frames until the connection ends; fail every open stream then."""
        try:
            while True:
                with lost_not_cancelled():
                    body = await read_body(self.reader, self.limit, self.budget)
                frame, size = decode_frame(body)
                if not (isinstance(frame, list) and len(frame) == 4 and isinstance(frame[0], str)
                        and isinstance(frame[1], int) and isinstance(frame[2], str)):
                    raise TransportError("malformed frame: not [kind, stream, type, body]")
                # its bytes were held before they were read; now what they decoded into is: a frame
                # larger than the whole budget is held while nothing else is, as when it was read
                self.budget.give(len(body))
                await self.budget.take(size)
                await self._dispatch(*frame, size)
        except (TransportError, ConnectionError, ssl.SSLError) as exc:
            log.debug("connection to %s ended: %s", self.peer.hex()[:16], exc)
        finally:
            self.closed.set()
            for queue in self.streams.values():
                with contextlib.suppress(asyncio.QueueFull):
                    queue.put_nowait(("err", "connection closed", 0))
            for task in self.tasks:
                task.cancel()
            self.writer.close()

    async def _dispatch(self, kind: str, stream: int, msg_type: str, body: Any, size: int) -> None:
        if kind in ("rep", "end", "err"):
            queue = self.streams.get(stream)
            if queue is None:
                self.budget.give(size)
                return
            await queue.put((kind, body, size))  # a slow consumer slows this connection: backpressure
            if self.streams.get(stream) is not queue:  # the stream ended while this waited: none will read it
                self.budget.give(size)
        elif kind in ("msg", "req"):
            await self.slots.acquire()
            if self.shared is None or self.shared.try_take(size):
                task = asyncio.create_task(self._serve(kind, stream, msg_type, body))
            else:
                self.budget.give(size)
                size = 0
                task = asyncio.create_task(self._refuse(kind, stream, msg_type, self.shared.held))
            self.tasks.add(task)
            task.add_done_callback(functools.partial(self._done, size))
        else:
            self.budget.give(size)
            raise TransportError(f"unknown frame kind {kind!r}")

    def _done(self, size: int, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.slots.release()
        self.budget.give(size)
        if self.shared is not None:
            self.shared.give(size)

    async def _refuse(self, kind: str, stream: int, msg_type: str, held: int) -> None:
        reason = f"overloaded: the node holds {held} bytes of its peers' requests"
        log.info("peer %s: %s refused, %s", self.peer.hex()[:16], msg_type, reason)
        if kind == "req":
            with contextlib.suppress(TransportError, ConnectionError):
                await self.send(["err", stream, msg_type, reason])

    async def _serve(self, kind: str, stream: int, msg_type: str, body: Any) -> None:
        try:
            result = await self.handler(self.peer, msg_type, body)
            if kind == "msg":
                return
            if hasattr(result, "__aiter__"):
                async for reply in result:
                    await self.send(["rep", stream, msg_type, reply])
            else:
                await self.send(["rep", stream, msg_type, result])
            await self.send(["end", stream, msg_type, None])
        except TransportError:
            return
        except Exception as exc:
            log.info("peer %s: %s failed: %s", self.peer.hex()[:16], msg_type, exc)
            if kind == "req":
                with contextlib.suppress(TransportError, ConnectionError):
                    await self.send(["err", stream, msg_type, str(exc) or type(exc).__name__])

    async def close(self) -> None:
        self.writer.close()
        try:
            with contextlib.suppress(Exception), lost_not_cancelled():
                await self.writer.wait_closed()
        finally:
            self.closed.set()


class Peering:
    """Our side of the peer network: a listener and a pool of outgoing connections, both limited to
    the keys `authorize` accepts (the verified list's members). `on_close` hears of each peer whose
    connection ended without being replaced (relays tear down the paths it carried); `knock` hears of a
    key whose hello verified but that `authorize` refused, before it is asked again (the lists may be
    older than the key's registration)."""

    def __init__(self, keys: KeySet, handler: Handler, authorize: Callable[[bytes], bool],
                 limit: int = MAX_FRAME, on_close: Callable[[bytes], None] | None = None,
                 knock: Callable[[bytes], Awaitable[None]] | None = None,
                 write_timeout: float = WRITE_TIMEOUT) -> None:
        self.keys = keys
        self.handler = handler
        self.authorize = authorize
        self.limit = limit
        self.write_timeout = write_timeout
        self.held = ByteBudget(MAX_HELD_TOTAL)
        self.on_close = on_close
        self.knock = knock
        self.server_ctx = _context(keys, ssl.PROTOCOL_TLS_SERVER)
        self.client_ctx = _context(keys, ssl.PROTOCOL_TLS_CLIENT)
        self.connections: dict[bytes, Connection] = {}
        self.server: asyncio.Server | None = None
        self.runners: set[asyncio.Task] = set()
        self._dials: dict[bytes, asyncio.Task[Connection]] = {}
        self.stopped = False
        """Set by `close`: no connection is dialled or adopted after it, so a handshake that was under
        way, or a task of the node still pinging its peers, cannot leave a connection serving through a
        handler whose node has stopped."""

    async def listen(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._accept, host, port, ssl=self.server_ctx,
                                                 ssl_handshake_timeout=HANDSHAKE_TIMEOUT)
        return self.server.sockets[0].getsockname()[1]

    def _preferred(self, conn: Connection) -> bool:
        """Of two connections dialled at once by both sides, both keep the one the smaller key dialled."""
        return conn.outbound == (self.keys.public < conn.peer)

    def _adopt(self, conn: Connection) -> Connection:
        """Start reading `conn` and make it the peer's connection, unless it crossed a live one that
        both sides agree to keep; the spare is closed once frames already sent on it are through."""
        if self.stopped:
            conn.writer.close()
            raise TransportError("this node's peer transport is closed")
        old = self.connections.get(conn.peer)
        task = asyncio.create_task(conn.run())
        self.runners.add(task)
        task.add_done_callback(self.runners.discard)
        task.add_done_callback(lambda _t: self._forget(conn))
        if old is None or old is conn or old.closed.is_set():
            self.connections[conn.peer] = conn
            return conn
        crossed = conn.created - old.created < CROSSED_DIAL_WINDOW
        current, spare = (old, conn) if crossed and not self._preferred(conn) else (conn, old)
        self.connections[conn.peer] = current
        task.get_loop().call_later(SPARE_CLOSE_DELAY, lambda: asyncio.ensure_future(spare.close()))
        return current

    def _forget(self, conn: Connection) -> None:
        if self.connections.get(conn.peer) is conn:
            del self.connections[conn.peer]
            if self.on_close is not None:
                self.on_close(conn.peer)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            nonce = secrets.token_bytes(32)
            await write_frame(writer, [self.keys.public, nonce], self.limit, HANDSHAKE_TIMEOUT)
            hello = await asyncio.wait_for(read_frame(reader, 1024), HANDSHAKE_TIMEOUT)
            if not (isinstance(hello, list) and len(hello) == 2 and all(type(v) is bytes for v in hello)):
                raise TransportError("malformed hello")
            peer, signature = hello
            if not verify_signature(peer, _hello_message(self.keys.public, nonce), signature):
                raise TransportError("hello signature does not verify")
            if not self.authorize(peer) and self.knock is not None:
                await self.knock(peer)
            if not self.authorize(peer):
                raise TransportError(f"peer {peer.hex()[:16]} is not in the verified list")
            await write_frame(writer, ["ok"], self.limit, HANDSHAKE_TIMEOUT)
        except (TransportError, TimeoutError, ConnectionError, ssl.SSLError) as exc:
            log.info("refused a peer connection: %s", exc)
            with contextlib.suppress(Exception):
                await write_frame(writer, ["refused", str(exc)[:200]], self.limit, HANDSHAKE_TIMEOUT)
            writer.close()
            return
        except BaseException:  # cancelled mid-handshake (the transport is closing)
            writer.close()
            raise
        with contextlib.suppress(TransportError):  # closed while the handshake ran
            self._adopt(Connection(peer, reader, writer, self.handler, self.limit, outbound=False,
                                   write_timeout=self.write_timeout, shared=self.held))

    async def connect(self, peer: bytes, address: str) -> Connection:
        """The live connection to `peer`, dialling `address` (host:port) if there is none."""
        if self.stopped:
            raise TransportError("this node's peer transport is closed")
        conn = self.connections.get(peer)
        if conn is not None and not conn.closed.is_set():
            return conn
        dial = self._dials.get(peer)
        if dial is None:
            dial = asyncio.create_task(self._dial_and_adopt(peer, address))
            self._dials[peer] = dial
            self.runners.add(dial)
            dial.add_done_callback(lambda done: self._dialled(peer, done))
        try:
            return await asyncio.shield(dial)
        except asyncio.CancelledError:
            if dial.cancelled() and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise TransportError("this node's peer transport closed while dialling") from None
            raise

    async def _dial_and_adopt(self, peer: bytes, address: str) -> Connection:
        return self._adopt(await self._dial(peer, address))

    def _dialled(self, peer: bytes, dial: asyncio.Task[Connection]) -> None:
        """Every caller that asked for `peer` while `dial` ran shares its outcome, and it runs to its
        end whoever of them gives up waiting: a peer whose address accepts and never answers would
        otherwise hold each of them for a handshake of its own, one after the other (a model node's
        answer naming one proxy sixteen times waited 160 s a part)."""
        self.runners.discard(dial)
        if self._dials.get(peer) is dial:
            del self._dials[peer]
        if not dial.cancelled():
            dial.exception()  # retrieved here when every caller stopped waiting

    async def notify(self, peer: bytes, address: str, msg_type: str, body: Any) -> None:
        """A one-way message to `peer`, over its live connection or a new one to `address`."""
        conn = await self.connect(peer, address)
        await conn.notify(msg_type, body)

    async def _dial(self, peer: bytes, address: str) -> Connection:
        if not self.authorize(peer):
            raise TransportError(f"peer {peer.hex()[:16]} is not in the verified list")
        host, _, port = address.rpartition(":")
        try:  # not wait_for, which on Python 3.11 can swallow a cancellation arriving with the connection
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                reader, writer = await asyncio.open_connection(host, int(port), ssl=self.client_ctx,
                                                               server_hostname=None)
        except (OSError, ValueError, TimeoutError, ssl.SSLError) as exc:
            raise TransportError(f"cannot reach {address}: {exc}") from exc
        try:
            presented = certificate_key(writer.get_extra_info("ssl_object").getpeercert(binary_form=True))
            if not hmac.compare_digest(presented, peer):
                raise TransportError(f"{address} presented key {presented.hex()[:16]}, "
                                     f"expected {peer.hex()[:16]}")
            greeting = await asyncio.wait_for(read_frame(reader, 1024), HANDSHAKE_TIMEOUT)
            if not (isinstance(greeting, list) and len(greeting) == 2
                    and greeting[0] == peer and type(greeting[1]) is bytes):
                raise TransportError("malformed greeting")
            signature = self.keys.sign(_hello_message(peer, greeting[1]))
            await write_frame(writer, [self.keys.public, signature], self.limit, HANDSHAKE_TIMEOUT)
            verdict = await asyncio.wait_for(read_frame(reader, 1024), HANDSHAKE_TIMEOUT)
            if verdict != ["ok"]:
                reason = verdict[1] if isinstance(verdict, list) and len(verdict) == 2 else "no reason given"
                raise TransportError(f"refused: {reason}")
        except (TransportError, TimeoutError, ConnectionError, ssl.SSLError, ValueError) as exc:
            writer.close()
            raise TransportError(f"handshake with {address} failed: {exc}") from exc
        except BaseException:  # cancelled mid-handshake: the socket must not wait for the collector
            writer.close()
            raise
        return Connection(peer, reader, writer, self.handler, self.limit, outbound=True,
                          write_timeout=self.write_timeout, shared=self.held)

    async def close(self) -> None:
        self.stopped = True
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections.values()):
            await conn.close()
        for task in list(self.runners):
            task.cancel()
        if self.server is not None:
            with contextlib.suppress(Exception):
                await self.server.wait_closed()
