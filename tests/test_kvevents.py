"""vLLM's KV-event wire format (both shapes, int and bytes hashes), rejection of malformed payloads, the
ZMQ publisher/subscriber with gap detection and replay, and the prefix mirror built from the events."""

from __future__ import annotations

import asyncio
import hashlib
import math
import threading
import time

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio
from waiting import run, until

from planetserve.node.engine.base import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from planetserve.node.engine.kvcache import PrefixCache, block_hashes
from planetserve.node.engine.kvevents import (
    END_SEQ,
    HASH_MASK,
    KVEventBatch,
    KVEventError,
    KVEventLimits,
    KVEventPublisher,
    KVEventSubscriber,
    PrefixChange,
    PrefixMirror,
    decode_batch,
    decode_frames,
    encode_batch,
    encode_frames,
    normalise_hash,
)
from planetserve.node.tasks import stop_tasks

LOOPBACK = "tcp://127.0.0.1:*"
TOKENS = tuple(range(100, 132))
EVENTS: list[CacheEvent] = [
    BlockStored((11, 12), None, TOKENS, 16),
    BlockStored((13,), 12, tuple(range(16)), 16),
    BlockRemoved((13, 12)),
    AllBlocksCleared(),
]


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# -- wire format ------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["array", "map"])
def test_round_trip(form: str) -> None:
    batch = decode_batch(encode_batch(EVENTS, ts=12.5, data_parallel_rank=3, form=form))  # type: ignore[arg-type]
    assert batch == KVEventBatch(12.5, tuple(EVENTS), 3)


def test_array_form_matches_vllm_field_order() -> None:
    raw = msgpack.unpackb(encode_batch(EVENTS[:3], ts=1.0, data_parallel_rank=0))
    assert raw == [
        1.0,
        [
            ["BlockStored", [11, 12], None, list(TOKENS), 16, None, "GPU", None],
            ["BlockStored", [13], 12, list(range(16)), 16, None, "GPU", None],
            ["BlockRemoved", [13, 12], "GPU"],
        ],
        0,
    ]


def test_map_form_matches_vllm_field_names() -> None:
    raw = msgpack.unpackb(encode_batch(EVENTS[2:], ts=1.0, form="map"))
    assert raw == {
        "ts": 1.0,
        "events": [{"type": "BlockRemoved", "block_hashes": [13, 12], "medium": "GPU"}, {"type": "AllBlocksCleared"}],
        "data_parallel_rank": 0,
    }


def test_legacy_vllm_payload_without_medium_or_rank() -> None:
    """vLLM 0.9: [ts, events] and BlockStored ending at lora_id."""
    payload = pack([1.5, [["BlockStored", [7, 8], None, list(range(8)), 4, None], ["BlockRemoved", [8]],
                          ["AllBlocksCleared"]]])
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == (BlockStored((7, 8), None, tuple(range(8)), 4), BlockRemoved((8,)), AllBlocksCleared())


def test_vllm_026_payload_array_batch_with_map_events() -> None:
    """As captured from vLLM 0.26 (volcano-sh/kthena#1535): map events with the newest fields, a hash
    above 2**63, inside a still positional batch."""
    tokens = [151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198, 151644, 77091, 198, 151667]
    event = {
        "type": "BlockStored", "block_hashes": [15760518052499183552], "parent_block_hash": None,
        "token_ids": tokens, "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
        "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention",
    }
    batch = decode_batch(pack([1789095808.8378847, [event], 0]))
    assert batch.events == (BlockStored((15760518052499183552,), None, tuple(tokens), 16),)
    assert batch.data_parallel_rank == 0 and batch.skipped == 0


def test_bytes_hashes_normalise_like_vllm_int_mode() -> None:
    """Without VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES vLLM sends the digest; with it, the digest's low 64
    bits as an int. Both must give the same mirror keys."""
    digests = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    as_int = [int.from_bytes(d, "big") & HASH_MASK for d in digests]
    payload = pack([0.0, [["BlockStored", digests[1:], digests[0], list(range(8)), 4, None, "GPU", None],
                          ["BlockRemoved", [digests[2]], "GPU"]], 0])
    batch = decode_batch(payload)
    assert batch.events == (BlockStored(tuple(as_int[1:]), as_int[0], tuple(range(8)), 4), BlockRemoved((as_int[2],)))
    assert normalise_hash(as_int[0]) == normalise_hash(digests[0])


def test_negative_hashes_from_old_vllm_wrap_to_unsigned() -> None:
    assert normalise_hash(-1) == HASH_MASK
    with pytest.raises(KVEventError, match="outside 64 bits"):
        normalise_hash(1 << 64)
    batch = decode_batch(pack([0.0, [["BlockRemoved", [-2]]]]))
    assert batch.events == (BlockRemoved((HASH_MASK - 1,)),)


def test_map_batch_form() -> None:
    payload = pack({"ts": 2, "events": [{"type": "AllBlocksCleared"}]})
    assert decode_batch(payload) == KVEventBatch(2.0, (AllBlocksCleared(),), None)


def test_untracked_caches_are_skipped() -> None:
    """LoRA blocks, offloaded copies and other KV groups are not the base model's device prefix cache."""
    stored = ["BlockStored", [1], None, [0, 1], 2]
    payload = pack([0.0, [
        [*stored, 5, "GPU", None],
        [*stored, None, "GPU", "my-lora"],
        [*stored, None, "CPU", None],
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [0, 1],
         "block_size": 2, "group_idx": 1},
        ["BlockRemoved", [1], "CPU"],
        [*stored, None, "GPU", None],
    ]])
    batch = decode_batch(payload)
    assert batch.events == (BlockStored((1,), None, (0, 1), 2),)
    assert batch.skipped == 5


GARBAGE: list[tuple[str, bytes, str]] = [
    ("not msgpack", b"\xc1\x00", "not valid msgpack"),
    ("truncated", encode_batch(EVENTS)[:-3], "not valid msgpack"),
    ("trailing bytes", encode_batch(EVENTS) + b"\x00", "trailing bytes"),
    ("scalar batch", pack(5), "batch must be an array or a map"),
    ("short batch", pack([1.0]), r"\[ts, events, dp_rank\?\]"),
    ("map batch without events", pack({"ts": 1.0}), "needs 'ts' and 'events'"),
    ("ts is a bool", pack([True, []]), "finite number"),
    ("ts is NaN", pack([math.nan, []]), "finite number"),
    ("events not an array", pack([1.0, {"a": 1}]), "events must be an array"),
    ("negative dp rank", pack([1.0, [], -1]), "data_parallel_rank"),
    ("event is a number", pack([1.0, [3]]), "event 0: must be an array or a map"),
    ("untagged array event", pack([1.0, [[1, 2]]]), "must start with its type name"),
    ("unknown tag", pack([1.0, [["BlockMoved", [1]]]]), "unknown event type 'BlockMoved'"),
    ("map event without type", pack([1.0, [{"block_hashes": [1]}]]), "needs a string 'type'"),
    ("map event missing field", pack([1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 1}]]),
     "missing field 'parent_block_hash'"),
    ("too few fields", pack([1.0, [["BlockStored", [1], None, [0]]]]), "3 fields, needs 4"),
    ("empty hash list", pack([1.0, [["BlockRemoved", []]]]), "non-empty array"),
    ("hash is a string", pack([1.0, [["BlockRemoved", ["ab"]]]]), "int or bytes, got str"),
    ("hash bytes too long", pack([1.0, [["BlockRemoved", [b"x" * 65]]]]), "65 bytes"),
    ("block size zero", pack([1.0, [["BlockStored", [1], None, [], 0, None]]]), "block_size 0 outside"),
    ("token count mismatch", pack([1.0, [["BlockStored", [1, 2], None, [0, 1, 2], 2, None]]]),
     r"3 token ids for 2 blocks of 2 \(expected 4\)"),
    ("negative token id", pack([1.0, [["BlockStored", [1], None, [-1, 0], 2, None]]]), r"\[0, 2\*\*32\)"),
    ("repeated hash", pack([1.0, [["BlockStored", [1, 1], None, [0, 1], 1, None]]]), "repeats"),
    ("parent inside chain", pack([1.0, [["BlockStored", [1, 2], 2, [0, 1], 1, None]]]), "repeats"),
    ("medium not a string", pack([1.0, [["BlockRemoved", [1], 7]]]), "medium must be a string"),
]


@pytest.mark.parametrize(("payload", "message"), [(p, m) for _, p, m in GARBAGE], ids=[n for n, _, _ in GARBAGE])
def test_garbage_is_rejected_with_a_specific_error(payload: bytes, message: str) -> None:
    with pytest.raises(KVEventError, match=message):
        decode_batch(payload)


def test_size_limits() -> None:
    with pytest.raises(KVEventError, match="payload of 553 bytes exceeds 64"):
        decode_batch(pack([1.0, [["AllBlocksCleared"]] * 30]), KVEventLimits(max_payload_bytes=64))
    small = KVEventLimits(max_events=2, max_hashes_per_event=2, max_tokens_per_event=4)
    with pytest.raises(KVEventError, match="3 events in one batch, at most 2"):
        decode_batch(pack([1.0, [["AllBlocksCleared"]] * 3]), small)
    with pytest.raises(KVEventError, match="3 block hashes, at most 2"):
        decode_batch(pack([1.0, [["BlockRemoved", [1, 2, 3]]]]), small)
    with pytest.raises(KVEventError, match="not valid msgpack"):  # an array header claiming 2**20 items
        decode_batch(b"\x92\xcb" + bytes(8) + b"\xdd\x00\x10\x00\x00", small)


def test_frames() -> None:
    frames = encode_frames("kv-events", 258, b"payload")
    assert frames == [b"kv-events", bytes(6) + b"\x01\x02", b"payload"]
    assert decode_frames(frames) == ("kv-events", 258, b"payload")
    with pytest.raises(KVEventError, match="expected 3 frames"):
        decode_frames(frames[:2])
    with pytest.raises(KVEventError, match="must be 8 bytes"):
        decode_frames([b"t", b"\x01", b""])


# -- publisher and subscriber -----------------------------------------------------------------------


class Collector:
    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.batches: list[KVEventBatch] = []
        self.resyncs: list[str] = []

    def batch(self, seq: int, batch: KVEventBatch) -> None:
        self.seqs.append(seq)
        self.batches.append(batch)

    def resync(self, reason: str) -> None:
        self.resyncs.append(reason)

    def subscriber(self, publisher: KVEventPublisher | None, **options: object) -> KVEventSubscriber:
        endpoint = publisher.endpoint if publisher is not None else "tcp://127.0.0.1:1"
        replay = publisher.replay_endpoint if publisher is not None else None
        return KVEventSubscriber(endpoint, on_batch=self.batch, on_resync=self.resync,
                                 replay_endpoint=replay, **options)  # type: ignore[arg-type]


def stored(i: int) -> list[CacheEvent]:
    return [BlockStored((1000 + i,), None, (i, i), 2)]


async def publish_until_seen(publisher: KVEventPublisher, got: Collector, first: int = 0) -> int:
    """Publish batches `first`, `first` + 1, ... until the subscriber has one (a PUB socket drops what
    it sends before a subscription reaches it); the number of the next batch to publish."""
    i = first
    while not got.seqs:
        publisher.publish(stored(i))
        i += 1
        await asyncio.sleep(0.02)
    return i


def test_stream_in_order_over_zmq_and_late_join_is_replayed() -> None:
    async def body() -> None:
        publisher = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
        got = Collector()
        subscriber = got.subscriber(publisher)
        try:
            for i in range(3):  # nobody listens yet: only the replay buffer keeps these
                publisher.publish(stored(i))
            await until(lambda: publisher.sent == 3)
            subscriber.start()
            i = await publish_until_seen(publisher, got, 3)
            publisher.publish(stored(i))
            await until(lambda: got.seqs and got.seqs[-1] == i)
            assert got.seqs == list(range(i + 1))
            assert [b.events for b in got.batches] == [tuple(stored(n)) for n in range(i + 1)]
            assert got.resyncs == [] and subscriber.stats.replayed >= 3
            stats = subscriber.stats
            assert (stats.gaps, stats.gaps_replayed, stats.gaps_cleared) == (1, 1, 0)
        finally:
            await subscriber.close()
            publisher.close()

    run(body(), 30)


def test_gap_is_filled_from_the_replay_buffer() -> None:
    async def body() -> None:
        publisher = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
        got = Collector()
        subscriber = got.subscriber(publisher)
        try:
            for i in range(4):
                publisher.publish(stored(i))
            await until(lambda: publisher.sent == 4)
            await subscriber.handle(0, encode_batch(stored(0)))
            await subscriber.handle(3, encode_batch(stored(3)))  # 1 and 2 were lost
            assert got.seqs == [0, 1, 2, 3]
            assert [b.events for b in got.batches] == [tuple(stored(n)) for n in range(4)]
            stats = subscriber.stats
            assert (stats.gaps, stats.gaps_replayed, stats.gaps_cleared, stats.replayed) == (1, 1, 0, 2)
            assert got.resyncs == []
            await subscriber.handle(3, encode_batch(stored(3)))  # a duplicate changes nothing
            assert got.seqs == [0, 1, 2, 3]
        finally:
            publisher.close()

    run(body(), 30)


@pytest.mark.parametrize(("buffer_steps", "published", "arriving", "seqs", "reason", "replayed"), [
    (2, 6, 6, [0, 4, 5, 6], "batches 1..5 were missed and the replay buffer holds them only from 4", 2),
    (1, 4, 3, [0, 3], "batches 1..2 were missed and the replay buffer holds none of them", 0),
])
def test_gap_beyond_the_replay_buffer_resyncs_then_applies_what_the_buffer_holds(
        buffer_steps: int, published: int, arriving: int, seqs: list[int], reason: str, replayed: int) -> None:
    async def body() -> None:
        publisher = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=buffer_steps)
        got = Collector()
        subscriber = got.subscriber(publisher)
        try:
            for i in range(published):
                publisher.publish(stored(i))
            await until(lambda: publisher.sent == published)
            await subscriber.handle(0, encode_batch(stored(0)))
            await subscriber.handle(arriving, encode_batch(stored(arriving)))
            assert got.seqs == seqs and got.resyncs == [reason]
            stats = subscriber.stats
            assert (stats.gaps, stats.gaps_replayed, stats.gaps_cleared, stats.replayed) == (1, 0, 1, replayed)
        finally:
            publisher.close()

    run(body(), 30)


def test_gap_without_replay_undecodable_batch_and_restart_ask_for_resyncs() -> None:
    async def body() -> None:
        got = Collector()
        subscriber = got.subscriber(None)
        await subscriber.handle(0, encode_batch(stored(0)))
        await subscriber.handle(2, encode_batch(stored(2)))
        assert got.resyncs == ["batches 1..1 were missed and there is no replay endpoint"]
        await subscriber.handle(3, b"\xc1garbage")
        assert got.resyncs[-1] == "batch 3 could not be decoded" and got.seqs == [0, 2]
        await subscriber.handle(0, encode_batch(stored(9)))
        assert got.resyncs[-1] == "publisher restarted (seq 0 after 3)" and got.seqs == [0, 2, 0]
        assert subscriber.stats.resyncs == 3

        def failing(seq: int, batch: KVEventBatch) -> None:
            got.seqs.append(seq)
            raise RuntimeError("consumer bug")

        subscriber = KVEventSubscriber("tcp://127.0.0.1:1", on_batch=failing)
        await subscriber.handle(0, encode_batch(stored(0)))
        await subscriber.handle(1, encode_batch(stored(1)))  # still following after the consumer raised
        assert got.seqs[-2:] == [0, 1]

    run(body(), 30)


def test_replay_timeout_asks_for_a_resync() -> None:
    async def body() -> None:
        got = Collector()
        subscriber = KVEventSubscriber("tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:1",
                                       on_batch=got.batch, on_resync=got.resync, replay_timeout=0.2)
        await subscriber.handle(5, encode_batch(stored(5)))
        assert got.seqs == [5]
        assert got.resyncs == ["batches 0..4 were missed and the replay endpoint did not answer within 0.2 s"]
        assert (subscriber.stats.gaps, subscriber.stats.gaps_cleared) == (1, 1)

    run(body(), 30)


def test_a_gap_longer_than_max_replay_batches_asks_only_for_its_last_batches() -> None:
    async def body() -> None:
        publisher = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
        got = Collector()
        subscriber = got.subscriber(publisher, limits=KVEventLimits(max_replay_batches=2))
        try:
            for i in range(6):
                publisher.publish(stored(i))
            await until(lambda: publisher.sent == 6)
            await subscriber.handle(0, encode_batch(stored(0)))
            await subscriber.handle(5, encode_batch(stored(5)))
            assert got.seqs == [0, 3, 4, 5]
            assert got.resyncs == ["batches 1..4 were missed and the replay buffer holds them only from 3"]
        finally:
            publisher.close()

    run(body(), 30)


def test_a_replay_past_its_byte_limit_resyncs() -> None:
    async def body() -> None:
        publisher = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
        got = Collector()
        limit = 2 * len(encode_batch(stored(1)))
        subscriber = got.subscriber(publisher, limits=KVEventLimits(max_replay_bytes=limit))
        try:
            for i in range(5):
                publisher.publish(stored(i))
            await until(lambda: publisher.sent == 5)
            await subscriber.handle(0, encode_batch(stored(0)))
            await subscriber.handle(4, encode_batch(stored(4)))  # 1..3 weigh more than the limit
            assert got.seqs == [0, 4]
            assert got.resyncs == [f"batches 1..3 were missed and replay failed: the replay exceeds {limit} bytes"]
        finally:
            publisher.close()

    run(body(), 30)


REPLAY = encode_batch(stored(1))
# what a misbehaving replay endpoint answers a request for batches 1..3, and why that replay failed
BAD_REPLAYS: list[tuple[str, list[list[bytes]], str]] = [
    ("malformed", [[b"\x01"]], "malformed replay reply"),
    ("repeating", [[(0).to_bytes(8, "big"), REPLAY]] * 1000, "the replay sent batch 0 where 1 or later was due"),
    ("hole", [[(1).to_bytes(8, "big"), REPLAY], [(3).to_bytes(8, "big"), REPLAY]],
     "the replay skipped from batch 1 to 3"),
    ("cut short", [[(1).to_bytes(8, "big"), REPLAY], [END_SEQ, b""]], "the replay skipped from batch 1 past 3"),
]


@pytest.mark.parametrize(("replies", "message"), [case[1:] for case in BAD_REPLAYS],
                         ids=[case[0] for case in BAD_REPLAYS])
def test_a_misbehaving_replay_endpoint_resyncs(replies: list[list[bytes]], message: str) -> None:
    async def body() -> None:
        router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")

        async def answer() -> None:
            identity, _, _start = await router.recv_multipart()
            for frames in replies:
                await router.send_multipart([identity, b"", *frames])

        got = Collector()
        subscriber = KVEventSubscriber("tcp://127.0.0.1:1", replay_endpoint=f"tcp://127.0.0.1:{port}",
                                       on_batch=got.batch, on_resync=got.resync)
        server = asyncio.get_running_loop().create_task(answer())
        try:
            await subscriber.handle(0, encode_batch(stored(0)))
            await subscriber.handle(4, encode_batch(stored(4)))
            assert got.seqs == [0, 4]
            assert got.resyncs == [f"batches 1..3 were missed and replay failed: {message}"]
        finally:
            await stop_tasks([server])
            router.close(linger=0)

    run(body(), 30)


# -- lost batches over real sockets ------------------------------------------------------------------


class LossyLink:
    """A real hop between a publisher and its subscribers that loses the batches it is told to, as a
    congested link or a subscriber past its high-water mark does; replay requests bypass it."""

    def __init__(self, upstream: str) -> None:
        ctx = zmq.Context.instance()
        self._in = ctx.socket(zmq.SUB)
        self._in.setsockopt(zmq.SUBSCRIBE, b"")
        self._in.connect(upstream)
        self._out = ctx.socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{self._out.bind_to_random_port('tcp://127.0.0.1')}"
        self.dropped: list[int] = []
        self._to_drop = 0
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def drop_next(self, count: int) -> None:
        with self._lock:
            self._to_drop = count

    def close(self) -> None:
        self._running = False
        self._thread.join(5)

    def _run(self) -> None:
        while self._running:
            if not self._in.poll(20):
                continue
            frames = self._in.recv_multipart()
            with self._lock:
                drop, self._to_drop = self._to_drop > 0, max(0, self._to_drop - 1)
            if drop:
                self.dropped.append(int.from_bytes(frames[1], "big"))
            else:
                self._out.send_multipart(frames)
        self._in.close(linger=0)
        self._out.close(linger=0)


def chain_tokens(cache: PrefixCache, h: int) -> tuple[int, ...]:
    block = cache.block(h)
    return chain_tokens(cache, block.parent) + block.token_ids if block.parent is not None else block.token_ids


def mirrors(mirror: PrefixMirror, cache: PrefixCache) -> bool:
    """The mirror holds exactly the cache's blocks, each a usable prefix of the cache's tokens."""
    return len(mirror) == len(cache) and all(mirror.prefix(h) == chain_tokens(cache, h) for h in cache)


class Served:
    """A prefix cache behind a real publisher (with replay), a lossy link, and a mirror that follows the
    link: the pieces of a model node in front of `vllm serve`. Each step caches one new 2-block prompt
    (with a shared first block when `shared`), one published batch; a full cache evicts the oldest."""

    def __init__(self, capacity_prompts: int, buffer_steps: int = 10_000, shared: bool = False,
                 replay_endpoint: str | None = None, replay_timeout: float = 2.0) -> None:
        blocks = capacity_prompts + 1 if shared else 2 * capacity_prompts
        self.cache = PrefixCache(block_size=2, capacity_tokens=2 * blocks)
        self.publisher = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=buffer_steps)
        self.cache.subscribe(self.publisher.publish)
        self.link = LossyLink(self.publisher.endpoint)
        self.mirror = PrefixMirror()
        self.resyncs: list[str] = []
        self.subscriber = KVEventSubscriber(
            self.link.endpoint, replay_endpoint=replay_endpoint or self.publisher.replay_endpoint,
            replay_timeout=replay_timeout, on_batch=lambda _, batch: self.mirror.apply(batch.events),
            on_resync=self.resync)
        self.shared = shared
        self.steps = 0
        self.last_prompt: tuple[int, ...] = ()

    def resync(self, reason: str) -> None:
        self.resyncs.append(reason)
        self.mirror.clear()

    def step(self) -> int:
        """Serve one prompt; returns the sequence number of its batch."""
        first = (1, 1) if self.shared else (2 * self.steps + 10, 0)
        prompt = (*first, 2 * self.steps + 11, 2 * self.steps + 12)
        self.cache.insert(prompt, lambda _: torch.zeros(1))
        self.last_prompt = prompt
        self.cache.flush()
        self.steps += 1
        return self.steps - 1

    async def step_and_wait(self) -> int:
        seq = self.step()
        await until(lambda: self.subscriber.last_seq == seq)
        return seq

    async def connect(self) -> None:
        """Serve until the subscriber follows the link (ZMQ's late joiners miss what was sent first)."""
        self.subscriber.start()
        while self.subscriber.last_seq is None:
            self.step()
            await asyncio.sleep(0.05)
        await until(lambda: self.subscriber.last_seq == self.steps - 1)

    async def close(self) -> None:
        await self.subscriber.close()
        self.link.close()
        self.publisher.close()


def test_batches_lost_on_the_way_are_replayed_and_the_mirror_matches_the_cache() -> None:
    async def body() -> None:
        served = Served(capacity_prompts=3, shared=True)
        try:
            await served.connect()
            before = served.subscriber.stats.gaps_replayed  # a late join may have been replayed already
            evictions = served.cache.stats.evictions
            served.link.drop_next(4)
            for _ in range(4):
                served.step()
            seq = await served.step_and_wait()
            assert served.link.dropped == list(range(seq - 4, seq))
            assert served.cache.stats.evictions > evictions  # the lost batches removed blocks too
            stats = served.subscriber.stats
            assert (stats.gaps_replayed - before, stats.gaps_cleared, served.resyncs) == (1, 0, [])
            assert mirrors(served.mirror, served.cache)
        finally:
            await served.close()

    run(body(), 60)


def test_a_gap_beyond_the_replay_buffer_clears_and_the_mirror_follows_the_cache_again() -> None:
    async def body() -> None:
        served = Served(capacity_prompts=3, buffer_steps=3)
        try:
            await served.connect()
            stale = set(served.cache)
            served.link.drop_next(6)
            for _ in range(6):
                served.step()
            seq = await served.step_and_wait()
            # the buffer held the gap's last two batches: applied after the clear, they give the mirror
            # the cache's three prompts, and nothing from before the gap survives
            assert served.resyncs == [f"batches {seq - 6}..{seq - 1} were missed and the replay buffer "
                                      f"holds them only from {seq - 2}"]
            assert served.subscriber.stats.gaps_cleared == 1 and served.subscriber.stats.replayed >= 2
            assert mirrors(served.mirror, served.cache) and not stale & set(served.cache)
            for _ in range(3):
                await served.step_and_wait()
            assert mirrors(served.mirror, served.cache)
        finally:
            await served.close()

    run(body(), 60)


def test_a_replay_endpoint_that_does_not_answer_clears_within_the_timeout() -> None:
    async def body() -> None:
        silent = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        served = Served(capacity_prompts=3, replay_endpoint=f"tcp://127.0.0.1:{port}", replay_timeout=0.5)
        try:
            await served.connect()
            cleared = served.subscriber.stats.gaps_cleared  # a late join asked the silent endpoint too
            served.link.drop_next(1)
            served.step()
            started = time.monotonic()
            seq = await served.step_and_wait()
            waited = time.monotonic() - started
            assert served.subscriber.stats.gaps_cleared == cleared + 1
            assert served.resyncs[-1] == (f"batches {seq - 1}..{seq - 1} were missed and the replay endpoint "
                                          "did not answer within 0.5 s")
            assert 0.5 <= waited < 2.0
            _identity, _, start = await silent.recv_multipart()  # it was asked, and kept silent
            assert int.from_bytes(start, "big") <= seq - 1
            # cleared, then only the batch after the gap
            assert len(served.mirror) == 2
            assert served.mirror.prefix(block_hashes(served.last_prompt, 2)[-1]) == served.last_prompt
        finally:
            await served.close()
            silent.close(linger=0)

    run(body(), 60)


def test_subscriber_ignores_other_topics_and_malformed_frames() -> None:
    async def body() -> None:
        publisher = KVEventPublisher(LOOPBACK, topic="kv-events")
        got = Collector()
        subscriber = KVEventSubscriber(publisher.endpoint, on_batch=got.batch, topic="kv")
        raw = zmq.Context.instance().socket(zmq.PUB)
        port = raw.bind_to_random_port("tcp://127.0.0.1")
        other = KVEventSubscriber(f"tcp://127.0.0.1:{port}", on_batch=got.batch, topic="kv")
        try:
            subscriber.start()
            other.start()
            for _ in range(20):
                publisher.publish(stored(0))  # topic "kv-events" passes the "kv" prefix filter only
                raw.send_multipart([b"kv", b"\x00"])
                await asyncio.sleep(0.02)
            assert got.seqs == [] and subscriber.stats.other_topics > 0 and other.stats.malformed > 0
        finally:
            await subscriber.close()
            await other.close()
            raw.close(linger=0)
            publisher.close()

    run(body(), 30)


# -- the mirror -------------------------------------------------------------------------------------


def block(h: int, parent: int | None, tokens: tuple[int, ...]) -> BlockStored:
    return BlockStored((h,), parent, tokens, len(tokens))


def test_mirror_reports_maximal_added_and_minimal_removed_prefixes() -> None:
    mirror = PrefixMirror()
    chain = BlockStored((1, 2, 3), None, tuple(range(12)), 4)
    assert mirror.apply([chain]) == [PrefixChange(True, tuple(range(12)))]
    assert mirror.prefix(2) == tuple(range(8))
    assert mirror.match_length(list(range(12)) + [99]) == 12
    assert mirror.match_length([0, 1, 2, 3, 9, 9, 9, 9]) == 4
    assert mirror.apply([block(4, 2, (50, 51, 52, 53))]) == [PrefixChange(True, (*range(8), 50, 51, 52, 53))]
    assert sorted(mirror.cached_prefixes()) == sorted([tuple(range(12)), (*range(8), 50, 51, 52, 53)])

    assert mirror.apply([BlockRemoved((2,))]) == [PrefixChange(False, tuple(range(8)))]
    assert mirror.cached_prefixes() == [tuple(range(4))]
    assert mirror.prefix(3) is None and mirror.match_length(range(12)) == 4
    assert mirror.apply([BlockRemoved((3, 77))]) == []  # unusable or unknown: nothing to report

    # block 2 comes back: block 4, which stayed, is usable again
    assert mirror.apply([block(2, 1, (4, 5, 6, 7))]) == [PrefixChange(True, (*range(8), 50, 51, 52, 53))]
    assert mirror.apply([AllBlocksCleared()]) == [PrefixChange(False, ())]
    assert len(mirror) == 0 and mirror.apply([AllBlocksCleared()]) == []


def test_mirror_orphans_conflicts_and_bounds() -> None:
    mirror = PrefixMirror(max_blocks=3)
    assert mirror.apply([block(5, 4, (9, 9))]) == []  # its parent is unknown
    assert mirror.apply([block(4, None, (8, 8))]) == [PrefixChange(True, (8, 8, 9, 9))]
    # the same hash stored again with other content replaces the old block
    assert mirror.apply([block(4, None, (7, 7))]) == [PrefixChange(False, (8, 8)), PrefixChange(True, (7, 7, 9, 9))]
    assert mirror.apply([block(6, 5, (1, 1)), block(7, 6, (2, 2))]) == [PrefixChange(True, (7, 7, 9, 9, 1, 1))]
    assert mirror.overflowed == 1 and len(mirror) == 3
    assert mirror.apply([block(8, 8, (0, 0))]) == []  # a block cannot be its own parent


def test_mirror_snapshot_rebuilds_the_same_state() -> None:
    mirror = PrefixMirror()
    mirror.apply([BlockStored((1, 2), None, (1, 2, 3, 4), 2), block(3, 1, (5, 6)), block(9, 8, (7, 7))])
    copy = PrefixMirror()
    copy.apply(mirror.snapshot_events())
    assert sorted(copy.cached_prefixes()) == sorted(mirror.cached_prefixes()) == [(1, 2, 3, 4), (1, 2, 5, 6)]
    assert len(copy) == len(mirror) == 4
    # the orphan is kept and becomes usable when its parent arrives
    assert copy.apply([block(8, None, (0, 0))]) == [PrefixChange(True, (0, 0, 7, 7))]
