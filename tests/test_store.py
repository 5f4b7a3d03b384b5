"""The state store on SQLite and PostgreSQL: commitment, atomicity, isolation, proofs."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from planetserve.chain import trie
from planetserve.chain.abci import store as store_module
from planetserve.chain.abci.store import (
    RootMismatch,
    StaleBatchError,
    StateStore,
    StoreError,
    TooManyEntriesError,
    nodes_table,
    normalise_url,
    roots_table,
)
from planetserve.chain.trie import EMPTY_ROOT, ProofError, subtree_root, verify_key, verify_prefix


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state.db'}"
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def store(store_url: str) -> Iterator[StateStore]:
    s = StateStore(store_url)
    yield s
    s.close()


def all_entries(s: StateStore) -> list[tuple[bytes, bytes]]:
    return list(s.batch().iterate())


# -- basics --------------------------------------------------------------------------------------


def test_empty_store(store: StateStore) -> None:
    assert store.height == 0
    assert store.app_hash == EMPTY_ROOT
    assert store.batch().root() == EMPTY_ROOT
    assert store.get_meta("anything") is None
    entries, proof = store.prove_prefix(b"")
    assert entries == []
    verify_prefix(EMPTY_ROOT, b"", [], proof)


def test_commit_and_reopen(store_url: str) -> None:
    s = StateStore(store_url)
    b = s.batch()
    b.set(b"user/a", b"1")
    b.set(b"user/b", b"")
    b.set(b"node/x", b"\x00\xff" * 100)
    b.set_meta("chain_id", b"test-chain")
    root = s.commit(b, 1, {"block_time": (123).to_bytes(8, "big")})
    assert root == s.app_hash == subtree_root(sorted(all_entries(s)))
    s.close()
    s2 = StateStore(store_url)
    assert s2.height == 1 and s2.app_hash == root
    assert s2.get_meta("chain_id") == b"test-chain"
    assert s2.get_meta("block_time") == (123).to_bytes(8, "big")
    assert s2.batch().get(b"user/b") == b""
    assert s2.batch().get(b"node/x") == b"\x00\xff" * 100
    assert s2.root_at(1) == root and s2.root_at(0) == EMPTY_ROOT and s2.root_at(2) is None
    s2.close()


def test_nothing_visible_before_commit(store_url: str) -> None:
    s = StateStore(store_url)
    b = s.batch()
    b.set(b"k/1", b"v")
    assert b.root() != EMPTY_ROOT
    other = StateStore(store_url)
    assert other.batch().get(b"k/1") is None
    assert s.batch().get(b"k/1") is None
    assert list(s.batch().iterate()) == []
    assert other.height == 0 and other.app_hash == EMPTY_ROOT
    assert s.prove_prefix(b"k/")[0] == []
    other.close()
    s.commit(b, 1)
    assert s.batch().get(b"k/1") == b"v"
    s.close()


def test_failed_commit_writes_nothing(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    s = StateStore(store_url)
    b = s.batch()
    b.set(b"a", b"1")
    s.commit(b, 1)
    b = s.batch()
    b.set(b"a", b"2")
    b.set(b"b", b"3")

    def boom(*_a: object, **_k: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(s, "_write_head", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        s.commit(b, 2)
    monkeypatch.undo()
    assert s.height == 1
    fresh = StateStore(store_url)
    assert fresh.height == 1
    assert all_entries(fresh) == [(b"a", b"1")]
    assert fresh.app_hash == subtree_root([(b"a", b"1")])
    fresh.close()
    # the batch survived and can still be committed
    assert s.commit(b, 2) == subtree_root([(b"a", b"2"), (b"b", b"3")])
    s.close()


def test_heights_must_increase(store: StateStore) -> None:
    store.commit(store.batch(), 5)
    with pytest.raises(StoreError, match="height 5 is not above the committed height 5"):
        store.commit(store.batch(), 5)
    with pytest.raises(StoreError, match="height 3 is not above the committed height 5"):
        store.commit(store.batch(), 3)
    store.commit(store.batch(), 6)
    assert store.height == 6


def test_meta_names(store: StateStore) -> None:
    with pytest.raises(ValueError, match="reserved"):
        store.commit(store.batch(), 1, {"_height": b"x"})
    with pytest.raises(ValueError, match="meta name must be a non-empty string"):
        store.batch().set_meta("", b"x")
    store.commit(store.batch(), 1, {"a": b"1"})
    store.commit(store.batch(), 2, {"a": b"2"})
    assert store.get_meta("a") == b"2"
    assert store.get_meta("_height") == (2).to_bytes(8, "big")


def test_invalid_writes(store: StateStore) -> None:
    b = store.batch()
    for key, message in ((b"", "state key must not be empty"), (b"a\x00", "is not ASCII without NUL"),
                         ("é".encode(), "is not ASCII without NUL"),
                         (b"x" * (trie.MAX_KEY_LEN + 1), f"longer than {trie.MAX_KEY_LEN}")):
        with pytest.raises(ValueError, match=message):
            b.set(key, b"v")
    with pytest.raises(TypeError, match="state value must be bytes, not str"):
        b.set(b"a", "text")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="state key must be bytes, not str"):
        b.get("a")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not ASCII without NUL"):
        list(b.iterate(b"a\x00"))


def test_delete_and_reinsert(store: StateStore) -> None:
    b = store.batch()
    for i in range(50):
        b.set(b"k/%03d" % i, b"v%d" % i)
    r1 = store.commit(b, 1)
    b = store.batch()
    for i in range(0, 50, 2):
        b.delete(b"k/%03d" % i)
    b.delete(b"k/nonexistent")
    r2 = store.commit(b, 2)
    assert r2 != r1
    assert [k for k, _ in all_entries(store)] == [b"k/%03d" % i for i in range(1, 50, 2)]
    assert r2 == subtree_root(all_entries(store))
    b = store.batch()
    for i in range(0, 50, 2):
        b.set(b"k/%03d" % i, b"v%d" % i)
    assert store.commit(b, 3) == r1
    b = store.batch()
    b.set(b"k/x", b"1")
    b.delete(b"k/x")
    assert b.get(b"k/x") is None
    assert store.commit(b, 4) == r1
    b = store.batch()
    for k, _ in all_entries(store):
        b.delete(k)
    assert store.commit(b, 5) == EMPTY_ROOT
    assert all_entries(store) == []


def test_batch_isolation_and_staleness(store: StateStore) -> None:
    base = store.batch()
    base.set(b"a", b"0")
    store.commit(base, 1)
    block = store.batch()
    check = store.batch()
    block.set(b"a", b"block")
    check.set(b"a", b"check")
    check.set(b"c", b"check")
    assert block.get(b"a") == b"block" and check.get(b"a") == b"check"
    assert block.get(b"c") is None
    assert list(block.iterate()) == [(b"a", b"block")]
    assert block.root() != check.root()
    store.commit(block, 2)
    for call, message in (
        (lambda: check.get(b"zz"), "batch predates the latest commit"),
        (lambda: list(check.iterate()), "batch predates the latest commit"),
        (check.root, "batch predates the latest commit"),
        (lambda: store.commit(check, 3), "batch predates the latest commit"),
        (lambda: store.commit(block, 3), "batch was already committed"),
    ):
        with pytest.raises(StaleBatchError, match=message):
            call()
    assert store.batch().get(b"a") == b"block"
    assert store.batch().get(b"c") is None


def test_root_is_cached(store: StateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    b = store.batch()
    b.set(b"a", b"1")
    r = b.root()
    calls = []
    original = store._apply
    monkeypatch.setattr(store, "_apply", lambda *a: calls.append(1) or original(*a))
    assert b.root() == r
    assert store.commit(b, 1) == r
    assert calls == []


def test_iterate_merges_pending(store: StateStore) -> None:
    b = store.batch()
    for k in (b"p/a", b"p/c", b"p/e", b"q/a", b"p", b"o/z"):
        b.set(k, b"old")
    store.commit(b, 1)
    b = store.batch()
    b.set(b"p/b", b"new")
    b.set(b"p/c", b"new")
    b.delete(b"p/e")
    b.set(b"p/f", b"new")
    b.set(b"r", b"new")
    assert list(b.iterate(b"p/")) == [
        (b"p/a", b"old"),
        (b"p/b", b"new"),
        (b"p/c", b"new"),
        (b"p/f", b"new"),
    ]
    assert [k for k, _ in b.iterate(b"p")] == [b"p", b"p/a", b"p/b", b"p/c", b"p/f"]
    assert [k for k, _ in b.iterate()] == [
        b"o/z",
        b"p",
        b"p/a",
        b"p/b",
        b"p/c",
        b"p/f",
        b"q/a",
        b"r",
    ]
    it = b.iterate(b"p/")
    assert next(it) == (b"p/a", b"old")  # stopping early is fine


def test_iterate_many_pages(store: StateStore) -> None:
    b = store.batch()
    keys = sorted(b"x/%05d" % i for i in range(1000))
    for k in keys:
        b.set(k, k)
    store.commit(b, 1)
    b = store.batch()
    b.delete(keys[300])
    b.set(b"x/00300a", b"n")
    got = [k for k, _ in b.iterate(b"x/")]
    want = sorted([*keys[:300], *keys[301:], b"x/00300a"])
    assert got == want


# -- proofs from the store -----------------------------------------------------------------------


def test_prove_prefix_and_key(store: StateStore) -> None:
    rnd = random.Random(3)
    b = store.batch()
    state = {}
    for _ in range(300):
        k = f"{rnd.choice(['user', 'node', 'ulist/eu', 'ulist/us'])}/{rnd.getrandbits(64):016x}"
        state[k.encode()] = rnd.randbytes(rnd.randrange(0, 50))
    for k, v in state.items():
        b.set(k, v)
    root = store.commit(b, 1)
    for prefix in (b"", b"user/", b"ulist/", b"ulist/eu/", b"u", b"zzz", b"node/0", b"user/\x7f"):
        entries, proof = store.prove_prefix(prefix, 1000)
        assert entries == sorted((k, v) for k, v in state.items() if k.startswith(prefix))
        verify_prefix(root, prefix, entries, trie.PrefixProof.decode(proof.encode()))
    for key in list(state)[:20] + [b"user/absent", b"a"]:
        value, proof = store.prove_key(key)
        assert value == state.get(key)
        verify_key(root, key, value, proof)
    with pytest.raises(TooManyEntriesError, match="more than 10 entries under b''"):
        store.prove_prefix(b"", 10)
    with pytest.raises(ValueError, match="more than 10 entries"):  # the app maps ValueError to a query error
        store.prove_prefix(b"", 10)
    with pytest.raises(ValueError, match="is not ASCII with at most one final NUL"):
        store.prove_prefix(b"a\x00b")


def test_proofs_at_earlier_heights(store: StateStore) -> None:
    b = store.batch()
    for i in range(100):
        b.set(b"k/%02d" % i, b"one")
    r1 = store.commit(b, 1)
    b = store.batch()
    for i in range(0, 100, 3):
        b.set(b"k/%02d" % i, b"two")
    b.delete(b"k/01")
    r2 = store.commit(b, 2)
    entries, proof = store.prove_prefix(b"k/0", height=1)
    assert entries == [(b"k/%02d" % i, b"one") for i in range(10)]
    verify_prefix(r1, b"k/0", entries, proof)
    with pytest.raises(ProofError, match="recomputed root does not match app hash"):
        verify_prefix(r2, b"k/0", entries, proof)
    value, proof = store.prove_key(b"k/01", height=1)
    assert value == b"one"
    verify_key(r1, b"k/01", value, proof)
    value, proof = store.prove_key(b"k/01")
    assert value is None
    verify_key(r2, b"k/01", None, proof)
    with pytest.raises(TooManyEntriesError, match="more than 50 entries under b'k/'"):
        store.prove_prefix(b"k/", 50, height=1)
    with pytest.raises(ValueError, match="no committed state at height 7"):
        store.prove_prefix(b"k/", height=7)


def test_a_snapshot_shows_one_commit_while_later_ones_go_on(store: StateStore) -> None:
    """A snapshot (the ABCI query workers' view) reads the commit that was latest when it opened, and
    earlier retained heights, through its own connection: commits made meanwhile neither wait for it
    nor show through it; a snapshot opened after them shows the new height."""
    state: dict[int, dict[bytes, bytes]] = {}
    rows: dict[bytes, bytes] = {}
    roots = {}
    for height in range(1, 6):
        b = store.batch()
        for i in range(0, 60, height):
            key, value = b"k/%02d" % i, b"v%d" % height
            b.set(key, value)
            rows[key] = value
        if height > 1:
            b.delete(b"k/%02d" % (height * 7))
            rows.pop(b"k/%02d" % (height * 7), None)
        roots[height] = store.commit(b, height)
        state[height] = dict(rows)
        if height == 3:
            snapshot = store.snapshot()
            assert (snapshot.height, snapshot.app_hash) == (3, roots[3])
    with snapshot:
        assert store.height == 5
        for height in (3, 2, 1):  # the latest rows as of 3, the undo log of 3, the trie
            entries, proof = snapshot.prove_prefix(b"k/", 1000, height)
            assert entries == sorted(state[height].items())
            verify_prefix(roots[height], b"k/", entries, proof)
        value, proof = snapshot.prove_prefix(b"k/14\x00", 1, 3)
        assert value == [] and state[3].get(b"k/14") is None
        verify_key(roots[3], b"k/14", None, proof)
        with pytest.raises(ValueError, match="no committed state at height 4"):
            snapshot.prove_prefix(b"k/", 1000, 4)
        with pytest.raises(TooManyEntriesError):
            snapshot.prove_prefix(b"k/", 10, 3)
    with store.snapshot() as later:
        assert later.height == 5
        for height in (5, 4, 3):
            entries, proof = later.prove_prefix(b"k/", 1000, height)
            assert (entries, proof) == store.prove_prefix(b"k/", 1000, height)
            assert entries == sorted(state[height].items())


# -- the store agrees with the pure trie ---------------------------------------------------------

key_st = st.one_of(
    st.text(alphabet="ab/", min_size=1, max_size=8),
    st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=127), min_size=1, max_size=4),
).map(str.encode)
block_st = st.dictionaries(key_st, st.one_of(st.none(), st.binary(max_size=8)), max_size=25)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.lists(block_st, min_size=1, max_size=5))
def test_store_root_matches_subtree_root(blocks: list[dict[bytes, bytes | None]]) -> None:
    s = StateStore("sqlite://")
    model: dict[bytes, bytes] = {}
    for h, block in enumerate(blocks, start=1):
        root = _commit_block(s, h, block, model)
        assert root == subtree_root(sorted(model.items()))
        assert all_entries(s) == sorted(model.items())
    s.close()


def _random_blocks(seed: int, n_blocks: int = 6) -> list[dict[bytes, bytes | None]]:
    rnd = random.Random(seed)
    keys = [f"{rnd.choice(['user', 'node', 'a', 'ab'])}/{rnd.getrandbits(32):x}".encode() for _ in range(400)]
    blocks = []
    for _ in range(n_blocks):
        block: dict[bytes, bytes | None] = {}
        for _ in range(rnd.randrange(1, 150)):
            k = rnd.choice(keys)
            block[k] = None if rnd.random() < 0.2 else rnd.randbytes(rnd.randrange(0, 30))
        blocks.append(block)
    return blocks


def _commit_block(s: StateStore, height: int, block: dict[bytes, bytes | None], model: dict[bytes, bytes]) -> bytes:
    """Commit one block of writes (None deletes) and apply it to `model` as well."""
    b = s.batch()
    for k, v in block.items():
        if v is None:
            b.delete(k)
            model.pop(k, None)
        else:
            b.set(k, v)
            model[k] = v
    return s.commit(b, height)


def _run_blocks(s: StateStore, blocks: list[dict[bytes, bytes | None]]) -> list[bytes]:
    roots = []
    for h, block in enumerate(blocks, start=1):
        b = s.batch()
        for k, v in block.items():
            if v is None:
                b.delete(k)
            else:
                b.set(k, v)
        roots.append(s.commit(b, h, {"n": bytes([h])}))
    return roots


@pytest.mark.postgres
def test_sqlite_and_postgres_agree(pg_url: str, tmp_path: Path) -> None:
    blocks = _random_blocks(11)
    lite = StateStore(f"sqlite:///{tmp_path / 'a.db'}")
    pg = StateStore(pg_url)
    assert _run_blocks(lite, blocks) == _run_blocks(pg, blocks)
    assert all_entries(lite) == all_entries(pg)
    for prefix in (b"user/", b"a", b"ab/", b"zz"):
        assert lite.prove_prefix(prefix) == pg.prove_prefix(prefix)
    # bytewise key order on both: b"a/..." < b"ab/..." < b"node/..." ("/" is 0x2f)
    keys = [k for k, _ in all_entries(pg)]
    assert keys == sorted(keys)
    lite.close()
    pg.close()


def test_small_cache_gives_same_roots(tmp_path: Path) -> None:
    blocks = _random_blocks(5)
    big = StateStore(f"sqlite:///{tmp_path / 'big.db'}")
    tiny = StateStore(f"sqlite:///{tmp_path / 'tiny.db'}", cache_bytes=1)
    assert _run_blocks(big, blocks) == _run_blocks(tiny, blocks)


# -- bulk load -----------------------------------------------------------------------------------


def test_bulk_load(store_url: str) -> None:
    rnd = random.Random(9)
    entries = sorted(
        {f"user/{rnd.getrandbits(64):016x}".encode(): rnd.randbytes(40) for _ in range(5000)}.items()
    )
    s = StateStore(store_url)
    root = s.bulk_load(iter(entries), 1, {"origin": b"bulk"}, chunk=700)
    assert root == subtree_root(entries) and s.height == 1
    assert s.get_meta("origin") == b"bulk"
    with pytest.raises(StoreError, match=r"bulk_load needs an empty store \(height 0\)"):
        s.bulk_load([], 2)
    # incremental updates continue from the bulk-loaded trie
    b = s.batch()
    b.set(entries[0][0], b"changed")
    b.delete(entries[1][0])
    b.set(b"user/new", b"x")
    r2 = s.commit(b, 2)
    expected = dict(entries)
    expected[entries[0][0]] = b"changed"
    del expected[entries[1][0]]
    expected[b"user/new"] = b"x"
    assert r2 == subtree_root(sorted(expected.items()))
    s.close()
    reopened = StateStore(store_url)
    assert reopened.app_hash == r2
    reopened.close()


def test_bulk_load_rejects_unsorted(tmp_path: Path) -> None:
    s = StateStore(f"sqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(ValueError, match="bulk_load entries not strictly increasing at b'a'"):
        s.bulk_load([(b"b", b"1"), (b"a", b"1")], 1)
    assert s.height == 0
    assert StateStore(f"sqlite:///{tmp_path / 'x.db'}").batch().get(b"b") is None


def _all_rows(s: StateStore) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table of the store, in primary-key order."""
    with s._engine.connect() as conn:
        return {
            t.name: [tuple(r) for r in conn.execute(select(t).order_by(*t.primary_key.columns))]
            for t in store_module._md.sorted_tables
        }


def _mixed_entries() -> list[tuple[bytes, bytes]]:
    """Entries of sizes from none to 6 KB, under shared prefixes (a deep trie)."""
    rnd = random.Random(17)
    keys = {f"{rnd.choice(['u', 'user/', 'user/a'])}{rnd.getrandbits(12):x}".encode() for _ in range(600)}
    return [(k, rnd.randbytes(rnd.choice([0, 1, 40, 700, 6000]))) for k in sorted(keys)]


@pytest.mark.parametrize(
    ("chunk", "max_bytes"),
    [(1, 1 << 40), (7, 1 << 40), (20_000, 1), (20_000, 5_000), (20_000, 100_000), (50, 20_000)],
)
def test_bulk_load_stores_the_same_rows_whatever_it_holds_between_writes(
    store_url: str, tmp_path: Path, chunk: int, max_bytes: int
) -> None:
    """The app hash and every stored row (trie nodes and their ids, kv rows, roots, meta) are the
    same whether the load writes after every entry, every few bytes or all at the end."""
    entries = _mixed_entries()
    reference = StateStore(f"sqlite:///{tmp_path / 'reference.db'}")
    root = reference.bulk_load(entries, 3, {"origin": b"bulk"}, chunk=len(entries) + 1, max_bytes=1 << 40)
    assert root == subtree_root(entries)
    s = StateStore(store_url)
    loaded = s.bulk_load(iter(entries), 3, {"origin": b"bulk"}, chunk=chunk, max_bytes=max_bytes, expect_root=root)
    assert loaded == root
    assert _all_rows(s) == _all_rows(reference)
    reference.close()
    s.close()


def test_a_load_of_large_values_holds_its_byte_budget_not_all_of_them(tmp_path: Path) -> None:
    """A forged snapshot's values may each be as large as a chunk: a load of 256 values of 1 MiB
    holds about its byte budget, not the 512 MiB of rows and trie leaves it writes before its root
    is compared with the trusted one and the load refused."""
    budget = 8 << 20

    def entries() -> Iterator[tuple[bytes, bytes]]:
        for i in range(256):
            yield b"big/%04d" % i, bytes([i]) * (1 << 20)

    s = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    tracemalloc.start()
    try:
        with pytest.raises(RootMismatch):
            s.bulk_load(entries(), 1, max_bytes=budget, expect_root=EMPTY_ROOT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * budget, f"the load held {peak >> 20} MiB"
    assert s.height == 0 and s.app_hash == EMPTY_ROOT and all_entries(s) == []
    s.close()


# -- durability ----------------------------------------------------------------------------------


def test_sigkill_after_commit_loses_nothing(tmp_path: Path) -> None:
    db = tmp_path / "kill.db"
    script = textwrap.dedent(f"""
        import sys, time
        from planetserve.chain.abci.store import StateStore
        s = StateStore({str(db)!r})
        for h in range(1, 4):
            b = s.batch()
            for i in range(200):
                b.set(b"k/%d/%d" % (h, i), b"v" * 100)
            root = s.commit(b, h)
        print(root.hex(), flush=True)
        time.sleep(60)
    """)
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            root_hex = proc.stdout.readline().strip()
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    s = StateStore(str(db))
    assert s.height == 3
    assert s.app_hash.hex() == root_hex
    assert len(all_entries(s)) == 600
    assert s.app_hash == subtree_root(all_entries(s))


# -- URLs ----------------------------------------------------------------------------------------


def test_urls() -> None:
    assert normalise_url("postgresql://u:p@h/db").drivername == "postgresql+psycopg"
    assert normalise_url("postgres://u:p@h/db").drivername == "postgresql+psycopg"
    assert normalise_url("postgresql+psycopg://u:p@h/db").drivername == "postgresql+psycopg"
    assert normalise_url("sqlite:///x.db").database == "x.db"
    assert normalise_url("/tmp/state.db").database == "/tmp/state.db"
    for bad, message in (
        ("mysql://u@h/db", "unsupported database URL 'mysql://u@h/db'"),
        ("postgresql+asyncpg://u@h/db", r"unsupported PostgreSQL driver 'postgresql\+asyncpg'"),
    ):
        with pytest.raises(ValueError, match=message):
            normalise_url(bad)


def test_bulk_load_failure_then_retry(tmp_path: Path) -> None:
    """A failed bulk load leaves nothing behind, not even cached nodes under reused ids."""
    url = f"sqlite:///{tmp_path / 'retry.db'}"
    s = StateStore(url)
    good = [(b"k/%04d" % i, b"v%d" % i) for i in range(3000)]

    def bad() -> Iterator[tuple[bytes, bytes]]:
        yield from [(b"j/%04d" % i, b"w") for i in range(2500)]
        raise RuntimeError("source failed")

    with pytest.raises(RuntimeError, match="source failed"):
        s.bulk_load(bad(), 1, chunk=500)
    assert s.height == 0 and s.app_hash == EMPTY_ROOT
    root = s.bulk_load(good, 1, chunk=500)
    assert root == subtree_root(good)
    b = s.batch()
    b.set(b"k/0001", b"changed")
    b.delete(b"k/0002")
    expected = dict(good)
    expected[b"k/0001"] = b"changed"
    del expected[b"k/0002"]
    assert s.commit(b, 2) == subtree_root(sorted(expected.items()))
    s.close()


def test_reopen_and_continue(store_url: str) -> None:
    blocks = _random_blocks(21, 8)
    s = StateStore(store_url)
    roots = _run_blocks(s, blocks[:4])
    s.close()
    s = StateStore(store_url)
    model: dict[bytes, bytes] = {}
    for block in blocks[:4]:
        for k, v in block.items():
            if v is None:
                model.pop(k, None)
            else:
                model[k] = v
    assert s.app_hash == roots[-1] == subtree_root(sorted(model.items()))
    for h, block in enumerate(blocks[4:], start=5):
        assert _commit_block(s, h, block, model) == subtree_root(sorted(model.items()))
    for prefix in (b"user/", b"a", b""):
        entries, proof = s.prove_prefix(prefix, 10_000)
        verify_prefix(s.app_hash, prefix, entries, proof)
        entries, proof = s.prove_prefix(prefix, 10_000, height=3)
        verify_prefix(roots[2], prefix, entries, proof)
    s.close()


def test_proofs_while_committing(tmp_path: Path) -> None:
    """Queries from another thread always get an answer consistent with one committed root."""
    import threading

    s = StateStore(f"sqlite:///{tmp_path / 'threads.db'}")
    roots = {0: EMPTY_ROOT}
    stop = threading.Event()
    failures: list[BaseException] = []
    verified: set[int] = set()  # heights the reader has checked a proof at

    def query() -> None:
        while not stop.is_set():
            try:
                h = s.height
                entries, proof = s.prove_prefix(b"k/", 100_000, height=h)
                verify_prefix(roots[h], b"k/", entries, proof)
                verified.add(h)
            except BaseException as exc:  # reported below
                failures.append(exc)
                return

    t = threading.Thread(target=query)
    t.start()
    try:
        for h in range(1, 30):
            b = s.batch()
            for i in range(40):
                b.set(b"k/%d/%d" % (h, i), b"v")
            if h > 2:
                b.delete(b"k/%d/0" % (h - 2))
            roots[h] = b.root()
            s.commit(b, h)
            deadline = time.monotonic() + 10  # the reader keeps querying h while h + 1 commits
            while h not in verified and not failures and time.monotonic() < deadline:
                time.sleep(0.001)
    finally:
        stop.set()
        t.join()
    assert not failures, failures
    assert verified >= set(range(1, 30))
    s.close()


@pytest.mark.parametrize("seed", [3, 5, 8])
def test_previous_height_from_undo_matches_the_trie_walk(store_url: str, seed: int) -> None:
    """The state one height back is served from the latest rows with the last commit undone; it
    must equal what walking that height's trie gives (a reopened store has no undo)."""
    live = StateStore(store_url)
    roots = _run_blocks(live, _random_blocks(seed, n_blocks=5))
    reopened = StateStore(store_url)
    previous = live.height - 1
    for prefix in (b"user/", b"a", b"ab/", b"node/", b"zz", b"u"):
        fast = live.prove_prefix(prefix, 1000, previous)
        slow = reopened.prove_prefix(prefix, 1000, previous)
        assert fast == slow
        verify_prefix(roots[previous - 1], prefix, *fast)
    for key in {k for block in _random_blocks(seed, n_blocks=5) for k in block}:
        value, proof = live.prove_key(key, previous)
        assert (value, proof) == reopened.prove_key(key, previous)
        verify_key(roots[previous - 1], key, value, proof)
    live.close()
    reopened.close()


# -- pruning -------------------------------------------------------------------------------------


def _stored_ids(s: StateStore) -> set[int]:
    with s._engine.connect() as conn:
        return {i for (i,) in conn.execute(select(nodes_table.c.id))}


def _retained(s: StateStore) -> dict[int, int | None]:
    """Height -> root node id of every height the store still serves."""
    with s._engine.connect() as conn:
        return dict(conn.execute(select(roots_table.c.height, roots_table.c.root_id)).all())


def _reachable(s: StateStore, root_id: int | None) -> set[int]:
    seen: set[int] = set()
    todo = [] if root_id is None else [root_id]
    while todo:
        i = todo.pop()
        seen.add(i)
        todo += s._load_full([i])[i][1]
    return seen


def _pruning_block(h: int, model: dict[bytes, bytes], rnd: random.Random) -> dict[bytes, bytes | None]:
    """Random writes, with the blocks that leave nodes in place in between: rewriting values
    unchanged, deleting only absent keys (the root stays), and deleting everything."""
    if h == 5:
        return dict(sorted(model.items())[:20])
    if h == 6:
        return {b"zz/absent-1": None, b"zz/absent-2": None}
    if h == 11:
        return dict.fromkeys(model)
    return _random_blocks(rnd.randrange(10**6), n_blocks=1)[0]


def _check_pruned(s: StateStore, roots: dict[int, bytes], keep: int) -> None:
    """Exactly the last `keep` heights are served, each proven against its app hash, and the node
    table holds exactly the nodes of their tries: nothing they need is gone, nothing else is left."""
    h = s.height
    retained = _retained(s)
    assert sorted(retained) == list(range(max(1, h - keep + 1), h + 1))
    assert _stored_ids(s) == set().union(*(_reachable(s, r) for r in retained.values()))
    for height in retained:
        entries, proof = s.prove_prefix(b"", 10_000, height)
        verify_prefix(roots[height], b"", entries, proof)
    for height in range(1, h - keep + 1):
        with pytest.raises(ValueError, match=f"height {height} is pruned: .* keeps the last {keep} heights"):
            s.prove_prefix(b"user/", 10_000, height)


@pytest.mark.parametrize("keep", [2, 3, 7])
def test_pruning_keeps_exactly_the_last_heights(store_url: str, tmp_path: Path, keep: int) -> None:
    rnd = random.Random(keep)
    s = StateStore(store_url, keep_heights=keep)
    archive = StateStore(f"sqlite:///{tmp_path / 'archive.db'}")
    model: dict[bytes, bytes] = {}
    roots: dict[int, bytes] = {}
    for h in range(1, 15):
        block = _pruning_block(h, model, rnd)
        roots[h] = _commit_block(s, h, block, model)
        assert _commit_block(archive, h, block, {}) == roots[h]  # pruning never changes the app hash
        _check_pruned(s, roots, keep)
    s.close()
    s = StateStore(store_url, keep_heights=keep)  # reopened, it goes on pruning where it left off
    roots[15] = _commit_block(s, 15, {b"user/after": b"reopen"}, model)
    _check_pruned(s, roots, keep)
    assert len(_stored_ids(s)) < len(_stored_ids(archive))
    s.close()
    archive.close()


def test_pruning_a_backlog_drains_over_later_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Turning pruning on for a store that kept everything: each commit deletes at most
    PRUNE_MAX_IDS nodes (whole heights, at least one), and the backlog is gone after a few."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    rnd = random.Random(4)
    s = StateStore(url)
    model: dict[bytes, bytes] = {}
    roots = {h: _commit_block(s, h, _pruning_block(h, model, rnd), model) for h in range(1, 11)}
    s.close()
    monkeypatch.setattr(store_module, "PRUNE_MAX_IDS", 40)  # a height of this backlog has 100+
    s = StateStore(url, keep_heights=2)
    before = len(_stored_ids(s))
    roots[11] = _commit_block(s, 11, {b"user/x": b"1"}, model)
    assert sorted(_retained(s)) == [10, 11]  # old heights stop being served at once ...
    left = _stored_ids(s)
    assert len(left) < before  # ... their nodes go one height per commit here
    assert left > set().union(*(_reachable(s, r) for r in _retained(s).values()))
    for h in range(12, 30):
        roots[h] = _commit_block(s, h, {b"user/x": b"%d" % h}, model)
    _check_pruned(s, roots, 2)
    s.close()


def test_keep_heights_must_leave_the_previous_height(tmp_path: Path) -> None:
    for bad in (1, -1, "3", 2.0):
        with pytest.raises(ValueError, match="keep_heights must be 0 .* or at least 2"):
            StateStore(f"sqlite:///{tmp_path / 'state.db'}", keep_heights=bad)  # type: ignore[arg-type]


def test_sigkill_while_pruning_leaves_a_consistent_store(tmp_path: Path) -> None:
    """A process committing and pruning without pause is killed at an arbitrary point: the reopened
    store holds exactly its last 3 heights' tries and carries on."""
    db = tmp_path / "kill.db"
    script = textwrap.dedent(f"""
        from planetserve.chain.abci.store import StateStore
        s = StateStore({f"sqlite:///{db}"!r}, keep_heights=3)
        for h in range(1, 100_000):
            b = s.batch()
            for i in range(300):
                b.set(b"k/%d" % ((h * 7 + i * 13) % 2000), b"v%d" % h)
            s.commit(b, h)
            if h == 20:
                print("going", flush=True)
    """)
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "going"
            time.sleep(random.uniform(0.2, 0.6))
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    s = StateStore(f"sqlite:///{db}", keep_heights=3)
    h = s.height
    assert h >= 20 and sorted(_retained(s)) == [h - 2, h - 1, h]
    assert _stored_ids(s) == set().union(*(_reachable(s, r) for r in _retained(s).values()))
    assert s.app_hash == subtree_root(all_entries(s))
    b = s.batch()
    b.set(b"k/after", b"kill")
    s.commit(b, h + 1)
    assert sorted(_retained(s)) == [h - 1, h, h + 1]
    assert _stored_ids(s) == set().union(*(_reachable(s, r) for r in _retained(s).values()))
    s.close()


def test_committed_values_are_served_from_a_cache_the_commits_keep_exact(store_url: str) -> None:
    """A value (or absence) read once is answered from memory until a commit changes it, which
    writes it through; a failed commit changes nothing, and a key never read still goes to the
    database."""
    s = StateStore(store_url)
    seed = s.batch()
    seed.set(b"k/kept", b"1")
    seed.set(b"k/gone", b"2")
    s.commit(seed, 1)
    reader = s.batch()
    assert (reader.get(b"k/kept"), reader.get(b"k/gone"), reader.get(b"k/new")) == (b"1", b"2", None)
    change = s.batch()
    change.set(b"k/kept", b"10")
    change.delete(b"k/gone")
    change.set(b"k/new", b"3")
    s.commit(change, 2)
    after = s.batch()
    assert (after.get(b"k/kept"), after.get(b"k/gone"), after.get(b"k/new")) == (b"10", None, b"3")
    failing = s.batch()
    failing.set(b"k/kept", b"lost")

    def boom(*_a: object, **_k: object) -> None:
        raise RuntimeError("disk full")

    s._write_head = boom  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="disk full"):
        s.commit(failing, 3)
    del s._write_head
    assert s.batch().get(b"k/kept") == b"10"
    s.close()


def test_the_value_cache_answers_without_the_database_and_is_bounded(tmp_path: Path) -> None:
    import sqlite3

    s = StateStore(f"sqlite:///{tmp_path / 'state.db'}", value_cache_bytes=64 * 1024)
    b = s.batch()
    for i in range(2000):
        b.set(b"k/%05d" % i, b"v" * 100)
    s.commit(b, 1)
    b = s.batch()
    for i in range(2000):
        b.get(b"k/%05d" % i)
    held = len(s._values)
    assert 0 < held < 2000  # 64 KiB holds a few hundred of these, not all
    with sqlite3.connect(tmp_path / "state.db") as other:
        other.execute("ALTER TABLE state_kv RENAME TO state_kv_gone")
    s._close_reader()  # the reader connection would still see the old schema
    assert s.batch().get(b"k/01999") == b"v" * 100  # the last read: cached
    with pytest.raises(StoreError, match="no such table: state_kv"):
        s.batch().get(b"k/00000")  # pushed out long ago: a database read
    s.close()


def test_a_bulk_load_replaces_absences_cached_before_it(tmp_path: Path) -> None:
    s = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    assert s.batch().get(b"k/1") is None
    s.bulk_load([(b"k/1", b"loaded")], 1)
    assert s.batch().get(b"k/1") == b"loaded"
    s.close()
