"""The state store: the ledger's key/value state, its Merkle commitment (the app hash) and proofs.

SQLAlchemy Core over SQLite (the default: `sqlite:///path`, WAL) or PostgreSQL
(`postgresql+psycopg://…`; `postgresql://…` and `postgres://…` are mapped to psycopg).

Tables
    state_nodes  id -> body, child ids: every trie node ever committed (a pruning store: of the
                 retained heights). Ids are handed out in commit order, so a block's new nodes
                 are appended (a hash-keyed table would put each new node on a random B-tree
                 page); a parent row holds its children's ids, and its body (the hash
                 pre-image) their hashes. Leaf bodies carry their value,
                 so the state at any earlier committed height stays provable.
    state_kv     key -> value, the latest committed state (bytewise key order on both databases)
    state_meta   name -> bytes: the committed height and app hash (names starting with "_"),
                 plus the application's own named blobs, written in the same transaction
    state_roots  height -> app hash and root node id of every retained committed height
    state_orphans  height -> the ids of the nodes that height's commit replaced (packed, 8 bytes
                 each, ascending): they belong to earlier heights only, so once every height
                 before it is pruned they can be deleted

Writes go to a `Batch` (a buffer over the committed state); `StateStore.commit` applies one batch
in one database transaction: new trie nodes, kv rows, meta and the root of the new height. The work
of a commit is proportional to the number of keys the batch changes times the depth of the trie:
only the nodes on the changed paths are read (one query per trie level, through a bounded cache of
inner nodes), and only new nodes are written; old nodes are never rewritten.

Reads of committed values go through a bounded cache (`value_cache_bytes`) of values and absences by
key: a block's transactions read what their CheckTx read a moment before. A commit writes its changes
through it and a bulk load empties it, so it is always exactly the committed state.

Pruning (`keep_heights`): by default every committed height stays provable, and the node table
grows with every block. With `keep_heights=K` each commit makes heights older than the last K
unprovable and deletes the nodes only they used (those in orphan rows of heights up to the
earliest retained one), in the commit's own transaction; at most `PRUNE_MAX_IDS` nodes per commit,
so a backlog (pruning turned on for a long-running store) drains over the following blocks. The
app hash does not depend on it: validators may keep different numbers of heights.
Nothing here depends on wall-clock time, dict order or the database engine: the app hash is a
function of the key/value set alone.

One process owns a store; its methods are thread-safe (one lock). Readers on other threads (the ABCI
query connection's workers) use `StateStore.snapshot()`: a read transaction on a connection of its
own, which neither takes that lock for its reads nor sees part of a commit.

SQLite durability: WAL with synchronous=NORMAL. A transaction is in the WAL when commit() returns,
so a killed process (SIGKILL) loses nothing; an operating-system crash or power cut may lose the
last commits, which CometBFT replays from its block store at the next handshake. Pass
`sqlite_synchronous="FULL"` to fsync every commit as well. Checkpoints (copying the WAL into the
database file) run in a background thread, not inside commit(). `sqlite_max_pages` caps the
database's size (PRAGMA max_page_count; 0: SQLite's own cap): past it a write fails as on a full disk.
"""

from __future__ import annotations

import itertools
import logging
import sqlite3
import struct
import threading
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    create_engine,
    event,
    func,
    insert,
    select,
)
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from planetserve.chain.trie import (
    CHILD_LEN,
    EMPTY_ROOT,
    MAX_KEY_LEN,
    NewNode,
    NodeRecord,
    PrefixProof,
    TrieBuilder,
    Update,
    apply_changes,
    check_key,
    check_prefix,
    collect_leaves,
    make_prefix_proof,
)

__all__ = [
    "Batch",
    "Snapshot",
    "StaleBatchError",
    "StateStore",
    "StoreError",
    "TooManyEntriesError",
    "masked_url",
    "normalise_url",
]

SCHEMA_VERSION = b"3"
DEFAULT_MAX_ENTRIES = 10_000
MIN_KEEP_HEIGHTS = 2
"""Clients verify the state one height before the latest header, so at least two are kept."""
BULK_LOAD_ENTRIES = 20_000
"""Entries bulk_load holds before it writes them (one executemany for many rows)."""
BULK_LOAD_BYTES = 64 << 20
"""Bytes bulk_load holds before it writes them, each entry's key and value counted twice (its row,
and its trie leaf until written). State sync loads a snapshot before its root can be compared with
the trusted app hash, and a forged snapshot's values may each be as large as a chunk (15 MiB): a
bound by entries alone would let it make a joining node hold gigabytes. With both bounds the load
holds about this much plus one entry whatever the entries' sizes (the rest it holds, inner trie
nodes and per-entry overhead, grows with the entries, not with their bytes)."""
PRUNE_MAX_IDS = 100_000
"""Most nodes one commit deletes, unless one height alone has more (about 0.3 s of SQLite deletes
at 3 µs each)."""
_HEIGHT = "_height"
_APP_HASH = "_app_hash"
_SCHEMA = "_schema"
_BASE = "_base"
"""The height a store was bulk-loaded at (a node that joined by state sync): nothing before it exists."""
_MAX_META_NAME = 200
_IN_CHUNK = 500  # hashes per `IN (...)` query
_SCAN_PAGE = 256  # rows per page when iterating
_SQLITE_SYNC = ("OFF", "NORMAL", "FULL", "EXTRA")

_SQL_INS_NODES = "INSERT INTO state_nodes (id, body, kids) VALUES (?, ?, ?)"
_SQL_UPSERT_KV = (
    'INSERT INTO state_kv ("key", "value") VALUES (?, ?) '
    'ON CONFLICT ("key") DO UPDATE SET "value" = excluded."value"'
)
_SQL_DEL_KV = 'DELETE FROM state_kv WHERE "key" = ?'
_SQL_INS_KV = 'INSERT INTO state_kv ("key", "value") VALUES (?, ?)'
_SQL_GET = 'SELECT "value" FROM state_kv WHERE "key" = ?'
_SQL_GET_KV = 'SELECT "key", "value" FROM state_kv WHERE "key" = ?'
_SQL_SCAN_FIRST = 'SELECT "key", "value" FROM state_kv WHERE "key" >= ? AND "key" < ? ORDER BY "key" LIMIT ?'
_SQL_SCAN_NEXT = 'SELECT "key", "value" FROM state_kv WHERE "key" > ? AND "key" < ? ORDER BY "key" LIMIT ?'
_SQL_NODES = "SELECT id, body, kids FROM state_nodes WHERE id "
_SQL_DEL_NODE = "DELETE FROM state_nodes WHERE id = ?"

log = logging.getLogger(__name__)

# INTEGER PRIMARY KEY makes the id SQLite's rowid (no separate index; appends stay sequential).
_ID = BigInteger().with_variant(Integer, "sqlite")

_md = MetaData()
nodes_table = Table(
    "state_nodes",
    _md,
    Column("id", _ID, primary_key=True, autoincrement=False),
    Column("body", LargeBinary, nullable=False),
    Column("kids", LargeBinary, nullable=True),  # the children's ids, 8 bytes each; NULL for a leaf
)
kv_table = Table(
    "state_kv",
    _md,
    Column("key", LargeBinary(MAX_KEY_LEN), primary_key=True),
    Column("value", LargeBinary, nullable=False),
    sqlite_with_rowid=False,
)
meta_table = Table(
    "state_meta",
    _md,
    Column("name", String(_MAX_META_NAME), primary_key=True),
    Column("value", LargeBinary, nullable=False),
)
roots_table = Table(
    "state_roots",
    _md,
    Column("height", _ID, primary_key=True, autoincrement=False),
    Column("app_hash", LargeBinary(32), nullable=False),
    Column("root_id", BigInteger, nullable=True),
)
orphans_table = Table(
    "state_orphans",
    _md,
    Column("height", _ID, primary_key=True, autoincrement=False),
    Column("ids", LargeBinary, nullable=False),
)


def check_keep_heights(value: object) -> int:
    """`value` as a pruning setting: 0 (keep every height) or at least MIN_KEEP_HEIGHTS."""
    if type(value) is not int or value < 0 or 0 < value < MIN_KEEP_HEIGHTS:
        raise ValueError(
            f"must be 0 (keep every height) or at least {MIN_KEEP_HEIGHTS} (clients verify the state "
            f"one height before the latest), got {value!r}"
        )
    return value


class StoreError(Exception):
    """The store cannot do what was asked (wrong height, corrupt database, misuse)."""


class RootMismatch(StoreError):
    """bulk_load's entries make another root than the one expected: nothing was stored."""


class StaleBatchError(StoreError):
    """The batch was made before the latest commit (or was itself committed); make a new one."""


class TooManyEntriesError(StoreError, ValueError):
    """A prefix query matches more entries than the caller allows."""


def masked_url(url: str) -> str:
    """A database URL as it may be shown: its password replaced by ***, and one that does not parse
    (a port that is no number, say) by its scheme alone, since it may hold a password."""
    if "://" not in url:
        return url
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return f"{url.partition('://')[0]}://… (not a URL that parses)"


def carries_password(url: str) -> bool:
    """Whether a database URL holds a password (one that does not parse may, and counts as holding one)."""
    if "://" not in url:
        return False
    try:
        return make_url(url).password is not None
    except (ArgumentError, ValueError):
        return True


def normalise_url(url: str) -> URL:
    """A SQLAlchemy URL for SQLite or PostgreSQL (psycopg); a bare path means a SQLite file."""
    if "://" not in url:
        return URL.create("sqlite", database=str(Path(url)))
    u = make_url(url)
    backend = u.get_backend_name()
    if backend in ("postgresql", "postgres"):
        if "+" in u.drivername and u.drivername.split("+", 1)[1] != "psycopg":
            raise ValueError(f"unsupported PostgreSQL driver {u.drivername!r}: use postgresql+psycopg")
        return u.set(drivername="postgresql+psycopg")
    if backend == "sqlite":
        if "+" in u.drivername and u.drivername != "sqlite+pysqlite":
            raise ValueError(f"unsupported SQLite driver {u.drivername!r}")
        return u
    raise ValueError(f"unsupported database URL {u.render_as_string()!r}: use sqlite or postgresql")


class _Checkpointer:
    """Copies the SQLite WAL back into the database file in a background thread, on its own
    connection (PRAGMA wal_checkpoint(PASSIVE) after each commit), so that commits never wait for
    checkpoints. Durability does not depend on it: a commit is complete once it is in the WAL."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="state-checkpoint", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        conn = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
        try:
            conn.execute("PRAGMA busy_timeout=30000")
            while True:
                self._wake.wait()
                self._wake.clear()
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as exc:  # retried after the next commit
                    log.warning("state store checkpoint failed: %s", exc)
                if self._stopping:
                    break
        finally:
            conn.close()


def _pack_ids(ids: Sequence[int]) -> bytes:
    return struct.pack(f">{len(ids)}Q", *ids)


def _unpack_ids(blob: bytes) -> tuple[int, ...]:
    return struct.unpack(f">{len(blob) >> 3}Q", blob)


class _Generations:
    """Two generations of plain dicts approximate LRU at O(1) per call: hits move entries into the
    young generation; when it holds `max_bytes / 2` (by `_size`) the old one is dropped. Values are
    bytes (or None), which the garbage collector does not track, so a large cache adds nothing to
    the collector's work."""

    OVERHEAD = 100
    """Approximate Python overhead per entry (dict slot, key, bytes header)."""

    def __init__(self, max_bytes: int) -> None:
        self._young: dict[Any, bytes | None] = {}
        self._old: dict[Any, bytes | None] = {}
        self._bytes = 0
        self._half = max(max_bytes // 2, 1)

    def _take(self, key: Any) -> bytes | None | _Missing:
        """The cached value (moved to the young generation), or MISSING."""
        v = self._young.get(key, MISSING)
        if v is MISSING:
            v = self._old.pop(key, MISSING)
            if v is not MISSING:
                self._insert(key, v)
        return v

    def _size(self, key: Any, v: bytes | None) -> int:
        return (0 if v is None else len(v)) + self.OVERHEAD

    def _insert(self, key: Any, v: bytes | None) -> None:
        self._young[key] = v
        self._bytes += self._size(key, v)
        if self._bytes > self._half:
            self._old = self._young
            self._young = {}
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._young) + len(self._old)


class _Missing:
    """The type of MISSING: not cached (None is a cached absence)."""


MISSING = _Missing()


class _NodeCache(_Generations):
    """A bounded cache of committed inner nodes by id (leaves are read from the database: each
    is touched once per change of its key, while inner nodes near the root are shared by every
    block). Entries are packed as body || children's ids (8 bytes each), not tuples, which the
    collector would walk."""

    def get_many(self, ids: list[int], out: dict[int, NodeRecord]) -> list[int]:
        """Fill `out` with the cached ones of `ids`; return the others."""
        missing = []
        for i in ids:
            v = self._take(i)
            if not isinstance(v, bytes):
                missing.append(i)
                continue
            d = (v[1] << 8) | v[2]
            end = 4 + d + CHILD_LEN * (v[3 + d] + 1)
            out[i] = (v[:end], _unpack_ids(v[end:]))
        return missing

    def put(self, i: int, rec: NodeRecord) -> None:
        if rec[1]:
            self.put_packed(i, rec[0] + _pack_ids(rec[1]))

    def put_packed(self, i: int, v: bytes) -> None:
        """Cache the inner node `i` given as body || packed child ids."""
        if i not in self._young:
            self._old.pop(i, None)
            self._insert(i, v)


class _ValueCache(_Generations):
    """A bounded cache of committed values by key, None for a key known to be absent: a block's
    transactions read the keys their CheckTx read a moment before (and the recheck after the block
    reads them again), each a database query otherwise. Kept exact by the store: a commit writes
    its changes through, and nothing else changes the committed values of a store with entries."""

    def get(self, key: bytes) -> bytes | None | _Missing:
        return self._take(key)

    def put(self, key: bytes, v: bytes | None) -> None:
        replaced = self._young.pop(key, MISSING)
        if replaced is MISSING:
            self._old.pop(key, None)
        else:
            self._bytes -= self._size(key, replaced)  # type: ignore[arg-type]
        self._insert(key, v)

    def _size(self, key: bytes, v: bytes | None) -> int:
        return len(key) + (0 if v is None else len(v)) + self.OVERHEAD


def _check_value(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"state value must be bytes, not {type(value).__name__}")


def _increasing(entries: Iterable[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, bytes]]:
    """bulk_load's entries, checked: valid keys in strictly increasing order, values as bytes."""
    prev = b""
    for key, value in entries:
        check_key(key)
        value = _check_value(value)
        if key <= prev:
            raise ValueError(f"bulk_load entries not strictly increasing at {key!r}")
        prev = key
        yield key, value


def _check_meta(meta: Mapping[str, bytes]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, value in meta.items():
        if not isinstance(name, str) or not name or len(name) > _MAX_META_NAME:
            raise ValueError(f"meta name must be a non-empty string of at most {_MAX_META_NAME}")
        if name.startswith("_"):
            raise ValueError(f"meta names starting with '_' are reserved: {name!r}")
        out[name] = _check_value(value)
    return out


def _check_iter_prefix(prefix: bytes) -> None:
    if not isinstance(prefix, bytes):
        raise TypeError(f"prefix must be bytes, not {type(prefix).__name__}")
    if len(prefix) > MAX_KEY_LEN or not prefix.isascii() or b"\x00" in prefix:
        raise ValueError(f"prefix {prefix[:80]!r} is not ASCII without NUL")


def _rewind(
    entries: list[tuple[bytes, bytes]], undo: Mapping[bytes, bytes | None], prefix: bytes
) -> list[tuple[bytes, bytes]]:
    """The entries under `prefix` one height back: the latest rows with the last commit undone."""
    body = prefix[:-1] if prefix.endswith(b"\x00") else prefix
    exact = prefix.endswith(b"\x00")
    rows = dict(entries)
    for key, old in undo.items():
        if key == body if exact else key.startswith(body):
            if old is None:
                rows.pop(key, None)
            else:
                rows[key] = old
    return sorted(rows.items())


class Batch:
    """A write buffer over the committed state at the time it was made.

    Reads see the buffer's own writes over the committed state. Nothing reaches the database before
    `StateStore.commit(batch, …)`; dropping a batch discards it. A batch goes stale (every call
    raises StaleBatchError) once any batch is committed: make a new one after each commit.
    """

    def __init__(self, store: StateStore, generation: int) -> None:
        self._store = store
        self._gen = generation
        self._pending: dict[bytes, bytes | None] = {}
        self._pending_order: list[bytes] = []  # the keys of _pending, sorted when a scan needs them
        self._order_stale = False
        self._meta: dict[str, bytes] = {}
        self._reads: dict[bytes, bytes | None] = {}
        self._version = 0
        self._computed: tuple[int, Update] | None = None
        self._done = False

    # -- reads ---------------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        check_key(key)
        if key in self._pending:
            return self._pending[key]
        if key in self._reads:
            self._store._check_fresh(self)
            return self._reads[key]
        value = self._store._read(self, key)
        self._reads[key] = value
        return value

    def prefetch(self, keys: Iterable[bytes]) -> None:
        """Read many committed keys in a few queries, so that the get() calls that follow are
        answered from memory (a block touching thousands of known keys)."""
        wanted = [k for k in keys if k not in self._pending and k not in self._reads]
        for key in wanted:
            check_key(key)
        if wanted:
            with self._store._lock:
                self._store._check_fresh(self)
                self._reads.update(self._store._committed_values(self, wanted))

    def iterate(self, prefix: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """(key, value) for every key starting with `prefix`, in key order: the committed rows
        merged with this batch's writes as they are when iterate() is called."""
        _check_iter_prefix(prefix)
        self._store._check_fresh(self)
        if self._order_stale:  # sorted once per scan after writes, not on every write
            self._pending_order = sorted(self._pending)
            self._order_stale = False
        order = self._pending_order
        pending = []
        for i in range(bisect_left(order, prefix), len(order)):
            key = order[i]
            if not key.startswith(prefix):
                break
            pending.append((key, self._pending[key]))
        return self._merge(prefix, pending)

    def _merge(
        self, prefix: bytes, pending: list[tuple[bytes, bytes | None]]
    ) -> Iterator[tuple[bytes, bytes]]:
        i = 0
        np = len(pending)
        for key, value in self._store._scan(self, prefix):
            while i < np and pending[i][0] < key:
                pk, pv = pending[i]
                i += 1
                if pv is not None:
                    yield pk, pv
            if i < np and pending[i][0] == key:
                pv = pending[i][1]
                i += 1
                if pv is not None:
                    yield key, pv
            else:
                yield key, value
        for pk, pv in pending[i:]:
            if pv is not None:
                yield pk, pv

    # -- writes --------------------------------------------------------------------------------

    def set(self, key: bytes, value: bytes) -> None:
        check_key(key)
        self._write(key, _check_value(value))

    def delete(self, key: bytes) -> None:
        check_key(key)
        self._write(key, None)

    def _write(self, key: bytes, value: bytes | None) -> None:
        if key not in self._pending:
            self._order_stale = True
        self._pending[key] = value
        self._version += 1

    def set_meta(self, name: str, value: bytes) -> None:
        """A named blob written to the meta table when this batch is committed."""
        self._meta.update(_check_meta({name: value}))

    @property
    def changes(self) -> int:
        """Number of keys this batch writes or deletes."""
        return len(self._pending)

    # -- commitment ----------------------------------------------------------------------------

    def root(self) -> bytes:
        """The app hash the committed state would have with this batch applied."""
        return self._compute().root

    def _compute(self) -> Update:
        c = self._computed
        if c is not None and c[0] == self._version:
            self._store._check_fresh(self)
            return c[1]
        update = self._store._apply(self, sorted(self._pending.items()))
        self._computed = (self._version, update)
        return update


def _prove_prefix(
    src: StateStore | Snapshot, prefix: bytes, max_entries: int, height: int | None
) -> tuple[list[tuple[bytes, bytes]], PrefixProof]:
    """`StateStore.prove_prefix` over one consistent source of committed state: the store under its
    lock, or a snapshot. `src._height` is the source's latest height, `src._undo` the previous values
    of the keys its last commit changed (or None), `src._select_prefix` reads the latest rows."""
    latest = height is None or height == src._height
    found = src._root_at(src._height if height is None else height)
    if found is None:
        if height is not None and 0 < height < src._base:
            raise ValueError(f"no state at height {height}: this validator's state starts at height "
                             f"{src._base}, where it joined by state sync")
        if height is not None and 0 < height < src.earliest_height:
            raise ValueError(
                f"the state at height {height} is pruned: this validator keeps the last "
                f"{src.keep_heights} heights (from {src.earliest_height})"
            )
        raise ValueError(f"no committed state at height {height}")
    root, root_id = found
    proof, subtree = make_prefix_proof(root, root_id, prefix, src._get_node)
    if subtree is None:
        return [], proof
    undo = src._undo[1] if src._undo and src._undo[0] == height else None
    if latest or undo is not None:
        entries = src._select_prefix(prefix, max_entries + 1 + len(undo or ()))
        if undo is not None:
            entries = _rewind(entries, undo, prefix)
        if len(entries) > max_entries:
            raise TooManyEntriesError(f"more than {max_entries} entries under {prefix!r}")
        if not entries:
            raise StoreError("state_kv disagrees with the trie: the database is corrupt")
    else:
        try:
            entries = collect_leaves(subtree[1], src._load_full, max_entries)
        except OverflowError:
            raise TooManyEntriesError(f"more than {max_entries} entries under {prefix!r}") from None
    return entries, proof


def _paged(read: Callable[[str, Any], list[Any]], first: str, following: str,
           prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """The rows under `prefix` in key order, `_SCAN_PAGE` at a time through `read(sql, params)` with
    the scan statements `first` and `following`. Keys are ASCII, so every key starting with `prefix`
    lies in [prefix, prefix + 0x80)."""
    hi = prefix + b"\x80"
    rows = read(first, (prefix, hi, _SCAN_PAGE))
    while True:
        for k, v in rows:
            yield bytes(k), bytes(v)
        if len(rows) < _SCAN_PAGE:
            return
        rows = read(following, (bytes(rows[-1][0]), hi, _SCAN_PAGE))


def _earliest(height: int, keep_heights: int, base: int) -> int:
    if not height:
        return 0
    return max(1, base, height - keep_heights + 1 if keep_heights else 1)


def _rows_to_nodes(rows: Iterable[Any], out: dict[int, NodeRecord]) -> None:
    for i, body, kids in rows:
        out[i] = (bytes(body), _unpack_ids(kids) if kids is not None else ())


def _node_queries(ids: list[int], sqlite: bool) -> Iterator[tuple[str, Any]]:
    """The queries that read the nodes `ids` (sorted), 500 a query."""
    for k in range(0, len(ids), _IN_CHUNK):
        part = ids[k : k + _IN_CHUNK]
        if sqlite:
            yield _SQL_NODES + "IN (" + ",".join("?" * len(part)) + ")", part
        else:
            yield _SQL_NODES + "= ANY(%s)", (part,)


class Snapshot:
    """The committed state as it was when the snapshot was opened, read on a database connection of
    the snapshot's own inside one read transaction (SQLite in WAL mode: a read transaction sees the
    database as of its first read; PostgreSQL: REPEATABLE READ, READ ONLY). Commits go on meanwhile
    on the store's connections, without waiting for it, and never show through it: a reader sees
    every table as of one commit, never part of one. `height` is that commit's height; the state of
    earlier retained heights is read from the trie (or, for the height before it, through the store's
    undo log of that same commit). Meant for one thread at a time; open one per query and close it
    (it is a context manager), so that its transaction does not hold old WAL frames or row versions."""

    def __init__(self, store: StateStore) -> None:
        self.keep_heights = store.keep_heights
        self._base = store._base
        self._sqlite = store._dialect == "sqlite"
        self._dbapi_error = store._engine.dialect.dbapi.Error  # type: ignore[union-attr]
        conn = store._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        self._conn: Connection | None = conn
        try:
            self._cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
            self._exec("BEGIN" if self._sqlite else "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            self._fixed = (lambda q: q) if self._sqlite else (lambda q: q.replace("?", "%s"))
            rows = self._query(self._fixed('SELECT "value" FROM state_meta WHERE "name" = ?'), (_HEIGHT,))
            self._height = int.from_bytes(bytes(rows[0][0]), "big") if rows else 0
            self._root: tuple[bytes, int | None] = (EMPTY_ROOT, None)
            if self._height:
                root = self._fetch_root(self._height)
                if root is None:
                    raise StoreError(f"no root for the committed height {self._height}: corrupt database")
                self._root = root
            # the undo log belongs to the store's latest commit: it serves this snapshot if that is ours
            with store._lock:
                self._undo = store._undo if store._height == self._height else None
        except BaseException:
            self.close()
            raise

    @property
    def height(self) -> int:
        """The height of the commit this snapshot shows (0 before the first)."""
        return self._height

    @property
    def app_hash(self) -> bytes:
        return self._root[0]

    @property
    def earliest_height(self) -> int:
        return _earliest(self._height, self.keep_heights, self._base)

    def prove_prefix(
        self, prefix: bytes, max_entries: int = DEFAULT_MAX_ENTRIES, height: int | None = None
    ) -> tuple[list[tuple[bytes, bytes]], PrefixProof]:
        """As `StateStore.prove_prefix`, for this snapshot's height or a retained earlier one."""
        check_prefix(prefix)
        if self._conn is None:
            raise StoreError("the snapshot is closed")
        return _prove_prefix(self, prefix, max_entries, height)

    def count(self, prefix: bytes) -> int:
        """How many keys start with `prefix` (an ASCII prefix) at this snapshot's height."""
        check_prefix(prefix)
        sql = 'SELECT COUNT(*) FROM state_kv WHERE "key" >= ? AND "key" < ?'
        return int(self._query(self._fixed(sql), (prefix, prefix + b"\x80"))[0][0])

    def entries(self) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) of this snapshot's height in key order, a page at a time (what a state
        sync snapshot holds)."""
        if self._conn is None:
            raise StoreError("the snapshot is closed")
        return _paged(self._query, self._fixed(_SQL_SCAN_FIRST), self._fixed(_SQL_SCAN_NEXT), b"")

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            self._cur.execute("ROLLBACK")  # read only: nothing to keep
            self._cur.close()
        except Exception:  # a broken connection: the pool must not hand it out again
            log.debug("closing a snapshot failed", exc_info=True)
            conn.invalidate()
        conn.close()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _exec(self, sql: str) -> None:
        try:
            self._cur.execute(sql)
        except self._dbapi_error as exc:
            raise StoreError(f"state database read failed: {exc}") from exc

    def _query(self, sql: str, params: Any) -> list[Any]:
        try:
            self._cur.execute(sql, params)
            return list(self._cur.fetchall())
        except self._dbapi_error as exc:
            raise StoreError(f"state database read failed: {exc}") from exc

    def _fetch_root(self, height: int) -> tuple[bytes, int | None] | None:
        sql = self._fixed("SELECT app_hash, root_id FROM state_roots WHERE height = ?")
        rows = self._query(sql, (height,))
        return (bytes(rows[0][0]), rows[0][1]) if rows else None

    def _root_at(self, height: int) -> tuple[bytes, int | None] | None:
        if height == 0:
            return EMPTY_ROOT, None
        if height == self._height:
            return self._root
        if height > self._height:
            return None
        return self._fetch_root(height)

    def _get_node(self, node_id: int) -> NodeRecord:
        return self._load_full([node_id])[node_id]

    def _load_full(self, ids: list[int]) -> dict[int, NodeRecord]:
        """Nodes by id from the database (not through the store's cache: a reader walking old heights
        would push the nodes that blocks use out of it)."""
        out: dict[int, NodeRecord] = {}
        ids = sorted(ids)
        for sql, params in _node_queries(ids, self._sqlite):
            _rows_to_nodes(self._query(sql, params), out)
        for i in ids:
            if i not in out:
                raise StoreError(f"trie node {i} is missing: the database is corrupt")
        return out

    def _select_prefix(self, prefix: bytes, limit: int) -> list[tuple[bytes, bytes]]:
        if prefix.endswith(b"\x00"):
            rows = self._query(self._fixed(_SQL_GET_KV), (prefix[:-1],))
        else:
            rows = self._query(self._fixed(_SQL_SCAN_FIRST), (prefix, prefix + b"\x80", limit))
        return [(bytes(k), bytes(v)) for k, v in rows]


class _LockedSnapshot:
    """`StateStore.snapshot()` of a store whose engine has one connection for everything (SQLite in
    memory): the store's own reads, under its lock for as long as the snapshot is open."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        store._lock.acquire()
        self.height = store.height
        self.app_hash = store.app_hash

    def prove_prefix(
        self, prefix: bytes, max_entries: int = DEFAULT_MAX_ENTRIES, height: int | None = None
    ) -> tuple[list[tuple[bytes, bytes]], PrefixProof]:
        return self._store.prove_prefix(prefix, max_entries, height)

    def close(self) -> None:
        if self._store is not None:
            self._store._lock.release()
            self._store = None  # type: ignore[assignment]

    def __enter__(self) -> _LockedSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StateStore:
    """The committed state; see the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        cache_bytes: int = 384 << 20,
        value_cache_bytes: int = 64 << 20,
        sqlite_synchronous: str = "NORMAL",
        sqlite_max_pages: int = 0,
        keep_heights: int = 0,
        echo: bool = False,
    ) -> None:
        try:
            self.keep_heights = check_keep_heights(keep_heights)
        except ValueError as exc:
            raise ValueError(f"keep_heights {exc}") from None
        u = normalise_url(url)
        self.url = u
        self._lock = threading.RLock()
        self._cache_bytes = cache_bytes
        self._cache = _NodeCache(cache_bytes)
        self._value_cache_bytes = value_cache_bytes
        self._values = _ValueCache(value_cache_bytes)
        self._generation = 0
        self._engine = self._make_engine(u, sqlite_synchronous.upper(), sqlite_max_pages, echo)
        self._rconn: Connection | None = None
        self._rcur: Any = None
        self._checkpointer: _Checkpointer | None = None
        self._dialect = self._engine.dialect.name
        self._shared_connection = isinstance(self._engine.pool, StaticPool)
        _md.create_all(self._engine)
        self._prepare_statements()
        with self._engine.begin() as conn:
            rows = dict(
                conn.execute(
                    select(meta_table.c.name, meta_table.c.value).where(
                        meta_table.c.name.in_([_HEIGHT, _APP_HASH, _SCHEMA, _BASE])
                    )
                ).all()
            )
            schema = rows.get(_SCHEMA)
            if schema is None:
                conn.execute(insert(meta_table), {"name": _SCHEMA, "value": SCHEMA_VERSION})
            elif bytes(schema) != SCHEMA_VERSION:
                raise StoreError(f"state schema {bytes(schema)!r}, this code reads {SCHEMA_VERSION!r}")
            self._height = int.from_bytes(bytes(rows.get(_HEIGHT, b"")), "big")
            self._base = int.from_bytes(bytes(rows.get(_BASE, b"")), "big")
            # The previous values of the keys the last commit changed: serves the state one
            # height back (what a client verifies against the latest header) without a trie walk.
            self._undo: tuple[int, dict[bytes, bytes | None]] | None = None
            self._app_hash = bytes(rows[_APP_HASH]) if _APP_HASH in rows else EMPTY_ROOT
            self._root_id: int | None = None
            if self._height:
                self._root_id = conn.execute(
                    select(roots_table.c.root_id).where(roots_table.c.height == self._height)
                ).scalar()
            self._next_id = (conn.execute(select(func.max(nodes_table.c.id))).scalar() or 0) + 1
        if u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:"):
            self._checkpointer = _Checkpointer(u.database)
            weakref.finalize(self, self._checkpointer.stop)

    @staticmethod
    def _make_engine(u: URL, sync: str, max_pages: int, echo: bool) -> Engine:
        if u.get_backend_name() == "sqlite":
            if sync not in _SQLITE_SYNC:
                raise ValueError(f"sqlite_synchronous must be one of {_SQLITE_SYNC}")
            if type(max_pages) is not int or max_pages < 0:
                raise ValueError("sqlite_max_pages must be an int of at least 0")
            if u.database in (None, "", ":memory:"):
                engine = create_engine(
                    u, poolclass=StaticPool, connect_args={"check_same_thread": False}, echo=echo
                )
            else:
                Path(u.database).parent.mkdir(parents=True, exist_ok=True)
                engine = create_engine(u, echo=echo)

            @event.listens_for(engine, "connect")
            def _pragmas(dbapi_conn: Any, _record: Any) -> None:
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=" + sync)
                cur.execute("PRAGMA cache_size=-65536")
                # reads through a memory map, up to the most SQLite's build allows (2 GiB); beyond
                # that a page read is a system call (a million users' state is about 1.7 GiB)
                cur.execute("PRAGMA mmap_size=2147418112")
                cur.execute("PRAGMA wal_autocheckpoint=0")  # see _Checkpointer
                cur.execute("PRAGMA busy_timeout=30000")
                if max_pages:
                    cur.execute(f"PRAGMA max_page_count={max_pages}")
                cur.close()

            return engine
        return create_engine(u, pool_pre_ping=True, echo=echo)

    def _prepare_statements(self) -> None:
        ins: Any = pg_dialect.insert if self._dialect == "postgresql" else sqlite_dialect.insert
        upm = ins(meta_table)
        self._upsert_meta = upm.on_conflict_do_update(
            index_elements=["name"], set_={"value": upm.excluded.value}
        )
        # The hot paths (thousands of rows per block) go straight to the DBAPI cursor: the same
        # SQL on both databases but for the placeholder.
        fix = (lambda q: q) if self._dialect == "sqlite" else (lambda q: q.replace("?", "%s"))
        self._sql_ins_nodes = fix(_SQL_INS_NODES)
        self._sql_del_node = fix(_SQL_DEL_NODE)
        self._sql_upsert_kv = fix(_SQL_UPSERT_KV)
        self._sql_del_kv = fix(_SQL_DEL_KV)
        self._sql_ins_kv = fix(_SQL_INS_KV)
        self._sql_get = fix(_SQL_GET)
        self._sql_get_kv = fix(_SQL_GET_KV)
        self._sql_scan_first = fix(_SQL_SCAN_FIRST)
        self._sql_scan_next = fix(_SQL_SCAN_NEXT)

    # -- committed state -----------------------------------------------------------------------

    @property
    def height(self) -> int:
        """The last committed height (0 before the first commit)."""
        return self._height

    @property
    def earliest_height(self) -> int:
        """The earliest height whose state can still be proven (1 on an archive; 0 when empty)."""
        return _earliest(self._height, self.keep_heights, self._base)

    @property
    def app_hash(self) -> bytes:
        """The root of the committed state (EMPTY_ROOT at height 0)."""
        return self._app_hash

    def batch(self) -> Batch:
        """A new write buffer over the committed state."""
        return Batch(self, self._generation)

    def get_meta(self, name: str) -> bytes | None:
        """A committed named blob (see `commit(meta=…)`), or None."""
        with self._lock, self._engine.connect() as conn:
            v = conn.execute(select(meta_table.c.value).where(meta_table.c.name == name)).scalar()
        return None if v is None else bytes(v)

    def root_at(self, height: int) -> bytes | None:
        """The app hash committed at `height` (EMPTY_ROOT at 0), or None if there is none."""
        found = self._root_at(height)
        return None if found is None else found[0]

    def _root_at(self, height: int) -> tuple[bytes, int | None] | None:
        if height == 0:
            return EMPTY_ROOT, None
        with self._lock:
            if height == self._height:
                return self._app_hash, self._root_id
            with self._engine.connect() as conn:
                row = conn.execute(
                    select(roots_table.c.app_hash, roots_table.c.root_id).where(
                        roots_table.c.height == height
                    )
                ).first()
        return None if row is None else (bytes(row[0]), row[1])

    def commit(self, batch: Batch, height: int, meta: Mapping[str, bytes] | None = None) -> bytes:
        """Persist `batch` as the state of `height` (greater than the current height), with the
        named blobs of `meta` (and of `batch.set_meta`), in one database transaction. Returns the
        new app hash. Every other batch goes stale."""
        if type(height) is not int:
            raise TypeError("height must be an int")
        with self._lock:
            self._check_fresh(batch)
            if height <= self._height:
                raise StoreError(f"height {height} is not above the committed height {self._height}")
            previous = self._height
            all_meta = dict(batch._meta)
            all_meta.update(_check_meta(meta or {}))
            root, root_id, new_nodes, orphans, undo = batch._compute()
            changes = sorted(batch._pending.items())
            sets = [(k, v) for k, v in changes if v is not None]
            dels = [(k,) for k, v in changes if v is None]
            with self._engine.begin() as conn:
                inner = self._write_nodes(conn, new_nodes)
                cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
                if sets:
                    cur.executemany(self._sql_upsert_kv, sets)
                if dels:
                    cur.executemany(self._sql_del_kv, dels)
                if orphans:
                    conn.execute(insert(orphans_table), {"height": height, "ids": _pack_ids(orphans)})
                self._write_head(conn, height, root, root_id, all_meta)
                if self.keep_heights:
                    self._prune(conn, cur, height - self.keep_heights + 1)
                cur.close()
            put = self._values.put
            for key, value in changes:
                put(key, value)
            self._committed(height, root, root_id, len(new_nodes))
            self._undo = (previous, undo)
            batch._done = True
            self._warm(inner)
        return root

    def bulk_load(
        self,
        entries: Iterable[tuple[bytes, bytes]],
        height: int,
        meta: Mapping[str, bytes] | None = None,
        *,
        chunk: int = BULK_LOAD_ENTRIES,
        max_bytes: int = BULK_LOAD_BYTES,
        expect_root: bytes | None = None,
    ) -> bytes:
        """Build the state from `entries` (sorted by key, distinct) in one pass and commit it as
        `height`, in one transaction. Only on an empty store (height 0). Returns the app hash; with
        `expect_root`, raises RootMismatch and stores nothing unless the entries make that root.
        What it holds is written (inside the transaction) once it reaches `chunk` entries or
        `max_bytes` bytes (see BULK_LOAD_BYTES); what is stored does not depend on these limits."""
        if type(height) is not int or height <= 0:
            raise ValueError("height must be a positive int")
        checked_meta = _check_meta(meta or {})
        with self._lock:
            if self._height != 0 or self._app_hash != EMPTY_ROOT:
                raise StoreError("bulk_load needs an empty store (height 0)")
            self._values = _ValueCache(self._value_cache_bytes)  # it may hold absences of these keys
            try:
                root, root_id, written = self._bulk_load_tx(
                    entries, height, checked_meta, chunk, max_bytes, expect_root
                )
            except BaseException:
                # the cache was warmed with ids that the rolled-back nodes had: forget them
                self._cache = _NodeCache(self._cache_bytes)
                raise
            finally:
                self._truncate_wal()
            self._committed(height, root, root_id, written)
            self._base = height
        return root

    def _truncate_wal(self) -> None:
        """After bulk_load: a committed load's WAL copied into the database file, a rolled-back one's
        space given back (SQLite keeps a WAL file's size: a refused snapshot would go on holding the
        disk). Best effort: the load's outcome is decided, and a commit is durable in the WAL."""
        try:
            self.checkpoint()
        except SQLAlchemyError as exc:
            log.warning("state store: checkpoint after bulk_load failed: %s", exc)

    def checkpoint(self) -> None:
        """SQLite: copy the whole WAL into the database file now and truncate it (bulk_load does
        this; commits leave it to the background thread). No-op on PostgreSQL."""
        if self._dialect != "sqlite":
            return
        with self._lock, self._engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    def _bulk_load_tx(
        self,
        entries: Iterable[tuple[bytes, bytes]],
        height: int,
        meta: dict[str, bytes],
        max_entries: int,
        max_bytes: int,
        expect_root: bytes | None,
    ) -> tuple[bytes, int | None, int]:
        """bulk_load's transaction, writing what it holds at `max_entries` entries or `max_bytes`
        bytes. Node ids follow the order in which the builder makes the nodes, so the rows written
        do not depend on these limits."""
        ids = itertools.count(self._next_id)
        builder = TrieBuilder(collect=True, new_ref=lambda _h: next(ids))
        rows: list[tuple[bytes, bytes]] = []
        held = written = 0
        with self._engine.begin() as conn:
            cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
            for key, value in _increasing(entries):
                builder.add_leaf(key, value)
                rows.append((key, value))
                held += 2 * (len(key) + len(value))  # its row, and its leaf in builder.nodes
                if len(rows) >= max_entries or held >= max_bytes:
                    written += self._write_loaded(conn, cur, builder, rows)
                    rows, held = [], 0
            root = builder.finish()
            if expect_root is not None and root != expect_root:  # leaving the block rolls it all back
                raise RootMismatch(f"the entries' root {root.hex()} is not the expected {expect_root.hex()}")
            written += self._write_loaded(conn, cur, builder, rows)
            cur.close()
            self._write_head(conn, height, root, builder.root_ref, {**meta, _BASE: height.to_bytes(8, "big")})
        return root, builder.root_ref, written

    def _write_loaded(
        self, conn: Connection, cur: Any, builder: TrieBuilder, rows: list[tuple[bytes, bytes]]
    ) -> int:
        """Write a bulk load's `rows` and the nodes `builder` made since the last call, and let go of
        those nodes (its leaves carry their values). Returns how many nodes."""
        nodes = builder.nodes or []
        builder.nodes = []
        self._warm(self._write_nodes(conn, nodes))
        if rows:
            cur.executemany(self._sql_ins_kv, rows)
        return len(nodes)

    def prove_prefix(
        self,
        prefix: bytes,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        height: int | None = None,
    ) -> tuple[list[tuple[bytes, bytes]], PrefixProof]:
        """Every committed (key, value) whose key starts with `prefix` (a key followed by b"\\x00"
        selects that key alone), in key order, and the proof against the app hash of `height`
        (default: the latest). Raises TooManyEntriesError beyond `max_entries`, ValueError for an
        invalid prefix or an unknown height. Holds the store's lock throughout: a reader on another
        thread than the one that commits uses `snapshot()` instead."""
        check_prefix(prefix)
        with self._lock:
            return _prove_prefix(self, prefix, max_entries, height)

    def snapshot(self) -> Snapshot:
        """A read-only view of the latest committed state, on a database connection of its own and
        inside one read transaction, so that a commit on another thread neither waits for it nor shows
        through it (see `Snapshot`). Use it as a context manager."""
        if self._shared_connection:
            return _LockedSnapshot(self)
        return Snapshot(self)

    def prove_key(self, key: bytes, height: int | None = None) -> tuple[bytes | None, PrefixProof]:
        """The committed value of `key` (None if absent) and its proof."""
        check_key(key)
        entries, proof = self.prove_prefix(key + b"\x00", 1, height)
        return (entries[0][1] if entries else None), proof

    def close(self) -> None:
        with self._lock:
            self._close_reader()
        if self._checkpointer is not None:
            self._checkpointer.stop()
            self._checkpointer = None
        self._engine.dispose()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _committed(self, height: int, root: bytes, root_id: int | None, new_nodes: int) -> None:
        self._height = height
        self._app_hash = root
        self._root_id = root_id
        self._next_id += new_nodes
        self._generation += 1
        if self._checkpointer is not None:
            self._checkpointer.poke()

    def _write_nodes(self, conn: Connection, nodes: list[NewNode]) -> list[tuple[int, bytes]]:
        """Append new nodes (their ids are consecutive from `_next_id`, in order). Returns the
        inner ones as cache entries, for `_warm` once the transaction is safe."""
        rows: list[tuple[int, bytes, bytes | None]] = []
        inner: list[tuple[int, bytes]] = []
        for i, _, body, kids in nodes:
            if kids:
                blob = _pack_ids(kids)
                rows.append((i, body, blob))
                inner.append((i, body + blob))
            else:
                rows.append((i, body, None))
        if rows:
            cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
            cur.executemany(self._sql_ins_nodes, rows)
            cur.close()
        return inner

    def _prune(self, conn: Connection, cur: Any, earliest: int) -> None:
        """Make heights before `earliest` unprovable and delete the nodes no later height uses:
        those that commits up to `earliest` replaced (at most PRUNE_MAX_IDS of them, whole
        heights, oldest first; always at least one height)."""
        conn.execute(roots_table.delete().where(roots_table.c.height < earliest))
        rows = conn.execute(
            select(orphans_table.c.height, func.length(orphans_table.c.ids))
            .where(orphans_table.c.height <= earliest)
            .order_by(orphans_table.c.height)
        ).all()
        heights, total = [], 0
        for h, size in rows:
            if heights and total + size // 8 > PRUNE_MAX_IDS:
                break
            heights.append(h)
            total += size // 8
        if not heights:
            return
        sel = orphans_table.c.height.in_(heights)
        blobs = conn.execute(select(orphans_table.c.ids).where(sel)).scalars().all()
        cur.executemany(self._sql_del_node, [(i,) for b in blobs for i in _unpack_ids(b)])
        conn.execute(orphans_table.delete().where(sel))

    def _write_head(
        self, conn: Connection, height: int, root: bytes, root_id: int | None, meta: dict[str, bytes]
    ) -> None:
        rows = [{"name": k, "value": meta[k]} for k in sorted(meta)]
        rows.append({"name": _HEIGHT, "value": height.to_bytes(8, "big")})
        rows.append({"name": _APP_HASH, "value": root})
        conn.execute(self._upsert_meta, rows)
        conn.execute(insert(roots_table), {"height": height, "app_hash": root, "root_id": root_id})

    def _check_fresh(self, batch: Batch) -> None:
        if batch._store is not self:
            raise StoreError("batch belongs to another store")
        if batch._done:
            raise StaleBatchError("batch was already committed")
        if batch._gen != self._generation:
            raise StaleBatchError("batch predates the latest commit; make a new batch")

    def _query(self, sql: str, params: Any) -> list[Any]:
        """Run one read on the reader connection (autocommit, held open: a pool checkout per
        read would cost more than the read). Rows are always fetched to the end, so that no
        statement keeps a SQLite read snapshot open. A dropped connection is reopened once; a
        second failure of the driver is a StoreError, which stops a block instead of failing
        one transaction on this validator alone."""
        with self._lock:
            for attempt in (1, 2):
                try:
                    if self._rcur is None:
                        conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
                        self._rconn = conn
                        self._rcur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
                    self._rcur.execute(sql, params)
                    return list(self._rcur.fetchall())
                except Exception as exc:
                    self._close_reader()
                    if attempt == 2:
                        if isinstance(exc, self._engine.dialect.dbapi.Error):  # type: ignore[union-attr]
                            raise StoreError(f"state database read failed: {exc}") from exc
                        raise
        raise AssertionError("unreachable")

    def _close_reader(self) -> None:
        if self._rconn is not None:
            try:
                self._rconn.close()
            except Exception:  # already broken
                log.debug("closing the reader connection failed", exc_info=True)
        self._rconn = None
        self._rcur = None

    def _read(self, batch: Batch, key: bytes) -> bytes | None:
        with self._lock:
            self._check_fresh(batch)
            value = self._values.get(key)
            if value is MISSING:
                rows = self._query(self._sql_get, (key,))
                value = bytes(rows[0][0]) if rows else None
                self._values.put(key, value)
        return value  # type: ignore[return-value]

    def _scan(self, batch: Batch, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Committed rows under `prefix` in key order, a page at a time (nothing is held between
        pages, so the caller may stop at any point)."""

        def page(sql: str, params: Any) -> list[Any]:
            with self._lock:
                self._check_fresh(batch)
                return self._query(sql, params)

        return _paged(page, self._sql_scan_first, self._sql_scan_next, prefix)

    def _committed_values(self, batch: Batch, keys: list[bytes]) -> dict[bytes, bytes | None]:
        """The committed values of `keys` before `batch`: the batch's own reads, the rest in a
        few IN queries."""
        out = {k: batch._reads[k] for k in keys if k in batch._reads}
        rest = []
        for k in keys:
            if k not in out:
                value = self._values.get(k)
                if value is MISSING:
                    rest.append(k)
                else:
                    out[k] = value  # type: ignore[assignment]
        for i in range(0, len(rest), _IN_CHUNK):
            chunk = rest[i : i + _IN_CHUNK]
            marks = ", ".join(["%s" if self._dialect == "postgresql" else "?"] * len(chunk))
            sql = f'SELECT "key", "value" FROM state_kv WHERE "key" IN ({marks})'  # noqa: S608 (placeholders only)
            found = {bytes(k): bytes(v) for k, v in self._query(sql, chunk)}
            for k in chunk:
                out[k] = found.get(k)
                self._values.put(k, out[k])
        return out

    def _select_prefix(self, prefix: bytes, limit: int) -> list[tuple[bytes, bytes]]:
        if prefix.endswith(b"\x00"):
            rows = self._query(self._sql_get_kv, (prefix[:-1],))
        else:
            rows = self._query(self._sql_scan_first, (prefix, prefix + b"\x80", limit))
        return [(bytes(k), bytes(v)) for k, v in rows]

    def _warm(self, entries: list[tuple[int, bytes]]) -> None:
        """Cache new inner nodes (of a bulk load, the cache keeps the last, i.e. the top, ones).
        bulk_load empties the cache again if its transaction fails, since the ids get reused."""
        put = self._cache.put_packed
        for i, v in entries:
            put(i, v)

    def _get_node(self, node_id: int) -> NodeRecord:
        return self._load([node_id])[node_id]

    def _load(self, ids: list[int]) -> dict[int, NodeRecord]:
        """Committed nodes by id, from the cache or the database."""
        out: dict[int, NodeRecord] = {}
        cache = self._cache
        missing = cache.get_many(ids, out)
        if missing:
            put = cache.put
            for rec_id, rec in self._load_full(missing).items():
                out[rec_id] = rec
                put(rec_id, rec)
        return out

    def _load_full(self, ids: list[int]) -> dict[int, NodeRecord]:
        """Committed nodes by id from the database, one query per 500 ids."""
        out: dict[int, NodeRecord] = {}
        ids = sorted(ids)
        for sql, params in _node_queries(ids, self._dialect == "sqlite"):
            _rows_to_nodes(self._query(sql, params), out)
        for i in ids:
            if i not in out:
                raise StoreError(f"trie node {i} is missing: the database is corrupt")
        return out

    def _apply(self, batch: Batch, changes: list[tuple[bytes, bytes | None]]) -> Update:
        """The new root and nodes, the ids of the committed nodes they replace (sorted, as the
        orphan rows keep them) and the changed keys' previous values (the undo log)."""
        with self._lock:
            self._check_fresh(batch)
            ids = itertools.count(self._next_id)
            update = apply_changes(
                self._app_hash, self._root_id, changes, self._load, lambda _h: next(ids), batch._reads
            )
            return update._replace(replaced=sorted(update.replaced))
