"""Group cache-state sync (seed: stateful cache-aware routing; planetserve.md 3.3, state synchronization).

Every model node tells its group which prompt prefixes its engine holds, as HR-tree paths (small
hashes, never tokens), and keeps the group's HR-tree from what its peers tell it:

- deltas: insertions and evictions, batched (at most one state message per `batch_interval`, sooner
  at `max_batch_ops`), numbered 1, 2, ... per sender incarnation;
- snapshots: every `snapshot_interval` the sender's full set of maximal paths, which REPLACES its
  entries at each receiver through the reverse index (anti-entropy: whatever got lost, a receiver is
  right again one snapshot period later). A snapshot carries the sequence number of the last delta it
  includes, and the group's chunk plan;
- gaps: a receiver that misses a delta (or meets a new incarnation, i.e. a restart) ignores that
  peer's deltas until its next snapshot, and asks for one (rate-limited at both ends);
- (re)start: a node's first broadcast is its snapshot and a request for everyone else's;
- silence: a peer not heard from for `peer_timeout` loses its entries (crashed or cut off);
- speculative entries: forwarding a request to a peer marks it as holding the prompt's path until
  `speculative_ttl`, so a burst of requests for a new prefix follows the first one; the mark turns
  into a real entry when the peer's own delta or snapshot lists the path, else it expires (evictions
  and snapshots leave it alone: they may predate the forwarded request). A mark is ours, not the
  peer's claim: hits sent on it are not held against the peer (below);
- chunk plans: paths only compare under one plan, so deltas name the sender's plan and snapshots carry
  it; a node adopts a newer plan (by version, then origin) from a trusted peer's snapshot, recomputes
  its own paths, drops its peers' and broadcasts a snapshot at once, so the group follows within a
  round of snapshots;
- load reports ride on every delta and snapshot (an empty delta every `load_interval` when idle);
- claims checked: a peer that held a prefix the tree matched caches much of it when the prompt reaches
  it (its answer says how many prompt tokens it found cached). When `claim_max_false` of the last
  `claim_window` prompts sent to a peer as a hit found less than `claim_min_share` of the claimed prefix
  cached, the peer's claims are not believed for `claim_distrust`: its entries are dropped and its
  deltas and snapshots change nothing but its load; then a snapshot is asked for again. A well-formed
  lie about what a node holds therefore draws a few requests, not the group's traffic.

The transport authenticates peers; `receive` takes the authenticated peer id, and a message may only
speak for that peer. Everything decoded is bounded (message size, path depth, operations, entries per
peer) and validated before anything is applied; a bad message raises a `SyncError` subclass and
changes nothing. No clock and no I/O here: callers pass `now` (monotonic seconds) and send the bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import math
import secrets
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from planetserve.node.routing.balance import LoadReport
from planetserve.node.routing.hrtree import (
    ChunkHasher,
    HRTree,
    NodeEntry,
    Path,
    SearchResult,
    decode_path,
    encode_path,
    path_width,
    root_path,
)
from planetserve.node.routing.sentry import MAX_PLAN_CHUNKS, ChunkPlan, PlanId, Sentry
from planetserve.registry.codec import CodecError, Limits, unpack_bounded

PROTOCOL_VERSION = 1
MAX_ID_LEN = 128
MAX_INCARNATION = (1 << 63) - 1
MAX_LATENCY_US = 1 << 40
MAX_COUNT = (1 << 31) - 1
KEY_FINGERPRINT_PERSON = b"ps-grpkey-v1"

Op = tuple[bool, Path]
"""(True: the sender now holds the path; False: it holds neither the path nor anything below it)."""


class SyncError(Exception):
    """A rejected message; nothing of it was applied."""


class MessageTooLarge(SyncError):
    pass


class MalformedMessage(SyncError):
    pass


class KeyMismatch(SyncError):
    """The sender hashes with another group key: its paths could never match ours."""


class UnknownPeer(SyncError):
    pass


class ForgedSender(SyncError):
    """A message that names a sender other than the authenticated peer that delivered it."""


class EntryLimitExceeded(SyncError):
    pass


@dataclass(frozen=True)
class SyncConfig:
    batch_interval: float = 0.1
    max_batch_ops: int = 256
    snapshot_interval: float = 5.0
    min_snapshot_gap: float = 0.5
    """The soonest a snapshot follows the last one when peers ask for it."""
    request_interval: float = 1.0
    """The soonest we ask the same peer for a snapshot again."""
    load_interval: float = 1.0
    speculative_ttl: float = 3.0
    """Long enough for the peer to prefill the prompt and report it in a delta (batch_interval later)."""
    peer_timeout: float = 15.0
    max_entries_per_peer: int = 65_536
    max_speculative_per_peer: int = 4_096
    max_depth: int = 4_096
    max_delta_ops: int = 1_024
    max_delta_bytes: int = 1 << 20
    max_snapshot_bytes: int = 4 << 20
    claim_window: int = 8
    claim_max_false: int = 3
    claim_min_share: float = 0.5
    claim_distrust: float = 300.0
    """Seconds a peer whose claims proved false is not believed (see the module docstring)."""

    def __post_init__(self) -> None:
        if min(self.max_entries_per_peer, self.max_depth, self.max_batch_ops, self.max_delta_ops) < 1:
            raise ValueError("entry, depth and operation limits must be positive")
        if self.max_batch_ops > self.max_delta_ops:
            raise ValueError("max_batch_ops must not exceed max_delta_ops")
        if self.max_delta_bytes < 4 * self.max_depth + 1024:
            raise ValueError("max_delta_bytes must hold at least one path of max_depth 32-bit hashes")
        if self.max_snapshot_bytes < 10 * self.max_entries_per_peer + 4096:
            raise ValueError("max_snapshot_bytes must hold a snapshot of max_entries_per_peer entries")
        if not 1 <= self.claim_max_false <= self.claim_window or not 0 < self.claim_min_share <= 1:
            raise ValueError("claims need 1 <= claim_max_false <= claim_window and 0 < claim_min_share <= 1")


@dataclass(frozen=True)
class Delta:
    sender: str
    incarnation: int
    seq: int
    plan_id: PlanId
    ops: tuple[Op, ...]
    load: LoadReport | None = None


@dataclass(frozen=True)
class Snapshot:
    sender: str
    incarnation: int
    seq: int
    """The last delta whose effect this snapshot includes."""
    plan: ChunkPlan
    paths: tuple[Path, ...]
    """The sender's maximal paths (each implies its prefixes), sorted."""
    load: LoadReport | None = None
    entries: int = field(default=0, compare=False)
    """Distinct prefixes the paths make, at most (set by decode; the per-peer cap checks it)."""


@dataclass(frozen=True)
class SnapshotRequest:
    sender: str
    incarnation: int


Message = Delta | Snapshot | SnapshotRequest

_DELTA, _SNAPSHOT, _REQUEST = 0, 1, 2
_COMMON_KEYS = {"v", "t", "s", "i", "k", "b"}
_KEYS = {_DELTA: _COMMON_KEYS | {"n", "p", "o", "l"}, _SNAPSHOT: _COMMON_KEYS | {"n", "p", "e", "l"},
         _REQUEST: _COMMON_KEYS}


def key_fingerprint(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=8, person=KEY_FINGERPRINT_PERSON).digest()


class WireCodec:
    """msgpack maps with one-letter keys; paths as packed big-endian hashes; snapshots front-coded."""

    def __init__(self, key: bytes, hash_bits: int, config: SyncConfig) -> None:
        self.fingerprint = key_fingerprint(key)
        self.hash_bits = hash_bits
        self.width = path_width(hash_bits)
        self.config = config
        most = max(config.max_entries_per_peer, config.max_delta_ops)
        # a map of 10 fields; entries or ops of [int, path]; a plan of 5 with its lengths; a load of 3
        self.limits = Limits(max_objects=3 * most + MAX_PLAN_CHUNKS + 64, max_depth=3,
                             max_len=max(most, MAX_PLAN_CHUNKS, 5), max_map=len(_KEYS[_SNAPSHOT]),
                             max_str=4 * MAX_ID_LEN, max_bin=config.max_depth * self.width)

    def encode(self, msg: Message) -> bytes:
        body: dict[str, Any] = {"v": PROTOCOL_VERSION, "s": msg.sender, "i": msg.incarnation,
                                "k": self.fingerprint, "b": self.hash_bits}
        if isinstance(msg, Delta):
            body |= {"t": _DELTA, "n": msg.seq, "p": list(msg.plan_id), "l": _load_wire(msg.load),
                     "o": [[int(insert), encode_path(path, self.width)] for insert, path in msg.ops]}
        elif isinstance(msg, Snapshot):
            entries, prev = [], ()
            for path in msg.paths:
                common = _common(prev, path)
                entries.append([common, encode_path(path[common:], self.width)])
                prev = path
            body |= {"t": _SNAPSHOT, "n": msg.seq, "p": msg.plan.to_wire(), "l": _load_wire(msg.load),
                     "e": entries}
        else:
            body["t"] = _REQUEST
        return msgpack.packb(body, use_bin_type=True)

    def decode(self, data: bytes) -> Message:
        cfg = self.config
        if not isinstance(data, bytes):
            raise MalformedMessage(f"a message is bytes, got {type(data).__name__}")
        if len(data) > cfg.max_snapshot_bytes:
            raise MessageTooLarge(f"{len(data)} bytes exceeds the {cfg.max_snapshot_bytes}-byte limit")
        try:
            obj = unpack_bounded(data, self.limits)
        except CodecError as exc:
            raise MalformedMessage(f"not a valid msgpack message: {exc}") from None
        if not isinstance(obj, dict):
            raise MalformedMessage("a message is a map")
        if obj.get("v") != PROTOCOL_VERSION:
            raise MalformedMessage(f"unsupported protocol version {obj.get('v')!r}")
        kind = obj.get("t")
        if type(kind) is not int or kind not in _KEYS or set(obj) != _KEYS[kind]:
            raise MalformedMessage(f"message type {kind!r} with fields {sorted(map(str, obj))} is unknown")
        limit = cfg.max_snapshot_bytes if kind == _SNAPSHOT else cfg.max_delta_bytes
        if len(data) > limit:
            raise MessageTooLarge(f"{len(data)} bytes exceeds the {limit}-byte limit for this message type")
        fingerprint = _bin(obj["k"], "k")
        if not hmac.compare_digest(fingerprint, self.fingerprint):
            raise KeyMismatch("the sender hashes with a different group key")
        if _int(obj["b"], "b", 1, 32) != self.hash_bits:
            raise MalformedMessage(f"the sender uses {obj['b']}-bit hashes, this group {self.hash_bits}")
        sender = obj["s"]
        if not isinstance(sender, str) or not 1 <= len(sender) <= MAX_ID_LEN:
            raise MalformedMessage(f"sender must be a string of 1 to {MAX_ID_LEN} characters")
        incarnation = _int(obj["i"], "i", 0, MAX_INCARNATION)
        if kind == _REQUEST:
            return SnapshotRequest(sender, incarnation)
        seq = _int(obj["n"], "n", 0, MAX_INCARNATION)
        load = _load_from_wire(obj["l"])
        if kind == _DELTA:
            return Delta(sender, incarnation, seq, self._plan_id(obj["p"]), self._ops(obj["o"]), load)
        try:
            plan = ChunkPlan.from_wire(obj["p"])
        except (ValueError, TypeError) as exc:
            raise MalformedMessage(f"bad chunk plan: {exc}") from None
        paths, entries = self._front_decoded(obj["e"])
        return Snapshot(sender, incarnation, seq, plan, paths, load, entries)

    def _plan_id(self, obj: object) -> PlanId:
        if not isinstance(obj, list) or len(obj) != 2:
            raise MalformedMessage("plan id is [version, origin]")
        version = _int(obj[0], "plan version", 0, MAX_INCARNATION)
        if not isinstance(obj[1], str) or len(obj[1]) > MAX_ID_LEN:
            raise MalformedMessage("plan origin must be a short string")
        return (version, obj[1])

    def _ops(self, obj: object) -> tuple[Op, ...]:
        if not isinstance(obj, list) or len(obj) > self.config.max_delta_ops:
            raise MalformedMessage(f"ops must be a list of at most {self.config.max_delta_ops}")
        ops = []
        for item in obj:
            if not isinstance(item, list) or len(item) != 2:
                raise MalformedMessage("an op is [kind, path]")
            insert = _int(item[0], "op kind", 0, 1) == 1
            path = self._path(item[1])
            if insert and not path:
                raise MalformedMessage("an insertion needs a non-empty path")
            ops.append((insert, path))
        return tuple(ops)

    def _front_decoded(self, obj: object) -> tuple[tuple[Path, ...], int]:
        cfg = self.config
        if not isinstance(obj, list):
            raise MalformedMessage("snapshot entries must be a list")
        paths: list[Path] = []
        prev: Path = ()
        entries = 0
        for item in obj:
            if not isinstance(item, list) or len(item) != 2:
                raise MalformedMessage("a snapshot entry is [shared prefix length, suffix]")
            common = _int(item[0], "shared prefix length", 0, len(prev))
            suffix = self._path(item[1])
            if not suffix:
                raise MalformedMessage("a snapshot entry must add to the previous path")
            entries += len(suffix)
            if entries > cfg.max_entries_per_peer:
                raise EntryLimitExceeded(f"snapshot holds more than {cfg.max_entries_per_peer} entries")
            prev = prev[:common] + suffix
            if len(prev) > cfg.max_depth:
                raise MalformedMessage(f"path deeper than {cfg.max_depth} chunks")
            paths.append(prev)
        return tuple(paths), entries

    def _path(self, obj: object) -> Path:
        try:
            return decode_path(_bin(obj, "path"), self.width, self.hash_bits)
        except ValueError as exc:
            raise MalformedMessage(str(exc)) from None


def _bin(obj: object, name: str) -> bytes:
    if not isinstance(obj, bytes):
        raise MalformedMessage(f"{name} must be binary")
    return obj


def _int(obj: object, name: str, lo: int, hi: int) -> int:
    if isinstance(obj, bool) or not isinstance(obj, int) or not lo <= obj <= hi:
        raise MalformedMessage(f"{name} must be an integer in [{lo}, {hi}], got {obj!r}")
    return obj


def _load_wire(load: LoadReport | None) -> list[int] | None:
    if load is None:
        return None
    return [min(round(load.latency * 1e6), MAX_LATENCY_US), min(load.queued, MAX_COUNT),
            min(load.capacity, MAX_COUNT)]


def _load_from_wire(obj: object) -> LoadReport | None:
    if obj is None:
        return None
    if not isinstance(obj, list) or len(obj) != 3:
        raise MalformedMessage("load is [latency µs, queued, capacity]")
    return LoadReport(latency=_int(obj[0], "latency", 0, MAX_LATENCY_US) / 1e6,
                      queued=_int(obj[1], "queued", 0, MAX_COUNT),
                      capacity=_int(obj[2], "capacity", 1, MAX_COUNT))


def _common(a: Path, b: Path) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Adv:
    """An advertised path prefix; refs counts the local chunks that hash to it (8-bit hashes collide)."""

    __slots__ = ("key", "parent", "children", "refs")

    def __init__(self, key: int, parent: _Adv | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Adv] = {}
        self.refs = 0


class _Local:
    """A chunk the engine holds, keyed by its tokens: evictions that end inside a chunk stay exact."""

    __slots__ = ("key", "parent", "children", "adv")

    def __init__(self, key: tuple[int, ...], parent: _Local | None, adv: _Adv) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[tuple[int, ...], _Local] = {}
        self.adv = adv


class LocalCache:
    """What this node's engine holds, and the ops that tell the group. Local only: tokens never leave.

    Fed with token prefixes the engine stored or dropped; caps what it advertises at `max_entries`
    prefixes and `max_depth` chunks (beyond that it just does not advertise: a missed hit, never a
    false one)."""

    def __init__(self, hasher: ChunkHasher, *, max_entries: int, max_depth: int) -> None:
        self.hasher = hasher
        self.max_entries = max_entries
        self.max_depth = max_depth
        self.unadvertised = 0
        self._reset()

    def _reset(self) -> None:
        self._adv_root = _Adv(-1, None)
        self._root = _Local((), None, self._adv_root)
        self.entries = 0

    def stored(self, token_ids: Sequence[int]) -> list[Op]:
        """The engine now holds `token_ids` (so each of its prefixes)."""
        node = self._root
        grew = False
        for start, end in self.hasher.plan.spans(len(token_ids))[: self.max_depth]:
            key = tuple(token_ids[start:end])
            child = node.children.get(key)
            if child is None:
                h = self.hasher.hash_chunk(key)
                adv = node.adv.children.get(h)
                if adv is None:
                    if self.entries >= self.max_entries:
                        self.unadvertised += 1
                        break
                    adv = node.adv.children[h] = _Adv(h, node.adv)
                    self.entries += 1
                    grew = True
                adv.refs += 1
                child = node.children[key] = _Local(key, node, adv)
            node = child
        return [(True, root_path(node.adv))] if grew else []

    def removed(self, token_ids: Sequence[int]) -> list[Op]:
        """The engine no longer holds `token_ids` (so nothing that extends it): exactly the chunk that
        holds its last token goes, with whatever follows it, and only along this prompt's tokens."""
        n = len(token_ids)
        if not n:
            return []
        plan = self.hasher.plan
        start, end = plan.span_at(n - 1)
        node: _Local | None = self._root
        for s, e in plan.spans(start):
            node = node.children.get(tuple(token_ids[s:e]))
            if node is None:
                return []
        tail = tuple(token_ids[start:n])
        if end == n:
            victim = node.children.get(tail)
            victims = [victim] if victim else []
        else:
            victims = [c for k, c in node.children.items() if k[: len(tail)] == tail]
        return self._drop(victims)

    def cleared(self) -> list[Op]:
        self._reset()
        return [(False, ())]

    def paths(self) -> list[Path]:
        """The maximal advertised paths, sorted (what a snapshot lists)."""
        return _leaves(self._adv_root, sort=True)

    def prompts(self) -> list[tuple[int, ...]]:
        """The held token prefixes that no other held prefix extends."""
        return [tuple(itertools.chain.from_iterable(chunks)) for chunks in _leaves(self._root, sort=False)]

    def rehash(self, hasher: ChunkHasher) -> None:
        """Recompute under a new plan; a prompt's tail that was no complete chunk under the old plan was
        not kept, so this can only under-advertise."""
        prompts = self.prompts()
        self.hasher = hasher
        self._reset()
        for tokens in prompts:
            self.stored(tokens)

    def _drop(self, victims: list[_Local]) -> list[Op]:
        zeroed: list[_Adv] = []
        for victim in victims:
            del victim.parent.children[victim.key]
            stack = [victim]
            while stack:
                node = stack.pop()
                node.adv.refs -= 1
                if not node.adv.refs:
                    zeroed.append(node.adv)
                stack.extend(node.children.values())
        # an advertised prefix nobody maps to any more takes its whole subtree with it, so one eviction
        # per topmost such prefix says it all
        ops: list[Op] = [(False, root_path(a)) for a in zeroed
                         if a.parent is self._adv_root or a.parent.refs]
        for adv in zeroed:
            if adv.parent.children.get(adv.key) is adv:
                del adv.parent.children[adv.key]
        self.entries -= len(zeroed)
        return ops


def _leaves(root: _Adv | _Local, *, sort: bool) -> list[tuple[Any, ...]]:
    """The keys along each root-to-leaf path, depth-first (sorted: in lexicographic order); iterative,
    as paths can be deeper than Python's recursion limit."""
    out: list[tuple[Any, ...]] = []
    keys: list[Any] = []

    def children(node: _Adv | _Local) -> Iterator[tuple[Any, Any]]:
        return iter(sorted(node.children.items()) if sort else list(node.children.items()))

    stack = [children(root)]
    while stack:
        item = next(stack[-1], None)
        if item is None:
            stack.pop()
            if keys:
                keys.pop()
            continue
        key, child = item
        keys.append(key)
        if child.children:
            stack.append(children(child))
        else:
            out.append(tuple(keys))
            keys.pop()
    return out


@dataclass
class SyncStats:
    """Cost accounting: bytes are what was encoded once per broadcast (the transport fans it out)."""

    sent_bytes: int = 0
    sent_deltas: int = 0
    sent_snapshots: int = 0
    sent_requests: int = 0
    sent_ops: int = 0
    received_bytes: int = 0
    applied_deltas: int = 0
    applied_snapshots: int = 0
    ignored: int = 0
    rejected: int = 0
    gaps: int = 0
    false_claims: int = 0
    distrusted: int = 0


@dataclass
class _Peer:
    last_heard: float
    incarnation: int | None = None
    next_seq: int = 1
    synced: bool = False
    last_request: float = -math.inf
    claims: deque[bool] = field(default_factory=deque)
    """Outcomes of the latest prompts sent to it as a hit (True: the claim held), newest last."""
    distrusted_until: float = -math.inf


@dataclass(frozen=True)
class ReceiveResult:
    applied: bool
    reason: str
    reply: bytes | None = None
    """A snapshot request to send back to that peer."""


class CacheSync:
    """One model node's side of the protocol: its own cache, its view of the group, the messages."""

    def __init__(self, node_id: str, key: bytes, *, sentry: Sentry | None = None, hash_bits: int = 8,
                 config: SyncConfig | None = None, min_depth: int = 1,
                 incarnation: int | None = None) -> None:
        self.node_id = node_id
        self.config = cfg = config or SyncConfig()
        self.sentry = sentry or Sentry(node_id)
        self._key = key
        self.hasher = ChunkHasher(self.sentry.plan, key, hash_bits)
        self.tree = HRTree(self.hasher, min_depth=min_depth, max_speculative=cfg.max_speculative_per_peer)
        self.tree.table.upsert(node_id)
        self.local = LocalCache(self.hasher, max_entries=cfg.max_entries_per_peer, max_depth=cfg.max_depth)
        self.codec = WireCodec(key, hash_bits, cfg)
        self.incarnation = secrets.randbits(63) if incarnation is None else incarnation
        self.stats = SyncStats()
        self.load: LoadReport | None = None
        self._peers: dict[str, _Peer] = {}
        self._seq = 0
        self._pending: list[Op] = []
        self._last_sent = -math.inf
        self._last_snapshot: float | None = None
        self._snapshot_wanted = False
        self._plan_changed = False

    @property
    def plan(self) -> ChunkPlan:
        return self.hasher.plan

    # -- membership (from the verified lists) --

    def add_peer(self, peer_id: str, *, now: float, address: str | None = None, trusted: bool | None = None,
                 reputation: int | None = None) -> None:
        if peer_id == self.node_id:
            raise ValueError("a node is not its own peer")
        self.tree.table.upsert(peer_id, address=address, trusted=trusted, reputation=reputation)
        self._peers.setdefault(peer_id, _Peer(last_heard=now))

    def remove_peer(self, peer_id: str) -> None:
        self._peers.pop(peer_id, None)
        self.tree.remove_node(peer_id)

    def describe_self(self, *, address: str, trusted: bool) -> None:
        """This node's own entry: where its peers reach it, and whether the group lists it as trusted."""
        self.tree.table.upsert(self.node_id, address=address, trusted=trusted)

    def report_load(self, load: LoadReport) -> None:
        """This node's load: its own entry's, and what its next messages carry to the group."""
        self.load = load
        self.tree.table.upsert(self.node_id, load=load)

    def nodes(self) -> list[NodeEntry]:
        """Every node of the group as this node knows it (itself included): address, trust, last load."""
        return list(self.tree.table)

    def peers(self) -> list[NodeEntry]:
        """The group's other nodes."""
        return [entry for entry in self.tree.table if entry.node_id != self.node_id]

    def address(self, node_id: str) -> str:
        """Where a node of the group is reached; empty when it is not known."""
        entry = self.tree.table.get(node_id)
        return entry.address if entry is not None else ""

    # -- this node's engine and prompts --

    def stored(self, token_ids: Sequence[int]) -> None:
        self._queue(self.local.stored(token_ids))

    def removed(self, token_ids: Sequence[int]) -> None:
        self._queue(self.local.removed(token_ids))

    def cleared(self) -> None:
        self._queue(self.local.cleared())

    def observe(self, token_ids: Sequence[int]) -> ChunkPlan | None:
        """Show the Sentry a prompt; when that yields a new plan, switch the group to it."""
        plan = self.sentry.observe(token_ids)
        if plan is not None:
            self._adopt()
        return plan

    # -- forwarding --

    def search(self, token_ids: Sequence[int]) -> SearchResult:
        return self.tree.search(token_ids)

    def claimed_tokens(self, peer_id: str, token_ids: Sequence[int]) -> int:
        """How many tokens of the prompt `peer_id` claims to have cached: the leading chunks its own
        deltas and snapshots list. A match on our speculative mark is no claim of the peer's: we sent it
        a prompt of that prefix a moment ago, which it may still be queueing or prefilling (on a busy
        engine, for seconds), so a hit sent on the mark can find nothing cached through no fault of its."""
        depth = self.tree.held_depth(peer_id, self.hasher.iter_path(token_ids))
        spans = self.plan.spans(len(token_ids))
        return spans[min(depth, len(spans)) - 1][1] if depth and spans else 0

    def check_claim(self, peer_id: str, claimed: int, cached: int, now: float) -> bool:
        """A prompt sent to `peer_id` as a hit on `claimed` tokens found `cached` of them cached there.
        Returns whether the peer's claims are (now) not believed."""
        peer = self._peers.get(peer_id)
        if peer is None or claimed <= 0:
            return False
        if self.distrusts(peer_id, now):
            return True
        held = cached >= self.config.claim_min_share * claimed
        if not held:
            self.stats.false_claims += 1
        peer.claims.append(held)
        while len(peer.claims) > self.config.claim_window:
            peer.claims.popleft()
        if sum(not h for h in peer.claims) < self.config.claim_max_false:
            return False
        peer.claims.clear()
        peer.distrusted_until = now + self.config.claim_distrust
        peer.synced = False
        self.tree.clear_node(peer_id)
        self.stats.distrusted += 1
        return True

    def distrusts(self, peer_id: str, now: float) -> bool:
        peer = self._peers.get(peer_id)
        return peer is not None and now < peer.distrusted_until

    def forwarded(self, peer_id: str, token_ids: Sequence[int], now: float) -> int:
        """We sent this prompt to `peer_id`: assume it holds the path until it says so or the mark expires."""
        if peer_id not in self._peers or self.distrusts(peer_id, now):
            return 0
        path = self.hasher.path(token_ids)[: self.config.max_depth]
        return self.tree.insert_path(peer_id, path, speculative_until=now + self.config.speculative_ttl)

    # -- the network --

    def status(self) -> dict[str, int]:
        """This node's own cache entries in the tree, the tree's size, and the chunk plan's version."""
        return {"cache_entries": self.tree.entries(self.node_id), "tree_size": len(self.tree),
                "plan_version": self.plan.version}

    def poll(self, now: float) -> list[bytes]:
        """Expire what is due, and the messages to broadcast to the group now."""
        cfg = self.config
        self.tree.expire(now)
        for peer_id, peer in self._peers.items():
            if now - peer.last_heard > cfg.peer_timeout and (peer.synced or self.tree.entries(peer_id)):
                self.tree.clear_node(peer_id)
                peer.synced = False
        last = self._last_snapshot
        if last is None:  # (re)started: tell the group what we hold and ask what it holds
            self.stats.sent_requests += 1
            return [self._snapshot(now), self._encode(SnapshotRequest(self.node_id, self.incarnation))]
        if (self._plan_changed or now - last >= cfg.snapshot_interval
                or (self._snapshot_wanted and now - last >= cfg.min_snapshot_gap)):
            return [self._snapshot(now)]
        if self._pending and (now - self._last_sent >= cfg.batch_interval
                              or len(self._pending) >= cfg.max_batch_ops):
            return self._flush(now)
        if self.load is not None and now - self._last_sent >= cfg.load_interval:
            return self._flush(now)
        return []

    def receive(self, peer_id: str, data: bytes, now: float) -> ReceiveResult:
        """Apply one message from authenticated peer `peer_id`; SyncError (nothing applied) if bad."""
        peer = self._peers.get(peer_id)
        try:
            if peer is None:
                raise UnknownPeer(f"{peer_id!r} is not a member of this group")
            msg = self.codec.decode(data)
            if msg.sender != peer_id:
                raise ForgedSender(f"a message from {peer_id!r} claims to come from {msg.sender!r}")
            if isinstance(msg, Delta | Snapshot) and now < peer.distrusted_until:
                self._take_load(peer_id, msg.load)
                result = ReceiveResult(False, "claims distrusted")
            elif isinstance(msg, Delta):
                result = self._on_delta(peer_id, peer, msg, now)
            elif isinstance(msg, Snapshot):
                result = self._on_snapshot(peer_id, peer, msg)
            else:
                self._snapshot_wanted = True
                result = ReceiveResult(True, "snapshot scheduled")
        except SyncError:
            self.stats.rejected += 1
            raise
        peer.last_heard = now
        self.stats.received_bytes += len(data)
        if not result.applied:
            self.stats.ignored += 1
        return result

    # -- internals --

    def _queue(self, ops: list[Op]) -> None:
        for insert, path in ops:
            if insert:
                self.tree.insert_path(self.node_id, path)
            else:
                self.tree.evict_path(self.node_id, path)
        self._pending.extend(ops)

    def _adopt(self) -> None:
        """The Sentry's plan changed: every path changes, ours are recomputed and peers' dropped until
        their snapshots under the new plan come (our snapshot, sent at once, carries the plan to them)."""
        self.hasher = ChunkHasher(self.sentry.plan, self._key, self.hasher.hash_bits)
        self.local.rehash(self.hasher)
        self.tree.rehash(self.hasher)
        for path in self.local.paths():
            self.tree.insert_path(self.node_id, path)
        for peer in self._peers.values():
            peer.synced = False
        self._pending.clear()
        self._plan_changed = True

    def _on_delta(self, peer_id: str, peer: _Peer, msg: Delta, now: float) -> ReceiveResult:
        if msg.plan_id != self.plan.id:
            peer.synced = False
            self._take_load(peer_id, msg.load)
            if msg.plan_id < self.plan.id:
                self._snapshot_wanted = True  # it has not heard of our plan yet
                return ReceiveResult(False, "older plan")
            return ReceiveResult(False, "newer plan", self._request(peer, now))  # its snapshot carries it
        if not peer.synced or msg.incarnation != peer.incarnation:
            peer.synced = False
            self._take_load(peer_id, msg.load)
            return ReceiveResult(False, "awaiting snapshot", self._request(peer, now))
        if msg.seq < peer.next_seq:
            return ReceiveResult(False, "duplicate")
        if msg.seq > peer.next_seq:
            peer.synced = False
            self.stats.gaps += 1
            self._take_load(peer_id, msg.load)
            return ReceiveResult(False, f"gap: expected {peer.next_seq}, got {msg.seq}",
                                 self._request(peer, now))
        growth = sum(len(path) - self.tree.held_depth(peer_id, path) for insert, path in msg.ops if insert)
        if self.tree.entries(peer_id) + growth > self.config.max_entries_per_peer:
            peer.synced = False  # its next delta would build on this one
            raise EntryLimitExceeded(f"{peer_id!r} would hold more than "
                                     f"{self.config.max_entries_per_peer} entries")
        for insert, path in msg.ops:
            if insert:
                self.tree.insert_path(peer_id, path)
            else:
                self.tree.evict_path(peer_id, path)
        peer.next_seq += 1
        self._take_load(peer_id, msg.load)
        self.stats.applied_deltas += 1
        return ReceiveResult(True, "delta applied")

    def _on_snapshot(self, peer_id: str, peer: _Peer, msg: Snapshot) -> ReceiveResult:
        if msg.plan.id == self.plan.id and msg.plan != self.plan:
            raise MalformedMessage(f"plan {msg.plan.id} differs from ours under the same id")
        if msg.plan.id != self.plan.id:
            entry = self.tree.table.get(peer_id)
            if msg.plan.id < self.plan.id:
                self._snapshot_wanted = True
                self._take_load(peer_id, msg.load)
                return ReceiveResult(False, "older plan")
            if entry is None or not entry.trusted:
                self._take_load(peer_id, msg.load)
                return ReceiveResult(False, "newer plan from an untrusted peer")
            if not self.sentry.adopt(msg.plan):
                self._take_load(peer_id, msg.load)
                return ReceiveResult(False, "a plan this group does not cut by, or too far ahead")
            self._adopt()
        elif peer.synced and msg.incarnation == peer.incarnation and msg.seq < peer.next_seq - 1:
            return ReceiveResult(False, "stale snapshot")
        self.tree.replace(peer_id, msg.paths)
        peer.synced = True
        peer.incarnation = msg.incarnation
        peer.next_seq = msg.seq + 1
        self._take_load(peer_id, msg.load)
        self.stats.applied_snapshots += 1
        return ReceiveResult(True, "snapshot applied")

    def _take_load(self, peer_id: str, load: LoadReport | None) -> None:
        if load is not None:
            self.tree.table.upsert(peer_id, load=load)

    def _request(self, peer: _Peer, now: float) -> bytes | None:
        if now - peer.last_request < self.config.request_interval:
            return None
        peer.last_request = now
        self.stats.sent_requests += 1
        return self._encode(SnapshotRequest(self.node_id, self.incarnation))

    def _snapshot(self, now: float) -> bytes:
        """Everything pending is in the snapshot, so it is dropped rather than sent as deltas."""
        self._pending.clear()
        self._last_snapshot = self._last_sent = now
        self._snapshot_wanted = self._plan_changed = False
        self.stats.sent_snapshots += 1
        return self._encode(Snapshot(self.node_id, self.incarnation, self._seq, self.plan,
                                     tuple(self.local.paths()), self.load))

    def _flush(self, now: float) -> list[bytes]:
        """The pending ops as deltas within the size limits (one empty delta to carry the load)."""
        cfg = self.config
        budget = cfg.max_delta_bytes - 1024
        batches: list[list[Op]] = [[]]
        size = 0
        for op in self._pending:
            cost = len(op[1]) * self.codec.width + 8
            if len(batches[-1]) >= cfg.max_delta_ops or (batches[-1] and size + cost > budget):
                batches.append([])
                size = 0
            batches[-1].append(op)
            size += cost
        self._pending = []
        self._last_sent = now
        out = []
        for ops in batches:
            self._seq += 1
            self.stats.sent_deltas += 1
            self.stats.sent_ops += len(ops)
            out.append(self._encode(Delta(self.node_id, self.incarnation, self._seq, self.plan.id,
                                          tuple(ops), self.load)))
        return out

    def _encode(self, msg: Message) -> bytes:
        data = self.codec.encode(msg)
        self.stats.sent_bytes += len(data)
        return data
