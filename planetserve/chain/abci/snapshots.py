"""State sync: snapshots of the committed state that a validator makes and serves, and the restore
of one on a node that joins.

Format 1. The snapshot of height H holds every key and value of the state after block H, in key
order, cut into chunks of about `chunk_bytes`. Each entry is `key length (2 bytes) ‖ key ‖ value
length (4 bytes) ‖ value`, big-endian, and no entry straddles two chunks. The snapshot's metadata
(msgpack) lists each chunk's SHA-256, H's block time and the chain id; its hash is the metadata's
SHA-256.

What a joining node trusts is the app hash of H, which CometBFT's light client verified from a
trusted header and hands over in OfferSnapshot. A chunk that does not match its hash in the metadata
is refused and fetched again from another peer, and its sender is rejected. A snapshot whose chunks
match a lying metadata is caught at the end: the restored entries' root is computed before anything
is stored and must equal the trusted app hash, else the snapshot is rejected and nothing is kept.
The block time is not covered by the app hash: it serves CheckTx only, until the node's first block.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import shutil
import sqlite3
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack
from sqlalchemy.exc import DBAPIError
from tendermint.abci import types_pb2 as abci

from planetserve.chain.abci.store import RootMismatch, StateStore
from planetserve.chain.trie import MAX_KEY_LEN, check_key
from planetserve.registry import codec

log = logging.getLogger(__name__)

FORMAT = 1
CHUNK_BYTES = 4 << 20
"""What a chunk holds, about: CometBFT carries a chunk in one message of at most 16 MB."""
MAX_CHUNK_BYTES = 15 << 20
"""The most a chunk may hold, by one entry past `chunk_bytes`; a longer one is refused unread."""
DISK_RESERVE = 1 << 30
"""Free space a restore never uses: past it the snapshot is refused (another, or a later one, may fit)."""
LOAD_BYTES_PER_CHUNK_BYTE = 8
"""What a restore's load writes per byte of chunks, at most about: each entry is stored twice (its row
and its trie leaf) besides the trie's inner nodes, on pages seldom full, in SQLite's WAL and then in
the database file (measured 4 to 8 for states of small entries, 6.5 for this app's users)."""
MAX_CHUNKS = 100_000
"""Chunks per snapshot, CometBFT's own default limit (`max_snapshot_chunks`)."""
MAX_METADATA_BYTES = 64 + MAX_CHUNKS * 35 + 256
_METADATA_LIMITS = codec.Limits(max_objects=2 * MAX_CHUNKS + 16, max_depth=2, max_len=MAX_CHUNKS,
                                max_str=256, max_bin=32)
_HEAD = struct.Struct(">H")
_VALUE_LEN = struct.Struct(">I")
_METADATA = "metadata"


class SnapshotError(ValueError):
    """A snapshot or chunk that is not what it claims."""


@dataclass(frozen=True)
class Metadata:
    """What a snapshot says of itself (see the module docstring)."""

    chunk_hashes: tuple[bytes, ...]
    block_time: int
    chain_id: str

    def encode(self) -> bytes:
        return msgpack.packb([FORMAT, list(self.chunk_hashes), self.block_time, self.chain_id],
                             use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> Metadata:
        if len(data) > MAX_METADATA_BYTES:
            raise SnapshotError(f"metadata of {len(data)} bytes exceeds {MAX_METADATA_BYTES}")
        try:
            fmt, hashes, block_time, chain_id = codec.unpack_bounded(data, _METADATA_LIMITS)
        except (codec.CodecError, ValueError, TypeError) as exc:
            raise SnapshotError(f"undecodable metadata: {exc}") from None
        if fmt != FORMAT or type(block_time) is not int or block_time < 0 or type(chain_id) is not str:
            raise SnapshotError("metadata is not format 1")
        if not isinstance(hashes, list | tuple) or not hashes or not all(
                type(h) is bytes and len(h) == 32 for h in hashes):
            raise SnapshotError("metadata must list one 32-byte hash per chunk")
        return cls(tuple(hashes), block_time, chain_id)


def _driver_error(exc: BaseException) -> BaseException:
    """The database driver's own error under SQLAlchemy's wrapper (its message without the SQL)."""
    return exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc


def _disk_full(exc: BaseException) -> bool:
    """Whether `exc` says that the disk (or the database's size limit) is full: ENOSPC or EDQUOT,
    SQLite's SQLITE_FULL, PostgreSQL's disk_full (53100), bare or wrapped by SQLAlchemy. A restore
    that meets one refuses the snapshot (another may fit) instead of stopping the node."""
    exc = _driver_error(exc)
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, sqlite3.Error):
        return exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_FULL
    return getattr(exc, "sqlstate", None) == "53100"


def encode_entry(key: bytes, value: bytes) -> bytes:
    return _HEAD.pack(len(key)) + key + _VALUE_LEN.pack(len(value)) + value


def decode_chunk(chunk: bytes) -> Iterator[tuple[bytes, bytes]]:
    """The entries of one chunk; SnapshotError for bytes that are not whole entries or hold a key
    the state could not have."""
    pos, end = 0, len(chunk)
    while pos < end:
        if pos + _HEAD.size > end:
            raise SnapshotError("chunk ends inside an entry")
        (klen,) = _HEAD.unpack_from(chunk, pos)
        pos += _HEAD.size
        if klen > MAX_KEY_LEN or pos + klen + _VALUE_LEN.size > end:
            raise SnapshotError("chunk ends inside an entry")
        key = chunk[pos : pos + klen]
        pos += klen
        (vlen,) = _VALUE_LEN.unpack_from(chunk, pos)
        pos += _VALUE_LEN.size
        if pos + vlen > end:
            raise SnapshotError("chunk ends inside an entry")
        try:
            check_key(key)
        except ValueError as exc:
            raise SnapshotError(f"chunk holds an invalid key: {exc}") from None
        yield key, chunk[pos : pos + vlen]
        pos += vlen


class Snapshots:
    """The snapshots this validator makes (every `interval` heights, the last `keep` of them) and
    serves, under `directory`: one folder per height with its chunks and metadata, written under a
    temporary name by a background thread and renamed once whole, so that only whole snapshots are
    ever listed. `interval` 0 makes none; a node can still restore one."""

    def __init__(self, directory: Path, interval: int = 0, keep: int = 2,
                 chunk_bytes: int = CHUNK_BYTES, disk_reserve: int = DISK_RESERVE) -> None:
        if interval < 0 or keep < 1:
            raise ValueError("snapshot interval must be at least 0 and keep at least 1")
        if not 1 << 10 <= chunk_bytes <= MAX_CHUNK_BYTES // 2:
            raise ValueError(f"chunk_bytes must be within 1 KiB..{MAX_CHUNK_BYTES // 2 >> 20} MiB")
        self.directory = directory
        self.interval = interval
        self.keep = keep
        self.chunk_bytes = chunk_bytes
        self.disk_reserve = disk_reserve
        """Free space a restore leaves untouched (DISK_RESERVE)."""
        self._making: threading.Thread | None = None
        self._making_height = 0
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*.partial"):  # a snapshot a stopped process left half written
            shutil.rmtree(stale, ignore_errors=True)
        self._kept = sorted(int(p.name) for p in directory.iterdir()
                            if p.name.isdigit() and (p / _METADATA).is_file())
        """The heights of the whole snapshots kept, oldest first: read from disk once, then replaced
        (never changed in place) by the thread that writes and prunes them, so Commit lists no folder."""

    def heights(self) -> list[int]:
        """The heights of the whole snapshots kept, oldest first."""
        return list(self._kept)

    def oldest_needed(self) -> int | None:
        """The lowest height a kept (or a being made) snapshot stands on: the block store must keep
        it for a joining node's light client and block sync."""
        heights = self.heights()
        if self._making is not None and self._making.is_alive():
            heights.append(self._making_height)
        return min(heights) if heights else None

    def after_commit(self, store: StateStore, height: int, block_time: int, chain_id: str) -> None:
        """Start making the snapshot of `height` when it is due and none is being made. Returns once
        the snapshot's read transaction is open, so that it shows exactly `height`."""
        if not self.interval or height % self.interval or (self._making and self._making.is_alive()):
            return
        opened = threading.Event()
        self._making_height = height
        self._making = threading.Thread(target=self._make, args=(store, height, block_time, chain_id, opened),
                                        name=f"snapshot-{height}", daemon=True)
        self._making.start()
        opened.wait()

    def wait(self) -> None:
        """Until the snapshot being made (if any) is written."""
        if self._making is not None:
            self._making.join()

    def list(self) -> list[abci.Snapshot]:
        out = []
        for height in self.heights():
            metadata = (self.directory / str(height) / _METADATA).read_bytes()
            chunks = len(Metadata.decode(metadata).chunk_hashes)
            out.append(abci.Snapshot(height=height, format=FORMAT, chunks=chunks,
                                     hash=hashlib.sha256(metadata).digest(), metadata=metadata))
        return out

    def load_chunk(self, height: int, fmt: int, index: int) -> bytes:
        """A chunk of a kept snapshot; empty when there is no such chunk (CometBFT's "not found")."""
        path = self.directory / str(height) / f"{index}.chunk"
        if fmt != FORMAT or not path.is_file():
            return b""
        return path.read_bytes()

    def _make(self, store: StateStore, height: int, block_time: int, chain_id: str,
              opened: threading.Event) -> None:
        partial = self.directory / f"{height}.partial"
        try:
            with store.snapshot() as view:
                opened.set()
                if view.height != height:
                    log.warning("snapshot of height %d skipped: the state moved on to %d", height,
                                view.height)
                    return
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir()
                hashes = self._write_chunks(view.entries(), partial)
            (partial / _METADATA).write_bytes(Metadata(tuple(hashes), block_time, chain_id).encode())
            partial.rename(self.directory / str(height))
            log.info("snapshot of height %d written: %d chunks", height, len(hashes))
            kept = sorted([*self._kept, height])
            self._kept = kept[-self.keep:]
            for old in kept[: -self.keep]:
                shutil.rmtree(self.directory / str(old), ignore_errors=True)
        except Exception:
            log.exception("making the snapshot of height %d failed", height)
            shutil.rmtree(partial, ignore_errors=True)
        finally:
            opened.set()

    def _write_chunks(self, entries: Iterator[tuple[bytes, bytes]], folder: Path) -> list[bytes]:
        hashes: list[bytes] = []
        buf = bytearray()

        def flush() -> None:
            (folder / f"{len(hashes)}.chunk").write_bytes(buf)
            hashes.append(hashlib.sha256(buf).digest())
            buf.clear()

        for key, value in entries:
            buf += encode_entry(key, value)
            if len(buf) >= self.chunk_bytes:
                flush()
        if buf or not hashes:
            flush()
        if len(hashes) > MAX_CHUNKS:
            raise SnapshotError(f"{len(hashes)} chunks exceed {MAX_CHUNKS}: raise chunk_bytes")
        return hashes


_CHUNK = abci.ResponseApplySnapshotChunk
Loader = Callable[[Iterator[tuple[bytes, bytes]], bytes], bytes]
"""Stores a restored snapshot's entries if they make the given app hash (else raises RootMismatch)."""


class Restore:
    """One snapshot being restored into an empty store: chunks are checked against the metadata and
    kept on disk in order, never into the last `disk_reserve` bytes of free space (a forged snapshot's
    metadata may promise any number of chunks); after the last, the entries are loaded in one
    transaction that commits only if their root is the trusted app hash. That load writes several
    times the chunks' bytes before the root can be checked, so it starts only if its estimate too
    leaves the reserve free, and a disk that fills all the same refuses the snapshot. Its memory is
    bounded whatever a forged snapshot's values: two chunks at most (the one applied, one read back
    while loading) and what the load holds, which `StateStore.bulk_load` bounds by bytes too."""

    def __init__(self, offer: abci.RequestOfferSnapshot, metadata: Metadata, folder: Path,
                 disk_reserve: int = DISK_RESERVE) -> None:
        self.height = offer.snapshot.height
        self.disk_reserve = disk_reserve
        self.app_hash = offer.app_hash
        self.metadata = metadata
        self.folder = folder
        self.next = 0
        self._held = 0
        """The bytes of the chunks kept."""
        self._last_key = b""
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)

    @property
    def done(self) -> bool:
        return self.next == len(self.metadata.chunk_hashes)

    def apply(self, req: abci.RequestApplySnapshotChunk, load: Loader) -> abci.ResponseApplySnapshotChunk:
        """Check and keep chunk `req.index`; after the last, `load(entries, app_hash)` stores them all
        if they make that app hash, and raises RootMismatch (storing nothing) if not."""
        if req.index < self.next:  # applied already (CometBFT retried it)
            return _CHUNK(result=_CHUNK.ACCEPT)
        if req.index > self.next:
            log.warning("state sync: chunk %d came before chunk %d; restarting the snapshot", req.index,
                        self.next)
            return _CHUNK(result=_CHUNK.RETRY_SNAPSHOT)
        chunk = req.chunk
        expected = self.metadata.chunk_hashes[req.index]
        if len(chunk) > MAX_CHUNK_BYTES or hashlib.sha256(chunk).digest() != expected:
            log.warning("state sync: chunk %d from peer %s does not match the snapshot's hash of it; "
                        "refused, fetching it from another peer", req.index, req.sender or "?")
            return _CHUNK(result=_CHUNK.RETRY, refetch_chunks=[req.index],
                          reject_senders=[req.sender] if req.sender else [])
        try:
            for key, _ in decode_chunk(chunk):
                if key <= self._last_key:
                    raise SnapshotError(f"keys out of order at {key!r}")
                self._last_key = key
        except SnapshotError as exc:  # the chunk is as the metadata says: the snapshot itself is bad
            log.warning("state sync: snapshot of height %d refused: chunk %d: %s", self.height, req.index,
                        exc)
            return _CHUNK(result=_CHUNK.REJECT_SNAPSHOT)
        step = f"chunk {req.index} of {len(self.metadata.chunk_hashes)}"
        if not self._leaves_reserve(len(chunk), f"keeping {step}"):
            return _CHUNK(result=_CHUNK.REJECT_SNAPSHOT)
        try:
            (self.folder / f"{req.index}.chunk").write_bytes(chunk)
        except OSError as exc:
            if not _disk_full(exc):
                raise
            log.error("state sync: snapshot of height %d refused: the disk filled at %s (%s)", self.height,
                      step, exc)
            return _CHUNK(result=_CHUNK.REJECT_SNAPSHOT)
        self.next += 1
        self._held += len(chunk)
        return _CHUNK(result=_CHUNK.ACCEPT) if not self.done else self._load(load)

    def _leaves_reserve(self, writes: int, step: str) -> bool:
        """Whether `writes` more bytes leave `disk_reserve` free on the restore's disk (logged if not)."""
        free = shutil.disk_usage(self.folder).free
        if free - writes >= self.disk_reserve:
            return True
        log.error("state sync: snapshot of height %d refused before %s: it would leave %d MiB free (at "
                  "least %d MiB stay free); free space or pick a later snapshot", self.height, step,
                  (free - writes) >> 20, self.disk_reserve >> 20)
        return False

    def _load(self, load: Loader) -> abci.ResponseApplySnapshotChunk:
        """Load the entries, refusing the snapshot (nothing stored: the load's transaction rolls back)
        if the load could take the disk's reserve, if it fills the disk all the same, or if the root is
        not the trusted app hash."""
        writes = self._held * LOAD_BYTES_PER_CHUNK_BYTE
        if not self._leaves_reserve(writes, f"loading its entries (about {writes >> 20} MiB to write)"):
            return _CHUNK(result=_CHUNK.REJECT_SNAPSHOT)
        try:
            load(self._entries(), self.app_hash)
        except RootMismatch as exc:
            log.warning("state sync: snapshot of height %d refused: %s (the trusted app hash)", self.height,
                        exc)
            return _CHUNK(result=_CHUNK.REJECT_SNAPSHOT)
        except Exception as exc:
            if not _disk_full(exc):
                raise
            log.error("state sync: snapshot of height %d refused: the disk filled while loading its entries "
                      "(%s); nothing of it kept", self.height, _driver_error(exc))
            return _CHUNK(result=_CHUNK.REJECT_SNAPSHOT)
        log.info("state sync: restored height %d (%d chunks), app hash %s", self.height, self.next,
                 self.app_hash.hex())
        return _CHUNK(result=_CHUNK.ACCEPT)

    def _entries(self) -> Iterator[tuple[bytes, bytes]]:
        for index in range(self.next):
            yield from decode_chunk((self.folder / f"{index}.chunk").read_bytes())

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
