"""ABCI 2.0 socket server: unsigned-varint length-prefixed protobuf over the four connections
CometBFT opens (consensus, mempool, query, snapshot), on TCP or on a Unix socket in a directory that
only the validator's user may enter (`address.py`: whoever connects drives the app).

Requests on one connection are answered strictly in order; a Flush request is answered once every
earlier response has been written out. The application is synchronous and the event loop runs one
request at a time, so the consensus, mempool and snapshot connections never interleave inside the
application. Queries are the exception: each is answered on a worker thread (at most QUERY_WORKERS at
once) from the committed state, through a database snapshot of its own (`Application.query`), while
the event loop goes on executing blocks; the connection that sent it reads nothing more until it is
answered, so a flood of queries queues in CometBFT, not here, and cannot hold up FinalizeBlock or
Commit (docs/threat-model.md, "Sends heavy ABCI queries").
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from google.protobuf.message import DecodeError
from tendermint.abci import types_pb2 as abci

from planetserve.chain.abci.address import AbciAddress, AbciAddressError, TcpAddress, UnixAddress, listening
from planetserve.chain.abci.app import Application
from planetserve.chain.varint import encode_uvarint

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 128 << 20
OUTPUT_BUFFER = 1 << 20
QUERY_WORKERS = 2
"""Queries answered at once, each on its own thread; more wait for one to finish."""


def tune_gc() -> None:
    """Garbage-collector settings for the app process, once its state is open. The app allocates
    many short-lived objects per transaction and per commit and keeps few cycles: collect less
    often, and never rescan what start-up loaded (a full collection walking every module and
    library object would otherwise cost tens of milliseconds, more often the larger a block)."""
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


class FramingError(Exception):
    """The peer sent bytes that are not a valid length-prefixed message."""



def parse_uvarint(data: bytes | bytearray, pos: int) -> tuple[int, int] | None:
    """(value, position after it) of the varint at `pos`, or None if `data` ends inside it."""
    result = 0
    for shift in range(0, 70, 7):
        if pos >= len(data):
            return None
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
    raise FramingError("varint longer than 10 bytes")


class FrameReader:
    """Length-prefixed requests from a stream, read in large chunks rather than byte by byte."""

    CHUNK = 1 << 16

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._buf = bytearray()
        self._pos = 0

    async def _fill(self) -> None:
        chunk = await self._reader.read(self.CHUNK)
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(self._buf[self._pos :]), None)
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += chunk

    async def next(self) -> abci.Request:
        while (head := parse_uvarint(self._buf, self._pos)) is None:
            await self._fill()
        size, start = head
        if size > MAX_MESSAGE_BYTES:
            raise FramingError(f"message of {size} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
        while len(self._buf) - start < size:
            before = start - self._pos
            await self._fill()
            start = self._pos + before
        request = abci.Request()
        try:
            request.ParseFromString(bytes(self._buf[start : start + size]))
        except DecodeError as exc:
            raise FramingError(f"undecodable request: {exc}") from exc
        self._pos = start + size
        return request


def frame(response: abci.Response) -> bytes:
    body = response.SerializeToString()
    return encode_uvarint(len(body)) + body


class AbciServer:
    """Dispatches requests to the application. An exception in a consensus method stops the
    server: answering with made-up state would fork the chain, stopping lets CometBFT replay."""

    CONSENSUS = frozenset({"init_chain", "prepare_proposal", "process_proposal", "finalize_block", "commit"})

    def __init__(self, app: Application, query_workers: int = QUERY_WORKERS) -> None:
        self.app = app
        self.query_workers = query_workers
        self._queries: ThreadPoolExecutor | None = None
        self._handlers: dict[str, Callable] = {
            "info": app.info,
            "init_chain": app.init_chain,
            "check_tx": app.check_tx,
            "prepare_proposal": app.prepare_proposal,
            "process_proposal": app.process_proposal,
            "finalize_block": app.finalize_block,
            "commit": app.commit,
            "query": app.query,
            "list_snapshots": app.list_snapshots,
            "offer_snapshot": app.offer_snapshot,
            "load_snapshot_chunk": app.load_snapshot_chunk,
            "apply_snapshot_chunk": app.apply_snapshot_chunk,
            "extend_vote": lambda _r: abci.ResponseExtendVote(),
            "verify_vote_extension": lambda _r: abci.ResponseVerifyVoteExtension(
                status=abci.ResponseVerifyVoteExtension.ACCEPT
            ),
        }
        self.fatal: BaseException | None = None
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None

    def respond(self, request: abci.Request) -> abci.Response:
        kind = request.WhichOneof("value")
        if kind == "echo":
            return abci.Response(echo=abci.ResponseEcho(message=request.echo.message))
        if kind == "flush":
            return abci.Response(flush=abci.ResponseFlush())
        handler = self._handlers.get(kind or "")
        if handler is None:
            return abci.Response(exception=abci.ResponseException(error=f"unknown request {kind!r}"))
        result = handler(getattr(request, kind))
        return abci.Response(**{kind: result})

    def _answer_query(self, request: abci.Request) -> bytes:
        """A query's framed response, on a worker thread (serialising a large answer there too)."""
        try:
            response = self.respond(request)
        except Exception as exc:
            log.exception("error answering query")
            response = abci.Response(exception=abci.ResponseException(error=str(exc)))
        return frame(response)

    async def _query(self, request: abci.Request) -> bytes:
        """Answered by one of `query_workers` threads; beyond that many, queries wait their turn
        (at most one per connection, since a connection is read no further until answered)."""
        if self._queries is None:
            self._queries = ThreadPoolExecutor(self.query_workers, thread_name_prefix="abci-query")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._queries, self._answer_query, request)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer requests in order, collecting responses until a Flush (or OUTPUT_BUFFER bytes):
        one write per batch instead of one system call per response. A query is awaited on a worker
        thread, so other connections' requests run meanwhile."""
        peer = writer.get_extra_info("peername")
        output = bytearray()
        frames = FrameReader(reader)
        try:
            while True:
                request = await frames.next()
                kind = request.WhichOneof("value")
                if kind == "query":
                    output += await self._query(request)
                    if len(output) >= OUTPUT_BUFFER:
                        writer.write(output)
                        output = bytearray()
                        await writer.drain()
                    continue
                try:
                    response = self.respond(request)
                except Exception as exc:
                    if kind in self.CONSENSUS:
                        log.exception("fatal error in %s; stopping", kind)
                        self.fatal = exc
                        self.stop()
                        return
                    log.exception("error answering %s", kind)
                    response = abci.Response(exception=abci.ResponseException(error=str(exc)))
                output += frame(response)
                if kind == "flush" or len(output) >= OUTPUT_BUFFER:
                    writer.write(output)
                    output = bytearray()
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            log.debug("connection from %s closed", peer)
        except FramingError as exc:
            log.warning("dropping connection from %s: %s", peer, exc)
        finally:
            writer.close()

    async def serve(self, address: AbciAddress, handle_signals: bool = True,
                    ready: Callable[[AbciAddress], None] | None = None) -> None:
        """Serve at `address` until SIGTERM/SIGINT (when handled here), `stop()`, or a fatal error.
        `ready(bound)` is called once listening (a TCP port 0 picks a free one, which `bound` names)."""
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._server, bound = await self._listen(address)
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._stopped.set)
        log.info("ABCI server listening on %s", bound)
        if ready is not None:
            ready(bound)
        try:
            async with self._server:
                await self._stopped.wait()
        finally:
            if self._queries is not None:
                self._queries.shutdown(wait=False, cancel_futures=True)
        if self.fatal is not None:
            raise SystemExit(f"stopped after a fatal error: {self.fatal}")

    async def _listen(self, address: AbciAddress) -> tuple[asyncio.Server, AbciAddress]:
        """The server listening at `address`, and the address it is bound to. A socket file is made
        0600 as well, for systems that check a socket's own mode; its directory is what keeps others out."""
        if isinstance(address, TcpAddress):
            server = await asyncio.start_server(self._serve_connection, address.host, address.port)
            return server, TcpAddress(address.host, server.sockets[0].getsockname()[1])
        prepare_socket(address.path)
        server = await asyncio.start_unix_server(self._serve_connection, str(address.path))
        address.path.chmod(0o600)
        return server, address

    def stop(self) -> None:
        """Stop serving; safe to call from any thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)


def prepare_socket(path: Path) -> None:
    """Make `path` ready for the app's socket. Its directory is created 0700 if missing, and must be
    this user's and closed to group and others: whoever can enter it can connect, and drive the app.
    A socket file left by an earlier run is removed; a socket something still accepts on is another
    app's, and a file that is no socket is not ours to delete: both are refused."""
    directory = path.parent
    try:
        directory.mkdir(mode=0o700)
        directory.chmod(0o700)  # mkdir's mode passes through the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise AbciAddressError(f"cannot create the socket directory {directory}: {exc.strerror}") from exc
    st = directory.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise AbciAddressError(f"{directory} is not a directory: the socket {path} needs one")
    if st.st_uid != os.geteuid():
        raise AbciAddressError(f"the socket directory {directory} is owned by uid {st.st_uid}, not by "
                               f"this user (uid {os.geteuid()}): its owner could reach the app; use a "
                               "directory of your own")
    if st.st_mode & 0o077:
        raise AbciAddressError(f"the socket directory {directory} has mode {stat.S_IMODE(st.st_mode):04o}: "
                               f"group and others could reach the app; run `chmod 700 {directory}`")
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise AbciAddressError(f"{path} exists and is not a socket: remove it, or listen elsewhere")
    if listening(UnixAddress(path)):
        raise AbciAddressError(f"something already serves at {path}: is this validator's app running "
                               "already?")
    path.unlink()
