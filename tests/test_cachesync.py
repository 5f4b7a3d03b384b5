"""Group cache-state sync: the wire format and its validation, exact local evictions, convergence after
lost deltas, restarts and partitions, speculative entries, and plan changes."""

from __future__ import annotations

import random
from collections.abc import Callable

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planetserve.node.routing.balance import LoadReport
from planetserve.node.routing.cachesync import (
    CacheSync,
    Delta,
    EntryLimitExceeded,
    ForgedSender,
    KeyMismatch,
    MalformedMessage,
    MessageTooLarge,
    Snapshot,
    SnapshotRequest,
    SyncConfig,
    SyncError,
    UnknownPeer,
    WireCodec,
)
from planetserve.node.routing.sentry import (
    MAX_CHUNK_TOKENS,
    MAX_VERSION,
    MAX_VERSION_STEP,
    ChunkPlan,
    Sentry,
    SentryConfig,
)

KEY = b"group-key-0123456789abcdef012345"
CONFIG = SyncConfig()
Drop = Callable[[str, str, bytes], bool]


def kind(data: bytes) -> int:
    return msgpack.unpackb(data)["t"]


class Net:
    """N nodes that broadcast to each other in memory, with a filter that drops messages."""

    def __init__(self, n: int, seed: int = 0, config: SyncConfig = CONFIG,
                 sentry_config: SentryConfig | None = None) -> None:
        self.rng = random.Random(seed)
        self.config = config
        self.sentry_config = sentry_config or SentryConfig(default_chunk=16)
        self.now = 0.0
        self.ids = [f"n{i}" for i in range(n)]
        self.nodes = {i: self.fresh(i) for i in self.ids}
        self.drop: Drop = lambda src, dst, data: False
        self.systems = [self.tokens(40) for _ in range(3)]
        self.held: dict[str, list[list[int]]] = {i: [] for i in self.ids}

    def fresh(self, node_id: str) -> CacheSync:
        node = CacheSync(node_id, KEY, config=self.config, sentry=Sentry(node_id, self.sentry_config))
        node.tree.table.upsert(node_id, trusted=True)
        for other in self.ids:
            if other != node_id:
                node.add_peer(other, now=self.now, trusted=True)
        return node

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(100, 30_000) for _ in range(n)]

    def churn(self, ops: int = 3) -> None:
        """Some nodes store new prompts and evict old ones (whole, or from inside a chunk)."""
        for _ in range(ops):
            node_id = self.rng.choice(self.ids)
            held = self.held[node_id]
            if held and self.rng.random() < 0.4:
                prompt = held.pop(self.rng.randrange(len(held)))
                self.nodes[node_id].removed(prompt[: self.rng.randrange(1, len(prompt) + 1)])
            else:
                prompt = self.rng.choice(self.systems) + self.tokens(self.rng.randrange(5, 60))
                held.append(prompt)
                self.nodes[node_id].stored(prompt)

    def step(self, dt: float = 0.05, churn: int = 0) -> None:
        self.now += dt
        self.churn(churn)
        for src in self.ids:
            for data in self.nodes[src].poll(self.now):
                for dst in self.ids:
                    if dst != src and not self.drop(src, dst, data):
                        reply = self.nodes[dst].receive(src, data, self.now).reply
                        if reply is not None and not self.drop(dst, src, reply):
                            self.nodes[src].receive(dst, reply, self.now)

    def run(self, seconds: float, churn: int = 0) -> None:
        for _ in range(round(seconds / 0.05)):
            self.step(churn=churn)

    def settle(self) -> None:
        """Let the last batched deltas go out."""
        self.run(0.2)

    def diverged(self) -> list[tuple[str, str]]:
        """(viewer, peer) pairs whose view differs from the peer's own advertised paths."""
        out = []
        for viewer in self.ids:
            for peer in self.ids:
                if peer != viewer and self.nodes[viewer].tree.paths(peer) != set(self.nodes[peer].local.paths()):
                    out.append((viewer, peer))
        return out

    def time_to_converge(self, limit: float) -> float:
        start = self.now
        while self.diverged():
            assert self.now - start <= limit, f"not converged after {limit}s: {self.diverged()[:4]}"
            self.step()
        return self.now - start


def pair(config: SyncConfig = CONFIG, hash_bits: int = 8) -> tuple[CacheSync, CacheSync]:
    a = CacheSync("a", KEY, config=config, hash_bits=hash_bits, incarnation=1)
    b = CacheSync("b", KEY, config=config, hash_bits=hash_bits, incarnation=2)
    a.add_peer("b", now=0.0, trusted=True)
    b.add_peer("a", now=0.0, trusted=True)
    for m in a.poll(0.0):
        b.receive("a", m, 0.0)
    return a, b


def state(node: CacheSync) -> tuple[object, ...]:
    return (frozenset(node.tree.paths("a")), len(node.tree), node.stats.applied_deltas,
            node.stats.applied_snapshots, node.tree.table.get("a").load)


# -- wire format --


@settings(max_examples=60)
@given(st.integers(1, 32), st.data())
def test_messages_round_trip(bits: int, data: st.DataObject) -> None:
    codec = WireCodec(KEY, bits, CONFIG)
    paths = st.lists(st.integers(0, 2**bits - 1), min_size=1, max_size=12).map(tuple)
    load = data.draw(st.none() | st.builds(LoadReport, st.integers(0, 10**7).map(lambda us: us / 1e6),
                                           st.integers(0, 99), st.integers(1, 99)))
    ops = tuple(data.draw(st.lists(st.tuples(st.booleans(), paths), max_size=10)))
    delta = Delta("n1", 7, 3, (2, "n4"), ops, load)
    assert codec.decode(codec.encode(delta)) == delta
    leaves = tuple(sorted(data.draw(st.sets(paths, max_size=10))))
    snapshot = Snapshot("n1", 7, 3, ChunkPlan(lengths=(100, 8), version=2, origin="n4"), leaves, load)
    decoded = codec.decode(codec.encode(snapshot))
    assert decoded == snapshot
    assert decoded.entries >= len({p[:i] for p in leaves for i in range(1, len(p) + 1)})
    assert codec.decode(codec.encode(SnapshotRequest("n1", 7))) == SnapshotRequest("n1", 7)


def test_snapshots_are_front_coded() -> None:
    codec = WireCodec(KEY, 8, CONFIG)
    shared = tuple(range(100))
    leaves = tuple(shared + (i,) for i in range(50))
    size = len(codec.encode(Snapshot("n", 1, 0, ChunkPlan(), leaves)))
    assert size < 100 + 50 * 6 + 100  # the shared 100 hashes once, then a few bytes per leaf


def forge(drop: str = "", **fields: object) -> bytes:
    codec = WireCodec(KEY, 8, CONFIG)
    body = msgpack.unpackb(codec.encode(Delta("a", 1, 1, (0, ""), ((True, (1, 2)),))))
    body.pop(drop, None)
    body.update(fields)
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(("data", "error", "match"), [
    (b"\xc1garbage", MalformedMessage, "msgpack"),
    (b"\x93\x01\x02\x03", MalformedMessage, "a map"),
    (forge() + b"\x00", MalformedMessage, "msgpack"),
    (forge(v=2), MalformedMessage, "protocol version"),
    (forge(t=7), MalformedMessage, "unknown"),
    (forge(x=1, drop="l"), MalformedMessage, "unknown"),
    (forge(drop="l"), MalformedMessage, "unknown"),
    (forge(x=1), MalformedMessage, "max_map_len"),
    (forge(n=True), MalformedMessage, "n must be an integer"),
    (forge(n=-1), MalformedMessage, "n must be an integer"),
    (forge(i="1"), MalformedMessage, "i must be an integer"),
    (forge(s=""), MalformedMessage, "sender"),
    (forge(b=16), MalformedMessage, "16-bit hashes"),
    (forge(k=b"\x00" * 8), KeyMismatch, "group key"),
    (forge(o=[[1, b""]]), MalformedMessage, "non-empty path"),
    (forge(o=[[2, b"\x01"]]), MalformedMessage, "op kind"),
    (forge(o=[[1, "ab"]]), MalformedMessage, "binary"),
    (forge(o=[[1, b"\x01"]] * 2000), MalformedMessage, "ops must be a list"),
    (forge(o=[[1, b"\x01" * 5000]]), MalformedMessage, "msgpack"),
    (forge(l=[1, 2]), MalformedMessage, "load"),
    (forge(l=[1, 2, 0]), MalformedMessage, "capacity"),
    (forge(p=[1]), MalformedMessage, "plan id"),
    (b"\x00" * (5 << 20), MessageTooLarge, "limit"),
    (forge(t={}), MalformedMessage, "message type {} "),
])
def test_bad_messages_are_rejected_with_specific_errors(data: bytes, error: type[SyncError], match: str) -> None:
    a, b = pair()
    before = state(b)
    with pytest.raises(error, match=match):
        b.receive("a", data, 1.0)
    assert state(b) == before
    assert b.stats.rejected == 1


def test_hashes_wider_than_the_group_width_are_rejected() -> None:
    config = SyncConfig()
    a, b = pair(config, hash_bits=4)
    bad = msgpack.unpackb(a.codec.encode(Delta("a", 1, 1, (0, ""), ((True, (1,)),))))
    bad["o"] = [[1, b"\x01\xff"]]
    with pytest.raises(MalformedMessage, match="wider than 4 bits"):
        b.receive("a", msgpack.packb(bad, use_bin_type=True), 1.0)


def test_bad_snapshots_are_rejected() -> None:
    a, b = pair()
    body = msgpack.unpackb(a.codec.encode(Snapshot("a", 1, 0, a.plan, ((1, 2, 3), (1, 2, 4)))))
    for entries, match in (([[1, b"\x01"]], "shared prefix length"), ([[0, b"\x01"], [0, b""]], "add to"),
                           ([[0, b"\x01"]] * 3 + [[1, b"\x01" * 4096]], "deeper")):
        with pytest.raises(MalformedMessage, match=match):
            b.receive("a", msgpack.packb({**body, "e": entries}, use_bin_type=True), 1.0)
    with pytest.raises(MalformedMessage, match="chunk plan"):
        b.receive("a", msgpack.packb({**body, "p": [0, "", [0], 64, 1]}, use_bin_type=True), 1.0)
    clash = a.codec.encode(Snapshot("a", 1, 0, ChunkPlan(lengths=(32,)), ()))  # same id (0, "") as ours
    with pytest.raises(MalformedMessage, match="same id"):
        b.receive("a", clash, 1.0)


def test_oversized_delta_is_rejected_by_its_own_limit() -> None:
    config = SyncConfig(max_delta_bytes=20_000, max_depth=4_096)
    a, b = pair(config)
    ops = tuple((True, tuple(range(i % 200, i % 200 + 50))) for i in range(600))
    data = a.codec.encode(Delta("a", 1, 1, a.plan.id, ops))
    assert 20_000 < len(data) < config.max_snapshot_bytes
    with pytest.raises(MessageTooLarge, match="for this message type"):
        b.receive("a", data, 1.0)


def test_forged_and_unknown_senders_are_rejected() -> None:
    a, b = pair()
    c = CacheSync("c", KEY, incarnation=3)
    b.add_peer("c", now=0.0, trusted=True)
    c.stored(list(range(500)))
    from_c = c.poll(0.0)[0]
    with pytest.raises(ForgedSender, match="claims to come from 'c'"):
        b.receive("a", from_c, 1.0)  # a relays c's message: it may only speak for itself
    with pytest.raises(UnknownPeer):
        b.receive("mallory", from_c, 1.0)
    with pytest.raises(UnknownPeer):
        b.receive("b", from_c, 1.0)
    assert b.tree.entries("a") == 0 and b.tree.entries("c") == 0
    b.receive("c", from_c, 1.0)
    assert b.tree.entries("c") == len(c.local.paths()[0])


def test_a_peer_cannot_exceed_its_entry_cap() -> None:
    config = SyncConfig(max_entries_per_peer=10)
    a, b = pair(config)
    big = Snapshot("a", 1, 0, a.plan, (tuple(range(11)),))
    with pytest.raises(EntryLimitExceeded):
        b.receive("a", a.codec.encode(big), 1.0)
    b.receive("a", a.codec.encode(Snapshot("a", 1, 0, a.plan, (tuple(range(8)),))), 1.0)
    before = state(b)
    grow = Delta("a", 1, 1, a.plan.id, ((True, tuple(range(9))), (True, (50, 51, 52))))
    with pytest.raises(EntryLimitExceeded):
        b.receive("a", a.codec.encode(grow), 1.0)
    assert state(b) == before
    fits = Delta("a", 1, 1, a.plan.id, ((True, tuple(range(10))),))  # only one new entry
    assert b.receive("a", a.codec.encode(fits), 1.0).applied is False  # the rejected delta left a gap...
    assert b.receive("a", a.codec.encode(Snapshot("a", 1, 1, a.plan, (tuple(range(10)),))), 1.0).applied


def test_a_sender_never_advertises_past_the_cap() -> None:
    config = SyncConfig(max_entries_per_peer=10)
    a, b = pair(config)
    rng = random.Random(1)
    for _ in range(5):
        a.stored([rng.randrange(1000) for _ in range(64 * 4)])
    assert a.local.entries == 10 and a.local.unadvertised > 0
    for m in a.poll(1.0):
        b.receive("a", m, 1.0)
    assert b.tree.entries("a") == 10


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300) | st.builds(lambda d, i, x: d[:i] + x + d[i + 1:],
                                            st.just(forge()), st.integers(0, 40), st.binary(max_size=3)))
def test_fuzzed_messages_raise_sync_errors_or_apply_cleanly(data: bytes) -> None:
    a, b = pair()
    before = state(b)
    try:
        b.receive("a", data, 1.0)
    except SyncError:
        assert state(b) == before


# -- local cache --


def test_removal_inside_a_chunk_evicts_exactly_the_continuations_it_covers() -> None:
    a, b = pair()
    base = list(range(1000, 1128))  # chunks of 64: two
    p1 = base + list(range(5000, 5064))
    p2 = base + list(range(5000, 5032)) + list(range(7000, 7032))
    p3 = base + list(range(9000, 9064))
    for p in (p1, p2, p3):
        a.stored(p)
    assert len(a.local.paths()) == 3
    a.removed(p1[:150])  # ends inside the third chunk: p1's and p2's third chunks start with these tokens
    assert a.local.paths() == [a.hasher.path(p3)]
    assert a.local.prompts() == [tuple(p3)]
    for m in a.poll(1.0):
        b.receive("a", m, 1.0)
    assert b.tree.paths("a") == {a.hasher.path(p3)}
    a.removed(p3[:64])
    a.stored(p1[:100])
    assert a.local.paths() == [a.hasher.path(base[:64])]
    a.cleared()
    for m in a.poll(2.0):
        b.receive("a", m, 2.0)
    assert a.local.paths() == [] and b.tree.entries("a") == 0


def test_colliding_chunks_keep_a_path_until_the_last_one_goes() -> None:
    a, b = pair(hash_bits=1)  # every other chunk collides
    prompts = [list(range(i * 100, i * 100 + 64)) for i in range(8)]
    for p in prompts:
        a.stored(p)
    assert a.local.entries <= 2
    for p in prompts[:-1]:
        a.removed(p)
    assert a.local.paths() == [a.hasher.path(prompts[-1])]
    for m in a.poll(1.0):
        b.receive("a", m, 1.0)
    assert b.tree.paths("a") == {a.hasher.path(prompts[-1])}


def test_own_entries_are_in_the_group_tree_at_once() -> None:
    a, _ = pair()
    a.tree.table.upsert("a", trusted=True)
    prompt = list(range(300))
    a.stored(prompt)
    assert a.search(prompt).holders == {"a"}
    a.removed(prompt)
    assert a.search(prompt).depth == 4


# -- deltas, snapshots, convergence --


def test_deltas_are_batched_and_sequenced() -> None:
    a, b = pair()  # a sent its snapshot at 0.0
    a.stored(list(range(64)))
    assert a.poll(0.05) == []  # at most one message per batch interval
    assert b.receive("a", a.poll(0.1)[0], 0.1).reason == "delta applied"
    for i in range(1, 6):
        a.stored(list(range(i * 1000, i * 1000 + 128)))
    assert a.poll(0.15) == []
    sent_before = a.stats.sent_bytes
    msgs = a.poll(0.25)
    assert len(msgs) == 1 and kind(msgs[0]) == 0
    assert b.receive("a", msgs[0], 0.25).reason == "delta applied"
    assert a.stats.sent_ops == 6 and a.stats.sent_deltas == 2
    assert a.stats.sent_bytes - sent_before == len(msgs[0])
    for i in range(300):  # three chunks each: 8-bit hashes collide at the first, hardly ever at all three
        a.stored(list(range(10**6 + i * 192, 10**6 + i * 192 + 192)))
    burst = a.poll(0.26)  # past max_batch_ops: no waiting
    assert len(burst) == 1 and a.stats.sent_ops - 6 >= CONFIG.max_batch_ops
    assert b.receive("a", burst[0], 0.26).applied
    assert b.receive("a", burst[0], 0.27).reason == "duplicate"
    assert b.tree.paths("a") == set(a.local.paths())


def test_load_reports_ride_along_and_idle_nodes_send_heartbeats() -> None:
    a, b = pair()
    a.load = LoadReport(0.25, 3, 8)
    heartbeat = a.poll(1.5)
    assert len(heartbeat) == 1 and kind(heartbeat[0]) == 0
    b.receive("a", heartbeat[0], 1.5)
    assert b.tree.table.get("a").load == LoadReport(0.25, 3, 8)
    assert a.poll(1.6) == []


def test_gap_ignores_deltas_and_requests_a_snapshot() -> None:
    a, b = pair()
    a.stored(list(range(128)))
    lost = a.poll(0.2)
    a.stored(list(range(1000, 1128)))
    after_gap = a.poll(0.4)
    assert lost and after_gap
    result = b.receive("a", after_gap[0], 0.4)
    assert not result.applied and result.reason.startswith("gap") and result.reply is not None
    assert b.stats.gaps == 1 and b.tree.entries("a") == 0
    a.stored(list(range(2000, 2128)))
    later = a.poll(0.6)
    assert b.receive("a", later[0], 0.6).reply is None  # asked once per request_interval
    assert a.receive("b", result.reply, 0.6).reason == "snapshot scheduled"
    healed = a.poll(0.7)
    assert kind(healed[0]) == 1
    assert b.receive("a", healed[0], 0.7).reason == "snapshot applied"
    assert b.tree.paths("a") == set(a.local.paths())
    assert b.receive("a", lost[0], 0.8).reason == "duplicate"


def test_stale_snapshot_is_ignored() -> None:
    a, b = pair()
    a.stored(list(range(128)))
    old = a.poll(5.0)  # the periodic snapshot takes in the pending insertion
    assert [kind(m) for m in old] == [1] and b.receive("a", old[0], 5.0).applied
    for t, start in ((5.2, 500), (5.4, 900)):
        a.stored(list(range(start, start + 128)))
        assert b.receive("a", a.poll(t)[0], t).reason == "delta applied"
    assert b.receive("a", old[0], 5.5).reason == "stale snapshot"
    assert b.tree.paths("a") == set(a.local.paths())


def test_converges_after_dropped_deltas() -> None:
    net = Net(4, seed=1)
    net.run(1.0, churn=2)
    net.settle()
    assert not net.diverged()
    net.drop = lambda src, dst, data: kind(data) == 0 and net.rng.random() < 0.3
    net.run(3.0, churn=3)
    assert net.diverged()
    assert sum(n.stats.gaps for n in net.nodes.values()) > 0
    net.drop = lambda src, dst, data: False
    for node_id in net.ids:  # everyone's next delta shows the gaps; the snapshots asked for follow
        net.nodes[node_id].stored(net.systems[0] + net.tokens(20))
    assert net.time_to_converge(net.config.snapshot_interval) < 1.5


def test_converges_without_requests_within_one_snapshot_period() -> None:
    net = Net(3, seed=2)
    net.run(0.5, churn=2)
    net.drop = lambda src, dst, data: kind(data) != 1  # only periodic snapshots get through
    net.churn(6)
    net.run(0.2)
    assert net.diverged()
    assert net.time_to_converge(net.config.snapshot_interval + 0.1) > 0


def test_restarted_node_converges() -> None:
    net = Net(4, seed=3)
    net.run(2.0, churn=3)
    net.settle()
    assert not net.diverged()
    net.nodes["n2"] = net.fresh("n2")  # crash and restart: empty cache, new incarnation, no view of peers
    net.held["n2"] = []
    net.nodes["n2"].stored(net.systems[0] + net.tokens(30))
    net.step()
    assert all(net.nodes[v].tree.paths("n2") == set(net.nodes["n2"].local.paths()) for v in net.ids if v != "n2")
    assert net.time_to_converge(net.config.snapshot_interval) <= 1.5  # requests bring peers' snapshots


def test_restarted_node_without_requests_converges_after_one_snapshot_period() -> None:
    net = Net(3, seed=4)
    net.run(1.0, churn=3)
    net.nodes["n1"] = net.fresh("n1")
    net.held["n1"] = []
    net.drop = lambda src, dst, data: kind(data) == 2  # snapshot requests are lost
    assert net.time_to_converge(net.config.snapshot_interval + 0.1) > 1.0


def test_partitioned_nodes_drop_each_others_entries_then_converge() -> None:
    net = Net(4, seed=5)
    net.run(1.0, churn=3)
    left, right = {"n0", "n1"}, {"n2", "n3"}
    net.drop = lambda src, dst, data: (src in left) != (dst in left)
    net.run(net.config.peer_timeout + 1.0, churn=2)
    for viewer in left:  # silent peers are forgotten rather than forwarded to
        assert all(net.nodes[viewer].tree.entries(p) == 0 for p in right)
    net.drop = lambda src, dst, data: False
    assert net.time_to_converge(net.config.snapshot_interval) <= net.config.snapshot_interval


def test_converges_under_continuous_churn() -> None:
    net = Net(5, seed=6)
    net.drop = lambda src, dst, data: net.rng.random() < 0.1
    net.run(6.0, churn=2)
    net.drop = lambda src, dst, data: False
    net.time_to_converge(net.config.snapshot_interval)


# -- speculative entries --


def test_speculative_entry_expires_unless_confirmed() -> None:
    a, b = pair()
    prompt, other = list(range(256)), list(range(10_000, 10_256))
    assert b.forwarded("a", prompt, now=1.0) == 4
    assert b.forwarded("a", other, now=1.0) == 4
    assert b.search(prompt).holders == {"a"} and b.search(prompt).matched
    a.stored(prompt)  # a prefilled the first one and says so
    for m in a.poll(1.5):
        b.receive("a", m, 1.5)
    b.poll(1.0 + CONFIG.speculative_ttl)
    assert b.search(prompt).holders == {"a"}
    assert b.search(other).depth == 0
    assert b.forwarded("nobody", prompt, now=2.0) == 0


def test_speculative_entries_survive_a_snapshot_taken_before_the_forward() -> None:
    a, b = pair()
    snapshot_before = a.poll(5.0)
    prompt = list(range(256))
    b.forwarded("a", prompt, now=5.01)
    b.receive("a", snapshot_before[0], 5.02)
    assert b.search(prompt).holders == {"a"}


# -- claims checked against what the holder had cached --


def test_a_peer_whose_claims_prove_false_is_not_believed_for_a_while() -> None:
    a, b = pair()
    prompts = [list(range(k, k + 256)) for k in range(0, 10_000, 1_000)]
    for prompt in prompts:
        a.stored(prompt)  # what a says it holds (its engine may say otherwise)
    for m in a.poll(1.0):
        b.receive("a", m, 1.0)
    assert all(b.search(p).holders == {"a"} for p in prompts)
    claimed = b.claimed_tokens("a", prompts[0])
    assert claimed == 256
    # an honest miss now and then (evicted in between) is tolerated
    assert not b.check_claim("a", claimed, 0, now=1.1)
    assert not b.check_claim("a", claimed, 256, now=1.2)
    assert not b.check_claim("a", claimed, 192, now=1.3)  # more than half was there
    assert not b.check_claim("a", claimed, 100, now=1.4)
    assert b.stats.false_claims == 2 and not b.distrusts("a", 1.4)
    assert b.check_claim("a", claimed, 0, now=1.5)  # the third false claim in the window
    assert b.stats.distrusted == 1 and b.distrusts("a", 1.5)
    assert all(b.search(p).depth == 0 for p in prompts)
    assert b.forwarded("a", prompts[0], now=1.6) == 0
    # while distrusted, what a says changes nothing but its load
    a.load = LoadReport(0.25, 3, 4)
    for m in a.poll(1.0 + CONFIG.snapshot_interval):
        result = b.receive("a", m, 1.0 + CONFIG.snapshot_interval)
        assert not result.applied and result.reason == "claims distrusted"
    assert all(b.search(p).depth == 0 for p in prompts)
    assert b.tree.table.get("a").load == LoadReport(0.25, 3, 4)
    # then its next message brings a snapshot request, and its snapshot is believed again
    later = 1.5 + CONFIG.claim_distrust + 1
    a.stored(list(range(50_000, 50_256)))
    reply = None
    for m in a.poll(later):
        reply = b.receive("a", m, later).reply or reply
    if reply is not None:
        a.receive("b", reply, later)
    for m in a.poll(later + CONFIG.min_snapshot_gap):
        b.receive("a", m, later + CONFIG.min_snapshot_gap)
    assert all(b.search(p).holders == {"a"} for p in prompts)


def test_a_hit_on_our_own_speculative_mark_is_no_claim_of_the_peers() -> None:
    """b forwarded a prompt to a and marked a as holding its prefix; hits b sends on that mark before a
    prefills it find nothing cached, which is no lie of a's: they are not held against it. Once a's own
    delta lists the prefix, a claims it, and a hit that finds it missing counts."""
    a, b = pair()
    prompt = list(range(256))
    b.forwarded("a", prompt, now=1.0)
    assert b.search(prompt).holders == {"a"} and b.claimed_tokens("a", prompt) == 0
    for now in (1.1, 1.2, 1.3, 1.4):
        assert not b.check_claim("a", b.claimed_tokens("a", prompt), 0, now)
    assert b.stats.false_claims == 0 and not b.distrusts("a", 1.4)
    a.stored(prompt[:128])
    for m in a.poll(1.5):
        b.receive("a", m, 1.5)
    assert b.search(prompt).holders == {"a"} and b.claimed_tokens("a", prompt) == 128
    assert not b.check_claim("a", b.claimed_tokens("a", prompt), 0, 1.6)
    assert b.stats.false_claims == 1


def test_claims_policy_is_checked() -> None:
    for bad in ({"claim_max_false": 0}, {"claim_max_false": 9, "claim_window": 8}, {"claim_min_share": 0.0}):
        with pytest.raises(ValueError, match="claim"):
            SyncConfig(**bad)


# -- plan changes --


def test_a_new_sentry_plan_spreads_and_the_group_converges() -> None:
    sentry_config = SentryConfig(default_chunk=16, refresh_every=200, min_count=4)
    net = Net(3, seed=7, sentry_config=sentry_config)
    net.run(1.0, churn=3)
    plan = None
    for _ in range(200):
        plan = net.nodes["n0"].observe(net.rng.choice(net.systems) + net.tokens(20)) or plan
    assert plan is not None and plan.lengths[0] == 40
    net.run(0.2)
    assert {n.plan.id for n in net.nodes.values()} == {plan.id}
    assert all(n.sentry.plan == plan for n in net.nodes.values())
    net.time_to_converge(net.config.snapshot_interval)
    prompt = net.systems[1] + net.tokens(30)
    net.nodes["n1"].stored(prompt)
    net.run(0.2)
    assert net.nodes["n2"].search(net.systems[1] + net.tokens(30)).holders >= {"n1"}


def test_plans_are_adopted_from_trusted_peers_only() -> None:
    a, b = pair()
    b.tree.table.upsert("a", trusted=False)
    newer = ChunkPlan(lengths=(32,), default_chunk=64, version=5, origin="a")
    snapshot = a.codec.encode(Snapshot("a", 1, 0, newer, ()))
    assert b.receive("a", snapshot, 1.0).reason == "newer plan from an untrusted peer"
    assert b.plan.version == 0
    b.tree.table.upsert("a", trusted=True)
    assert b.receive("a", snapshot, 1.0).reason == "snapshot applied"
    assert b.plan == newer and b.sentry.plan == newer


@pytest.mark.parametrize("plan", [
    ChunkPlan(default_chunk=MAX_CHUNK_TOKENS, version=1, origin="a"),
    ChunkPlan(default_chunk=64, block_size=2, version=1, origin="a"),
    ChunkPlan(lengths=(32,), version=MAX_VERSION, origin="a"),
], ids=["chunks of 2^20 tokens", "another block size", "the largest version"])
def test_a_peer_cannot_push_a_plan_that_cuts_otherwise_or_runs_far_ahead(plan) -> None:
    """One snapshot with chunks of 2^20 tokens at the largest version was adopted by every peer: no prompt
    had a complete chunk (the group's routing matched nothing), no later plan could follow it, and each
    node's Sentry raised at its next refresh. A plan must cut as the group does and be at most
    MAX_VERSION_STEP ahead; a refused one changes nothing."""
    a, b = pair()
    prompt = list(range(10, 310))
    a.stored(prompt)
    for m in a.poll(1.0):
        b.receive("a", m, 1.0)
    assert b.search(prompt).holders == {"a"}
    snapshot = a.codec.encode(Snapshot("a", 9, 0, plan, ()))
    assert b.receive("a", snapshot, 2.0).reason == "a plan this group does not cut by, or too far ahead"
    assert b.plan.version == 0 and b.search(prompt).holders == {"a"}
    b.sentry.refresh()  # raised ValueError at the largest version
    step = ChunkPlan(lengths=(32,), version=MAX_VERSION_STEP, origin="a")
    assert b.receive("a", a.codec.encode(Snapshot("a", 10, 0, step, ())), 3.0).applied


def test_deltas_under_another_plan_are_ignored() -> None:
    a, b = pair()
    ahead = a.codec.encode(Delta("a", 1, 1, (0, "x"), ((True, (1, 2)),)))
    result = b.receive("a", ahead, 1.0)  # (0, "x") > (0, ""): its snapshot will carry the plan; ask for it
    assert result.reason == "newer plan" and result.reply is not None
    newer = ChunkPlan(lengths=(32,), version=3, origin="a")
    assert b.receive("a", a.codec.encode(Snapshot("a", 1, 0, newer, ())), 1.1).applied
    behind = a.codec.encode(Delta("a", 1, 1, (0, ""), ((True, (1, 2)),)))
    assert (b.receive("a", behind, 1.2).reason, b.plan) == ("older plan", newer)
    assert b.tree.entries("a") == 0
