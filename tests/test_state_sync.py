"""State sync in the real Application and store: snapshots made every N heights and kept, chunks served,
a snapshot restored into an empty node, and what a peer that lies about chunks or a whole snapshot
gets (refused, nothing stored). tests/test_network_state_sync.py runs it between real CometBFT nodes."""

from __future__ import annotations

import functools
import hashlib
import shutil
import tracemalloc
from pathlib import Path

import msgpack
import pytest
from harness import CHAIN_ID, AppHarness, sqlite_url
from tendermint.abci import types_pb2 as abci

from planetserve.chain import layout
from planetserve.chain.abci.app import Application
from planetserve.chain.abci.snapshots import (
    FORMAT,
    LOAD_BYTES_PER_CHUNK_BYTE,
    MAX_CHUNK_BYTES,
    Metadata,
    Snapshots,
    decode_chunk,
    encode_entry,
)
from planetserve.chain.abci.store import StateStore
from planetserve.chain.keys import KeySet
from planetserve.chain.trie import EMPTY_ROOT

OFFER = abci.ResponseOfferSnapshot
CHUNK = abci.ResponseApplySnapshotChunk


def chain_with_snapshots(tmp_path: Path, users: int = 60, interval: int = 4,
                         chunk_bytes: int = 1024) -> AppHarness:
    """A chain of 8 blocks registering `users`, its app making a snapshot every `interval` heights in
    chunks of about `chunk_bytes`."""
    h = AppHarness(sqlite_url(tmp_path, "source.db"))
    h.app.snapshots = Snapshots(tmp_path / "snapshots", interval=interval, chunk_bytes=chunk_bytes)
    per_block = users // 8
    for b in range(8):
        h.block(*(h.tx(KeySet.generate(), "register-user", {"address": f"10.3.{b}.{i}:9000", "region": "eu"})
                  for i in range(per_block)))
        h.app.snapshots.wait()
    return h


def joiner(tmp_path: Path, name: str = "joiner") -> Application:
    store = StateStore(sqlite_url(tmp_path, f"{name}.db"))
    return Application(store, Snapshots(tmp_path / f"{name}-snapshots"), chain_id=CHAIN_ID)


def offer(app: Application, snapshot: abci.Snapshot, app_hash: bytes) -> int:
    return app.offer_snapshot(abci.RequestOfferSnapshot(snapshot=snapshot, app_hash=app_hash)).result


def apply(app: Application, index: int, chunk: bytes, sender: str = "peer-a") -> abci.ResponseApplySnapshotChunk:
    return app.apply_snapshot_chunk(abci.RequestApplySnapshotChunk(index=index, chunk=chunk, sender=sender))


def chunks_of(source: Application, snapshot: abci.Snapshot) -> list[bytes]:
    return [source.load_snapshot_chunk(abci.RequestLoadSnapshotChunk(height=snapshot.height, format=FORMAT,
                                                                     chunk=i)).chunk
            for i in range(snapshot.chunks)]


def forged(snapshot: abci.Snapshot, chunks: list[bytes]) -> abci.Snapshot:
    """A snapshot whose metadata lists the hashes of `chunks`: consistent in itself, whatever they hold."""
    old = Metadata.decode(snapshot.metadata)
    metadata = Metadata(tuple(hashlib.sha256(c).digest() for c in chunks), old.block_time, old.chain_id).encode()
    return abci.Snapshot(height=snapshot.height, format=FORMAT, chunks=len(chunks),
                         hash=hashlib.sha256(metadata).digest(), metadata=metadata)


def test_snapshots_are_made_every_interval_and_the_last_two_kept(tmp_path: Path) -> None:
    h = chain_with_snapshots(tmp_path)
    listed = h.app.list_snapshots(abci.RequestListSnapshots()).snapshots
    assert [s.height for s in listed] == [4, 8]
    latest = listed[-1]
    assert latest.chunks > 3  # about 1 KiB each
    entries = [e for c in chunks_of(h.app, latest) for e in decode_chunk(c)]
    assert entries == sorted(h.store.batch().iterate(b""))
    assert h.app.load_snapshot_chunk(abci.RequestLoadSnapshotChunk(height=8, format=FORMAT,
                                                                   chunk=latest.chunks)).chunk == b""
    assert h.app.load_snapshot_chunk(abci.RequestLoadSnapshotChunk(height=6, format=FORMAT, chunk=0)).chunk == b""
    for _ in range(4):
        h.block()
    h.app.snapshots.wait()
    assert [s.height for s in h.app.list_snapshots(abci.RequestListSnapshots()).snapshots] == [8, 12]


def test_a_joining_node_restores_a_snapshot_and_runs_on_from_it(tmp_path: Path) -> None:
    h = chain_with_snapshots(tmp_path)
    snapshot = h.app.list_snapshots(abci.RequestListSnapshots()).snapshots[-1]
    app = joiner(tmp_path)
    assert offer(app, snapshot, h.store.app_hash) == OFFER.ACCEPT
    for i, chunk in enumerate(chunks_of(h.app, snapshot)):
        assert apply(app, i, chunk).result == CHUNK.ACCEPT
    info = app.info(abci.RequestInfo())
    assert (info.last_block_height, info.last_block_app_hash) == (8, h.store.app_hash)
    assert app.committed_time == h.app.committed_time and app.chain_id == CHAIN_ID
    user = next(k for k, _ in h.store.batch().iterate(layout.key("user", "")))
    answer = app.query(abci.RequestQuery(path="/key", data=user, prove=True))
    assert answer.code == 0 and answer.value == h.store.batch().get(user) and answer.height == 8
    with pytest.raises(ValueError, match="starts at height 8, where it joined by state sync"):
        app.store.prove_key(user, 7)
    # it runs the next block as the others do
    follower = h.app
    h.app = app
    h.block(h.tx(KeySet.generate(), "register-user", {"address": "10.9.0.1:9000", "region": "eu"}))
    h.app = follower
    assert h.blocks[-1][1] == follower.finalize_block(h.blocks[-1][0]).app_hash


def test_a_corrupted_chunk_is_refused_its_sender_rejected_and_the_chunk_fetched_again(tmp_path: Path) -> None:
    h = chain_with_snapshots(tmp_path)
    snapshot = h.app.list_snapshots(abci.RequestListSnapshots()).snapshots[-1]
    chunks = chunks_of(h.app, snapshot)
    app = joiner(tmp_path)
    assert offer(app, snapshot, h.store.app_hash) == OFFER.ACCEPT
    assert apply(app, 0, chunks[0]).result == CHUNK.ACCEPT
    bad = bytearray(chunks[1])
    bad[-1] ^= 1
    refused = apply(app, 1, bytes(bad), sender="liar")
    assert refused.result == CHUNK.RETRY
    assert list(refused.refetch_chunks) == [1] and list(refused.reject_senders) == ["liar"]
    assert apply(app, 1, chunks[1][: len(chunks[1]) // 2], sender="liar").result == CHUNK.RETRY
    assert apply(app, 1, b"\0" * (MAX_CHUNK_BYTES + 1), sender="liar").result == CHUNK.RETRY
    assert app.store.height == 0
    for i, chunk in enumerate(chunks[1:], start=1):
        assert apply(app, i, chunk, sender="honest").result == CHUNK.ACCEPT
    assert app.store.app_hash == h.store.app_hash


def test_a_snapshot_that_does_not_reach_the_trusted_app_hash_is_rejected_and_nothing_is_stored(
        tmp_path: Path) -> None:
    """A peer forges a whole snapshot (metadata and chunks agree) with one user's address changed: every
    chunk checks, the root does not."""
    h = chain_with_snapshots(tmp_path)
    snapshot = h.app.list_snapshots(abci.RequestListSnapshots()).snapshots[-1]
    chunks = chunks_of(h.app, snapshot)
    entries = list(decode_chunk(chunks[-1]))
    key, value = entries[-1]
    tampered = b"".join(encode_entry(k, v) for k, v in entries[:-1]) + encode_entry(key, value + b" ")
    lie = forged(snapshot, [*chunks[:-1], tampered])
    app = joiner(tmp_path)
    assert offer(app, lie, h.store.app_hash) == OFFER.ACCEPT
    results = [apply(app, i, c).result for i, c in enumerate([*chunks[:-1], tampered])]
    assert results == [CHUNK.ACCEPT] * (len(chunks) - 1) + [CHUNK.REJECT_SNAPSHOT]
    assert app.store.height == 0 and not (tmp_path / "joiner-snapshots" / "restoring").exists()
    # entries out of order are refused as soon as they are seen
    swapped = forged(snapshot, [chunks[1], chunks[0], *chunks[2:]])
    assert offer(app, swapped, h.store.app_hash) == OFFER.ACCEPT
    assert [apply(app, 0, chunks[1]).result, apply(app, 1, chunks[0]).result] == [
        CHUNK.ACCEPT, CHUNK.REJECT_SNAPSHOT]
    # the honest snapshot still restores
    assert offer(app, snapshot, h.store.app_hash) == OFFER.ACCEPT
    assert all(apply(app, i, c).result == CHUNK.ACCEPT for i, c in enumerate(chunks))
    assert app.store.app_hash == h.store.app_hash


def test_a_snapshot_is_refused_before_its_chunks_take_the_disks_reserve(tmp_path: Path) -> None:
    """A forged snapshot may list up to MAX_CHUNKS chunks, each of which checks: the restore stops
    keeping them where the disk's reserve begins, and nothing of it stays."""
    h = chain_with_snapshots(tmp_path)
    snapshot = h.app.list_snapshots(abci.RequestListSnapshots()).snapshots[-1]
    chunks = chunks_of(h.app, snapshot)
    free = shutil.disk_usage(tmp_path).free
    app = Application(StateStore(sqlite_url(tmp_path, "full.db")),
                      Snapshots(tmp_path / "full-snapshots", disk_reserve=free + (1 << 30)), chain_id=CHAIN_ID)
    assert offer(app, snapshot, h.store.app_hash) == OFFER.ACCEPT
    assert apply(app, 0, chunks[0]).result == CHUNK.REJECT_SNAPSHOT
    assert app.store.height == 0 and not (tmp_path / "full-snapshots" / "restoring").exists()
    # with room, the same snapshot restores
    app.snapshots.disk_reserve = 0
    assert offer(app, snapshot, h.store.app_hash) == OFFER.ACCEPT
    assert all(apply(app, i, c).result == CHUNK.ACCEPT for i, c in enumerate(chunks))
    assert app.store.app_hash == h.store.app_hash


def assert_nothing_kept(app: Application, snapshots: Path) -> None:
    """What a refused snapshot leaves: an empty state and no restore folder."""
    assert (app.store.height, app.store.app_hash) == (0, EMPTY_ROOT)
    assert list(app.store.batch().iterate(b"")) == []
    assert not (snapshots / "restoring").exists()


def test_a_snapshot_is_refused_before_its_load_takes_the_disks_reserve(tmp_path: Path) -> None:
    """The chunks fit above the reserve, but loading their entries writes several times their bytes
    (rows, trie nodes, SQLite's WAL) before the root can be checked: the restore refuses the snapshot
    before it loads anything, and nothing of it stays."""
    h = chain_with_snapshots(tmp_path, users=1600, chunk_bytes=64 << 10)
    snapshot = h.app.list_snapshots(abci.RequestListSnapshots()).snapshots[-1]
    chunks = chunks_of(h.app, snapshot)
    held = sum(map(len, chunks))
    app = joiner(tmp_path)
    # the reserve begins halfway into what the load would write, once the chunks are kept
    app.snapshots.disk_reserve = shutil.disk_usage(tmp_path).free - held - held * LOAD_BYTES_PER_CHUNK_BYTE // 2
    assert offer(app, snapshot, h.store.app_hash) == OFFER.ACCEPT
    results = [apply(app, i, c).result for i, c in enumerate(chunks)]
    assert results == [CHUNK.ACCEPT] * (len(chunks) - 1) + [CHUNK.REJECT_SNAPSHOT]
    assert_nothing_kept(app, tmp_path / "joiner-snapshots")
    # with room, the same snapshot restores
    app.snapshots.disk_reserve = 0
    assert offer(app, snapshot, h.store.app_hash) == OFFER.ACCEPT
    assert all(apply(app, i, c).result == CHUNK.ACCEPT for i, c in enumerate(chunks))
    assert app.store.app_hash == h.store.app_hash


def test_a_load_that_fills_the_disk_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    """A forged snapshot whose entries the database cannot hold: the load meets SQLite's real
    SQLITE_FULL ("database or disk is full", from a cap of 1 MiB on the joiner's database), rolls back
    and refuses the snapshot instead of stopping the node, which then restores the honest one."""
    h = chain_with_snapshots(tmp_path)
    snapshot = h.app.list_snapshots(abci.RequestListSnapshots()).snapshots[-1]
    chunks = chunks_of(h.app, snapshot)
    # 25,000 entries: bulk_load writes its first 20,000 before it can compare the root
    bulky = [b"".join(encode_entry(b"zz/%06d" % i, b"v" * 100) for i in range(start, start + 5_000))
             for start in range(0, 25_000, 5_000)]
    store = StateStore(sqlite_url(tmp_path, "capped.db"), sqlite_max_pages=256)
    app = Application(store, Snapshots(tmp_path / "capped-snapshots"), chain_id=CHAIN_ID)
    assert offer(app, forged(snapshot, bulky), h.store.app_hash) == OFFER.ACCEPT
    results = [apply(app, i, c).result for i, c in enumerate(bulky)]
    assert results == [CHUNK.ACCEPT] * (len(bulky) - 1) + [CHUNK.REJECT_SNAPSHOT]
    assert_nothing_kept(app, tmp_path / "capped-snapshots")
    assert offer(app, snapshot, h.store.app_hash) == OFFER.ACCEPT
    assert all(apply(app, i, c).result == CHUNK.ACCEPT for i, c in enumerate(chunks))
    assert app.store.app_hash == h.store.app_hash


def test_a_forged_snapshot_of_large_values_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """A forged snapshot whose 96 entries are values of 1 MiB, 12 to a chunk: the restore holds two
    chunks at most and the load its byte budget (4 MiB here, for a small test), not the 192 MiB of
    rows and trie leaves it writes before its root can be compared with the trusted app hash."""
    h = chain_with_snapshots(tmp_path)
    snapshot = h.app.list_snapshots(abci.RequestListSnapshots()).snapshots[-1]
    large = [b"".join(encode_entry(b"zz/%04d" % i, bytes([i]) * (1 << 20)) for i in range(start, start + 12))
             for start in range(0, 96, 12)]
    app = joiner(tmp_path)
    budget = 4 << 20
    app.store.bulk_load = functools.partial(app.store.bulk_load, max_bytes=budget)  # type: ignore[method-assign]
    assert offer(app, forged(snapshot, large), h.store.app_hash) == OFFER.ACCEPT
    tracemalloc.start()
    try:
        results = [apply(app, i, c).result for i, c in enumerate(large)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert results == [CHUNK.ACCEPT] * (len(large) - 1) + [CHUNK.REJECT_SNAPSHOT]
    assert peak < 2 * len(large[0]) + 2 * budget, f"the restore held {peak >> 20} MiB"
    assert_nothing_kept(app, tmp_path / "joiner-snapshots")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_chunk_that_meets_a_full_disk_refuses_the_snapshot(tmp_path: Path) -> None:
    """Keeping a chunk fails with the kernel's own ENOSPC (its file is /dev/full): the snapshot is
    refused instead of the node stopped, nothing stays, and the snapshot restores once there is room."""
    h = chain_with_snapshots(tmp_path)
    snapshot = h.app.list_snapshots(abci.RequestListSnapshots()).snapshots[-1]
    chunks = chunks_of(h.app, snapshot)
    app = joiner(tmp_path)
    assert offer(app, snapshot, h.store.app_hash) == OFFER.ACCEPT
    (tmp_path / "joiner-snapshots" / "restoring" / "1.chunk").symlink_to("/dev/full")
    assert [apply(app, 0, chunks[0]).result, apply(app, 1, chunks[1]).result] == [
        CHUNK.ACCEPT, CHUNK.REJECT_SNAPSHOT]
    assert_nothing_kept(app, tmp_path / "joiner-snapshots")
    assert offer(app, snapshot, h.store.app_hash) == OFFER.ACCEPT
    assert all(apply(app, i, c).result == CHUNK.ACCEPT for i, c in enumerate(chunks))
    assert app.store.app_hash == h.store.app_hash


def test_offers_that_cannot_be_restored_are_refused(tmp_path: Path) -> None:
    h = chain_with_snapshots(tmp_path)
    snapshot = h.app.list_snapshots(abci.RequestListSnapshots()).snapshots[-1]
    app = joiner(tmp_path)
    trusted = h.store.app_hash

    def variant(**fields: object) -> abci.Snapshot:
        s = abci.Snapshot()
        s.CopyFrom(snapshot)
        for k, v in fields.items():
            setattr(s, k, v)
        return s

    assert offer(app, variant(format=2), trusted) == OFFER.REJECT_FORMAT
    assert offer(app, variant(hash=b"\1" * 32), trusted) == OFFER.REJECT
    assert offer(app, variant(chunks=snapshot.chunks + 1), trusted) == OFFER.REJECT
    assert offer(app, snapshot, b"") == OFFER.REJECT
    junk = b"\x92" + b"\xc4\x20" + b"\0" * 32
    assert offer(app, variant(metadata=junk, hash=hashlib.sha256(junk).digest()), trusted) == OFFER.REJECT
    for hashes in (5, 0, "x" * 32, {b"k": b"v"}, [b"\0" * 32, 7], [[b"\0" * 32]], b"\0" * 32):
        # each refused: a TypeError escaping OfferSnapshot reached CometBFT as an exception response,
        # on which it stops, so one peer's snapshot stopped every node that joined by state sync
        forged = msgpack.packb([1, hashes, 0, CHAIN_ID], use_bin_type=True)
        assert offer(app, variant(metadata=forged, hash=hashlib.sha256(forged).digest(), chunks=1),
                     trusted) == OFFER.REJECT, hashes
    other = Metadata(Metadata.decode(snapshot.metadata).chunk_hashes, 0, "another-chain").encode()
    assert offer(app, variant(metadata=other, hash=hashlib.sha256(other).digest()), trusted) == OFFER.REJECT
    assert apply(app, 0, b"").result == CHUNK.ABORT  # nothing accepted
    assert offer(h.app, snapshot, trusted) == OFFER.ABORT  # a node with state never restores


def test_commit_retains_the_last_blocks_and_every_block_a_kept_snapshot_needs(tmp_path: Path) -> None:
    h = AppHarness(sqlite_url(tmp_path))
    h.app.retain_blocks = 5
    retained = []
    for _ in range(12):
        h.block()
        retained.append(h.app._retain_height())
    assert retained == [1, 1, 1, 1, 1, 2, 3, 4, 5, 6, 7, 8]
    h.app.snapshots = Snapshots(tmp_path / "snapshots", interval=10)
    h.block()
    h.app.snapshots.wait()
    h.block()
    h.block()
    assert h.app.snapshots.heights() == [] and h.app._retain_height() == 11  # no snapshot: 13 is not due
    for _ in range(5):
        h.block()
    h.app.snapshots.wait()
    assert h.app.snapshots.heights() == [20] and h.app._retain_height() == 16
    for _ in range(4):
        h.block()
    assert h.app._retain_height() == 20
    h.app.retain_blocks = 2
    assert h.app._retain_height() == 20  # the snapshot's height, not 23


def test_snapshot_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="interval must be at least 0"):
        Snapshots(tmp_path, interval=-1)
    with pytest.raises(ValueError, match="chunk_bytes must be within"):
        Snapshots(tmp_path, chunk_bytes=10)
    with pytest.raises(ValueError, match="retain_blocks must be at least 0"):
        Application(StateStore(sqlite_url(tmp_path)), retain_blocks=-1)
