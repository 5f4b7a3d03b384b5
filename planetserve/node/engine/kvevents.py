"""vLLM's KV-cache event stream (`--kv-events-config`), both ends, plus a mirror of the cache it describes.

Wire format (vllm/distributed/kv_events.py): ZMQ PUB multipart [topic, 8-byte big-endian sequence number,
msgpack payload]. The payload is a msgspec `KVEventBatch`, `[ts, [event...], data_parallel_rank]` while
the structs had `array_like=True`. vLLM PR 42892 (mid 2026, e.g. 0.26) dropped that from the events, which
became maps tagged under "type" inside a still positional batch; current main has dropped it from the
batch too ({"ts", "events", "data_parallel_rank"}). Array events carry their tag first:
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, ...]`,
`["BlockRemoved", block_hashes, medium, ...]`, `["AllBlocksCleared"]`. The decoder accepts every mix of
the two shapes; the encoder writes either one.

Block hashes are ints, or bytes when vLLM runs without VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES. Both are
normalised to vLLM's own int form, `int.from_bytes(h, "big") & (2**64 - 1)` (negative ints from old
releases that used Python's `hash()` wrap the same way), so either setting yields identical hashes.

Replay (`replay_endpoint`): a ROUTER that answers [identity, b"", start_seq] with [identity, b"", seq,
payload] for every buffered batch from start_seq on, then [identity, b"", -1 (signed), b""]. vLLM keeps
the last `buffer_steps` batches (10,000 by default) and serves the whole buffer from start_seq on,
batches published after the gap included; a batch older than the buffer is simply not sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import zmq
import zmq.asyncio

from planetserve.node.engine.base import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from planetserve.node.tasks import stop_tasks

log = logging.getLogger(__name__)

HASH_MASK = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)
TRACKED_MEDIA = (None, "GPU")
"""Only the device prefix cache is mirrored: offloaded copies (medium "CPU" etc.) have their own
lifecycle and would make a GPU eviction look like a cache hit."""

WireForm = Literal["array", "map"]


class KVEventError(ValueError):
    """A KV-event message that does not follow the wire format; the text says which part and why."""


@dataclass(frozen=True)
class KVEventLimits:
    """Bounds on what a publisher may make us allocate; a message past any of them is rejected whole."""

    max_payload_bytes: int = 32 << 20
    max_events: int = 65_536
    max_hashes_per_event: int = 65_536
    max_tokens_per_event: int = 1 << 22
    max_block_size: int = 4096
    max_hash_bytes: int = 64
    max_fields: int = 32
    max_replay_batches: int = 10_000
    """Batches asked for after one gap (vLLM's default `buffer_steps`): a longer gap is cleared and only
    its last batches are replayed."""
    max_replay_bytes: int = 64 << 20
    """Bytes of replies accepted from one replay; a replay past it has failed."""


DEFAULT_LIMITS = KVEventLimits()


@dataclass(frozen=True)
class KVEventBatch:
    ts: float
    events: tuple[CacheEvent, ...]
    data_parallel_rank: int | None = None
    skipped: int = 0
    """Well-formed events about caches we do not mirror (LoRA blocks, other media, other KV groups)."""


# -- encoding ---------------------------------------------------------------------------------------


def _event_to_wire(event: CacheEvent, form: WireForm, medium: str) -> list[Any] | dict[str, Any]:
    if isinstance(event, BlockStored):
        fields: dict[str, Any] = {
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
        }
    elif isinstance(event, BlockRemoved):
        fields = {"block_hashes": list(event.block_hashes), "medium": medium}
    elif isinstance(event, AllBlocksCleared):
        fields = {}
    else:
        raise TypeError(f"not a cache event: {type(event).__name__}")
    tag = type(event).__name__
    if form == "array":
        return [tag, *fields.values()]
    return {"type": tag, **fields}


def encode_batch(
    events: Sequence[CacheEvent],
    *,
    ts: float | None = None,
    data_parallel_rank: int | None = 0,
    form: WireForm = "array",
    medium: str = "GPU",
) -> bytes:
    """The msgpack payload vLLM would publish for these events."""
    wire = [_event_to_wire(e, form, medium) for e in events]
    stamp = time.time() if ts is None else float(ts)
    if form == "array":
        batch: Any = [stamp, wire, data_parallel_rank]
    else:
        batch = {"ts": stamp, "events": wire, "data_parallel_rank": data_parallel_rank}
    return msgpack.packb(batch, use_bin_type=True)


def encode_frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), payload]


def decode_frames(frames: Sequence[bytes]) -> tuple[str, int, bytes]:
    if len(frames) != 3:
        raise KVEventError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise KVEventError(f"sequence frame must be 8 bytes, got {len(seq)}")
    try:
        name = bytes(topic).decode()
    except UnicodeDecodeError as exc:
        raise KVEventError("topic frame is not UTF-8") from exc
    return name, int.from_bytes(seq, "big"), bytes(payload)


# -- decoding ---------------------------------------------------------------------------------------

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}
_FIELDS = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS, "AllBlocksCleared": ()}


def normalise_hash(value: Any, limits: KVEventLimits = DEFAULT_LIMITS) -> int:
    """vLLM's int form of a block hash, whichever way it was sent."""
    if isinstance(value, bool):
        raise KVEventError("block hash is a bool")
    if isinstance(value, int):
        if not -(1 << 63) <= value <= HASH_MASK:
            raise KVEventError(f"block hash {value} is outside 64 bits")
        return value & HASH_MASK
    if isinstance(value, bytes):
        if not 0 < len(value) <= limits.max_hash_bytes:
            raise KVEventError(f"block hash has {len(value)} bytes (1..{limits.max_hash_bytes} allowed)")
        return int.from_bytes(value, "big") & HASH_MASK
    raise KVEventError(f"block hash must be an int or bytes, got {type(value).__name__}")


def _named_fields(raw: Any, index: int, limits: KVEventLimits) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise KVEventError(f"event {index}: an array event must start with its type name")
        tag, values = raw[0], raw[1:]
        if tag not in _FIELDS:
            raise KVEventError(f"event {index}: unknown event type {tag[:40]!r}")
        if len(raw) > limits.max_fields:
            raise KVEventError(f"event {index} ({tag}): {len(raw)} fields, at most {limits.max_fields}")
        names = _FIELDS[tag]
        if len(values) < _REQUIRED[tag]:
            raise KVEventError(f"event {index} ({tag}): {len(values)} fields, needs {_REQUIRED[tag]}")
        return tag, dict(zip(names, values, strict=False))
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise KVEventError(f"event {index}: a map event needs a string 'type'")
        if tag not in _FIELDS:
            raise KVEventError(f"event {index}: unknown event type {tag[:40]!r}")
        for name in _FIELDS[tag][: _REQUIRED[tag]]:
            if name not in raw:
                raise KVEventError(f"event {index} ({tag}): missing field {name!r}")
        return tag, raw
    raise KVEventError(f"event {index}: must be an array or a map, got {type(raw).__name__}")


def _hash_list(value: Any, where: str, limits: KVEventLimits) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise KVEventError(f"{where}: block_hashes must be a non-empty array")
    if len(value) > limits.max_hashes_per_event:
        raise KVEventError(f"{where}: {len(value)} block hashes, at most {limits.max_hashes_per_event}")
    try:
        return tuple(normalise_hash(h, limits) for h in value)
    except KVEventError as exc:
        raise KVEventError(f"{where}: {exc}") from None


def _tracked(fields: dict[str, Any], where: str) -> bool:
    medium = fields.get("medium")
    group = fields.get("group_idx")
    if medium is not None and not isinstance(medium, str):
        raise KVEventError(f"{where}: medium must be a string or nil")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int)):
        raise KVEventError(f"{where}: group_idx must be an int or nil")
    lora = fields.get("lora_id") is not None or fields.get("lora_name") is not None
    return medium in TRACKED_MEDIA and group in (None, 0) and not lora


def _decode_event(raw: Any, index: int, limits: KVEventLimits) -> CacheEvent | None:
    tag, fields = _named_fields(raw, index, limits)
    where = f"event {index} ({tag})"
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = _hash_list(fields["block_hashes"], where, limits)
    if tag == "BlockRemoved":
        return BlockRemoved(hashes) if _tracked(fields, where) else None
    block_size = fields["block_size"]
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise KVEventError(f"{where}: block_size must be an int")
    if not 0 < block_size <= limits.max_block_size:
        raise KVEventError(f"{where}: block_size {block_size} outside 1..{limits.max_block_size}")
    parent_raw = fields["parent_block_hash"]
    try:
        parent = None if parent_raw is None else normalise_hash(parent_raw, limits)
    except KVEventError as exc:
        raise KVEventError(f"{where}: parent_block_hash: {exc}") from None
    tokens = fields["token_ids"]
    if not isinstance(tokens, list):
        raise KVEventError(f"{where}: token_ids must be an array")
    if len(tokens) > limits.max_tokens_per_event:
        raise KVEventError(f"{where}: {len(tokens)} token ids, at most {limits.max_tokens_per_event}")
    if len(tokens) != len(hashes) * block_size:
        raise KVEventError(
            f"{where}: {len(tokens)} token ids for {len(hashes)} blocks of {block_size} "
            f"(expected {len(hashes) * block_size})"
        )
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 32:
            raise KVEventError(f"{where}: token ids must be ints in [0, 2**32)")
    if len(set(hashes)) != len(hashes) or parent in hashes:
        raise KVEventError(f"{where}: a block hash repeats within the chain")
    if not _tracked(fields, where):
        return None
    return BlockStored(hashes, parent, tuple(tokens), block_size)


def decode_batch(payload: bytes, limits: KVEventLimits = DEFAULT_LIMITS) -> KVEventBatch:
    """Parse and validate one payload; raises KVEventError on anything vLLM would not have sent."""
    if len(payload) > limits.max_payload_bytes:
        raise KVEventError(f"payload of {len(payload)} bytes exceeds {limits.max_payload_bytes}")
    max_array = max(limits.max_events, limits.max_hashes_per_event, limits.max_tokens_per_event)
    try:
        raw = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, max_array_len=max_array, max_map_len=limits.max_fields,
            max_str_len=1 << 16, max_bin_len=1 << 16, max_ext_len=0,
        )
    except msgpack.ExtraData as exc:
        raise KVEventError("trailing bytes after the batch") from exc
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise KVEventError(f"payload is not valid msgpack: {exc}") from exc
    if isinstance(raw, list):
        if not 2 <= len(raw) <= 3:
            raise KVEventError(f"batch array must be [ts, events, dp_rank?], got {len(raw)} items")
        ts, events, dp_rank = raw[0], raw[1], raw[2] if len(raw) == 3 else None
    elif isinstance(raw, dict):
        if "ts" not in raw or "events" not in raw:
            raise KVEventError("batch map needs 'ts' and 'events'")
        ts, events, dp_rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        raise KVEventError(f"batch must be an array or a map, got {type(raw).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise KVEventError("batch ts must be a finite number")
    if not isinstance(events, list):
        raise KVEventError("batch events must be an array")
    if len(events) > limits.max_events:
        raise KVEventError(f"{len(events)} events in one batch, at most {limits.max_events}")
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0):
        raise KVEventError("data_parallel_rank must be a non-negative int or nil")
    decoded = [_decode_event(e, i, limits) for i, e in enumerate(events)]
    kept = tuple(e for e in decoded if e is not None)
    return KVEventBatch(float(ts), kept, dp_rank, len(decoded) - len(kept))


# -- publisher --------------------------------------------------------------------------------------


def _binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard or local transports bind, anything else connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Publishes cache events the way vLLM does, so a subscriber cannot tell it from `vllm serve`.

    `publish` may be called from any thread (it is a CacheListeners callback); one worker thread owns
    the sockets, numbers the batches and answers replay requests from a bounded buffer. A batch that
    does not fit the queue is dropped and its sequence number skipped, so subscribers see a gap."""

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        replay_endpoint: str | None = None,
        topic: str = "kv-events",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue: int = 100_000,
        form: WireForm = "array",
        data_parallel_rank: int = 0,
        context: zmq.Context | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._topic = topic
        self._form: WireForm = form
        self._dp_rank = data_parallel_rank
        self._queue: queue.Queue[list[CacheEvent] | None] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._dropped = 0
        self._dropped_lock = threading.Lock()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket | None = None
        try:
            (self._pub.bind if _binds(endpoint) else self._pub.connect)(endpoint)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.sent = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: Iterable[CacheEvent]) -> None:
        batch = list(events)
        if not batch or not self._running:
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            with self._dropped_lock:
                self._dropped += 1
            log.warning("kv-event queue full: dropped a batch of %d events", len(batch))

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then stop."""
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if batch is None:
                return
            with self._dropped_lock:
                seq += self._dropped
                self._dropped = 0
            payload = encode_batch(batch, data_parallel_rank=self._dp_rank, form=self._form)
            try:
                self._pub.send_multipart(encode_frames(self._topic, seq, payload))
            except zmq.ZMQError:
                log.exception("kv-event publish failed (seq %d)", seq)
            self._buffer.append((seq, payload))
            self.sent += 1
            seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a malformed kv-event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", END_SEQ, b""])


# -- subscriber -------------------------------------------------------------------------------------


@dataclass
class SubscriberStats:
    received: int = 0
    replayed: int = 0
    """Batches applied from the replay endpoint."""
    gaps: int = 0
    """Stretches of missed batches (a first batch after 0 included); each is replayed or cleared."""
    gaps_replayed: int = 0
    """Gaps the replay endpoint covered whole, so nothing was lost."""
    gaps_cleared: int = 0
    """Gaps it could not cover: earlier state was declared lost, then what the replay held was applied."""
    resyncs: int = 0
    """Every declaration that earlier state is lost: cleared gaps, undecodable batches, restarts."""
    malformed: int = 0
    other_topics: int = 0  # messages whose topic only shares the subscription's prefix


class KVEventSubscriber:
    """Follows a publisher's stream in order. A gap in the sequence numbers (PUB drops what a slow or
    reconnecting subscriber misses) is filled from the replay endpoint, in order, before the batch that
    revealed it. When it cannot be filled (no replay endpoint, a buffer that no longer holds its start,
    no answer within `replay_timeout`, an answer past the limits), and on an undecodable batch or a
    restarted publisher, `on_resync` is told that earlier state is unknown; after a gap the batches the
    buffer still holds are applied next, since they describe the cache from then on."""

    def __init__(
        self,
        endpoint: str,
        *,
        on_batch: Callable[[int, KVEventBatch], None],
        on_resync: Callable[[str], None] | None = None,
        topic: str = "kv-events",
        replay_endpoint: str | None = None,
        replay_timeout: float = 2.0,
        limits: KVEventLimits = DEFAULT_LIMITS,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.last_seq: int | None = None
        self.stats = SubscriberStats()
        self._on_batch = on_batch
        self._on_resync = on_resync
        self._replay_timeout = replay_timeout
        self._limits = limits
        self._ctx = context or zmq.asyncio.Context.instance()
        self._max_frame = limits.max_payload_bytes + 64
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Connect and start following on the running event loop."""
        if self._task is not None:
            return
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        self._sub = sub
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-event-subscriber")

    async def close(self) -> None:
        if self._task is not None:
            await stop_tasks([self._task])
            self._task = None
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    async def _run(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            try:
                topic, seq, payload = decode_frames(frames)
            except KVEventError as exc:
                self.stats.malformed += 1
                log.warning("dropping a malformed kv-event message: %s", exc)
                continue
            if topic != self.topic:
                self.stats.other_topics += 1
                continue
            self.stats.received += 1
            await self.handle(seq, payload)

    async def handle(self, seq: int, payload: bytes) -> None:
        """Order one message against what came before it (public so tests can inject gaps)."""
        last = self.last_seq
        if last is not None and seq == last:
            return
        if last is not None and seq < last:
            self._resync(f"publisher restarted (seq {seq} after {last})")
            last = None
        start = 0 if last is None else last + 1
        if seq > start:
            await self._recover(start, seq)
        self._deliver(seq, payload)

    def _deliver(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        try:
            batch = decode_batch(payload, self._limits)
        except KVEventError as exc:
            self.stats.malformed += 1
            log.warning("undecodable kv-event batch %d: %s", seq, exc)
            self._resync(f"batch {seq} could not be decoded")
            return
        try:
            self._on_batch(seq, batch)
        except Exception:  # a failing consumer must not stop the stream for the others
            log.exception("kv-event batch consumer failed on batch %d", seq)

    def _resync(self, reason: str) -> None:
        self.stats.resyncs += 1
        log.info("kv-event stream needs a resync: %s", reason)
        if self._on_resync is not None:
            try:
                self._on_resync(reason)
            except Exception:
                log.exception("kv-event resync handler failed")

    async def _recover(self, start: int, end: int) -> None:
        """Batches start..end-1 were missed: apply them from the replay endpoint, or resync and apply the
        part of them it still holds. At most `max_replay_batches` are asked for."""
        self.stats.gaps += 1
        missing = f"batches {start}..{end - 1} were missed"
        if self.replay_endpoint is None:
            self._gap_cleared(f"{missing} and there is no replay endpoint")
            return
        try:
            replayed = await asyncio.wait_for(
                self._fetch_replay(max(start, end - self._limits.max_replay_batches), end),
                self._replay_timeout)
        except TimeoutError:
            self._gap_cleared(f"{missing} and the replay endpoint did not answer within "
                              f"{self._replay_timeout:g} s")
            return
        except (KVEventError, zmq.ZMQError) as exc:
            self._gap_cleared(f"{missing} and replay failed: {exc}")
            return
        if replayed and replayed[0][0] == start:
            self.stats.gaps_replayed += 1
        elif replayed:
            self._gap_cleared(f"{missing} and the replay buffer holds them only from {replayed[0][0]}")
        else:
            self._gap_cleared(f"{missing} and the replay buffer holds none of them")
        for seq, payload in replayed:
            self.stats.replayed += 1
            self._deliver(seq, payload)

    def _gap_cleared(self, reason: str) -> None:
        self.stats.gaps_cleared += 1
        self._resync(reason)

    async def _fetch_replay(self, start: int, end: int) -> list[tuple[int, bytes]]:
        """The endpoint's consecutive batches from `start` (or from where its buffer begins, if later) to
        end-1, or none if it holds none of them. KVEventError for anything else, and once the replies
        exceed `max_replay_bytes`: strictly increasing sequence numbers bound how many are read."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[tuple[int, bytes]] = []
            size = 0
            while True:
                seq, payload = _replay_reply(await dealer.recv_multipart())
                size += len(payload)
                if size > self._limits.max_replay_bytes:
                    raise KVEventError(f"the replay exceeds {self._limits.max_replay_bytes} bytes")
                expected = out[-1][0] + 1 if out else start
                if seq is None or seq >= end:
                    if out:
                        raise KVEventError(f"the replay skipped from batch {out[-1][0]} past {end - 1}")
                    return out
                if seq < expected:
                    raise KVEventError(f"the replay sent batch {seq} where {expected} or later was due")
                if out and seq != expected:
                    raise KVEventError(f"the replay skipped from batch {out[-1][0]} to {seq}")
                out.append((seq, payload))
                if seq == end - 1:
                    return out
        finally:
            dealer.close(linger=0)


def _replay_reply(frames: Sequence[bytes]) -> tuple[int | None, bytes]:
    """One reply of the replay endpoint, [b"", seq, payload]: its sequence number (None for the end
    marker) and payload."""
    if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
        raise KVEventError("malformed replay reply")
    if frames[1] == END_SEQ:
        return None, b""
    return int.from_bytes(frames[1], "big"), bytes(frames[2])


# -- mirror -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefixChange:
    """One step in the set of cached prefixes. `added`: `token_ids` and all its prefixes are cached.
    Removed: `token_ids` and every extension of it are no longer cached (`()` means everything)."""

    added: bool
    token_ids: tuple[int, ...]


@dataclass
class _Block:
    parent: int | None
    tokens: tuple[int, ...]
    children: set[int] = field(default_factory=set)
    reachable: bool = False


class PrefixMirror:
    """The prefix cache an event stream describes: block hash -> (parent hash, token ids).

    A block is a usable prefix only if its whole chain back to the root is cached (vLLM stops matching
    at the first missing block), so a block whose parent is missing is kept but not reported. Changes
    come out in order, as maximal added prefixes and minimal removed ones, so a consumer keeping a
    token trie inserts one path per addition and cuts one subtree per removal. `max_blocks` bounds
    memory against a misbehaving publisher: blocks past it are ignored (the mirror under-reports)."""

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.max_blocks = max_blocks
        self.overflowed = 0
        self._blocks: dict[int, _Block] = {}
        self._orphans: dict[int | None, set[int]] = {}
        """Children of blocks we do not hold, by parent hash (None: children of the root)."""
        self._roots: dict[tuple[int, ...], set[int]] = {}
        self._block_size = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, events: Iterable[CacheEvent]) -> list[PrefixChange]:
        changes: list[PrefixChange] = []
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event, changes)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._remove(h, changes)
            elif isinstance(event, AllBlocksCleared):
                changes.extend(self.clear())
        return changes

    def clear(self) -> list[PrefixChange]:
        had = bool(self._blocks)
        self._blocks.clear()
        self._orphans.clear()
        self._roots.clear()
        return [PrefixChange(False, ())] if had else []

    def prefix(self, block_hash: int) -> tuple[int, ...] | None:
        """The full token ids up to and including this block, if it is a usable prefix."""
        block = self._blocks.get(block_hash)
        return self._tokens_to(block_hash) if block is not None and block.reachable else None

    def cached_prefixes(self) -> list[tuple[int, ...]]:
        """The maximal usable prefixes: every cached prefix is a prefix of one of these."""
        return [
            self._tokens_to(h)
            for h, b in self._blocks.items()
            if b.reachable and not any(self._blocks[c].reachable for c in b.children)
        ]

    def match_length(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` are covered by cached blocks."""
        size = self._block_size
        if not size:
            return 0
        matched = 0
        candidates = self._roots.get(tuple(token_ids[:size]), set())
        while candidates:
            matched += size
            key = tuple(token_ids[matched : matched + size])
            candidates = {
                c
                for h in candidates
                for c in self._blocks[h].children
                if self._blocks[c].reachable and self._blocks[c].tokens == key
            }
        return matched

    def snapshot_events(self) -> list[BlockStored]:
        """The current content as one-block BlockStored events, parents first (for a late listener)."""
        out: list[BlockStored] = []
        pending = [h for h, b in self._blocks.items() if b.parent is None or b.parent not in self._blocks]
        while pending:
            h = pending.pop()
            b = self._blocks[h]
            out.append(BlockStored((h,), b.parent, b.tokens, len(b.tokens)))
            pending.extend(b.children)
        return out

    def _tokens_to(self, block_hash: int) -> tuple[int, ...]:
        parts: list[tuple[int, ...]] = []
        h: int | None = block_hash
        while h is not None and h in self._blocks:
            parts.append(self._blocks[h].tokens)
            h = self._blocks[h].parent
        return tuple(t for part in reversed(parts) for t in part)

    def _store(self, event: BlockStored, changes: list[PrefixChange]) -> None:
        self._block_size = event.block_size
        parent = event.parent_block_hash
        size = event.block_size
        first_reachable: int | None = None
        for i, h in enumerate(event.block_hashes):
            if h == parent:
                break
            tokens = event.token_ids[i * size : (i + 1) * size]
            existing = self._blocks.get(h)
            if existing is not None and (existing.parent, existing.tokens) != (parent, tokens):
                self._remove(h, changes)
                existing = None
            if existing is None:
                if len(self._blocks) >= self.max_blocks:
                    self.overflowed += 1
                    break
                self._insert(h, parent, tokens)
                parent_block = self._blocks.get(parent) if parent is not None else None
                if first_reachable is None and (parent is None or (parent_block and parent_block.reachable)):
                    first_reachable = h
            parent = h
        if first_reachable is not None:
            self._mark_reachable(first_reachable, changes)

    def _insert(self, h: int, parent: int | None, tokens: tuple[int, ...]) -> None:
        block = _Block(parent, tokens, self._orphans.pop(h, set()))
        self._blocks[h] = block
        parent_block = self._blocks.get(parent) if parent is not None else None
        if parent_block is not None:
            parent_block.children.add(h)
        else:
            self._orphans.setdefault(parent, set()).add(h)

    def _mark_reachable(self, h: int, changes: list[PrefixChange]) -> None:
        """Make a block and everything hanging below it usable, reporting the new maximal prefixes."""
        stack = [h]
        while stack:
            current = stack.pop()
            block = self._blocks[current]
            block.reachable = True
            if block.parent is None:
                self._roots.setdefault(block.tokens, set()).add(current)
            if block.children:
                stack.extend(block.children)
            else:
                changes.append(PrefixChange(True, self._tokens_to(current)))

    def _remove(self, h: int, changes: list[PrefixChange]) -> None:
        block = self._blocks.get(h)
        if block is None:
            return
        if block.reachable:
            changes.append(PrefixChange(False, self._tokens_to(h)))
            stack = list(block.children)
            while stack:
                child = self._blocks[stack.pop()]
                child.reachable = False
                stack.extend(child.children)
        if block.parent is None:
            roots = self._roots.get(block.tokens)
            if roots is not None:
                roots.discard(h)
                if not roots:
                    del self._roots[block.tokens]
        parent_block = self._blocks.get(block.parent) if block.parent is not None else None
        if parent_block is not None:
            parent_block.children.discard(h)
        else:
            siblings = self._orphans.get(block.parent)
            if siblings is not None:
                siblings.discard(h)
                if not siblings:
                    del self._orphans[block.parent]
        del self._blocks[h]
        if block.children:
            self._orphans[h] = block.children
