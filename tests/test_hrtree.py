"""The HR-tree (search, insert, evict, reverse-index replace, speculative marks) and the Sentry's chunk plan."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planetserve.node.routing.hrtree import (
    ChunkHasher,
    HRTree,
    NodeTable,
    decode_path,
    encode_path,
    path_width,
)
from planetserve.node.routing.sentry import ChunkPlan, Sentry, SentryConfig, common_prefixes

KEY = b"group-key-0123456789abcdef012345"


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 50_000) for _ in range(n)]


def make_tree(*nodes: str, hash_bits: int = 8, plan: ChunkPlan | None = None, min_depth: int = 1) -> HRTree:
    tree = HRTree(ChunkHasher(plan or ChunkPlan(default_chunk=16), KEY, hash_bits), min_depth=min_depth)
    for n in nodes:
        tree.table.upsert(n, trusted=True)
    return tree


# -- hashing --


def test_chunk_hashes_are_keyed_deterministic_and_fit_the_width() -> None:
    plan = ChunkPlan(default_chunk=4)
    prompt = list(range(1000, 1040))
    a = ChunkHasher(plan, KEY, 8).path(prompt)
    assert a == ChunkHasher(plan, KEY, 8).path(prompt)
    assert len(a) == 10 and all(0 <= h < 256 for h in a)
    assert a != ChunkHasher(plan, b"another key", 8).path(prompt)
    for bits in (1, 4, 12, 32):
        assert all(0 <= h < 2**bits for h in ChunkHasher(plan, KEY, bits).path(prompt))
    assert ChunkHasher(plan, KEY, 8).path(prompt[:39]) == a[:9]  # only complete chunks
    for bad in (0, 33, True):
        with pytest.raises(ValueError, match=rf"hash_bits must be in \[1, 32\], got {bad!r}$"):
            ChunkHasher(plan, KEY, bad)
    with pytest.raises(ValueError, match="the group key must be 1 to"):
        ChunkHasher(plan, b"", 8)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 2\^32\)"):
        ChunkHasher(plan, KEY, 8).path([-1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 2\^32\)"):
        ChunkHasher(plan, KEY, 8).path([2**32, 2, 3, 4])


@given(st.integers(1, 32), st.data())
def test_path_encoding_round_trips(bits: int, data: st.DataObject) -> None:
    width = path_width(bits)
    path = tuple(data.draw(st.lists(st.integers(0, 2**bits - 1), max_size=20)))
    encoded = encode_path(path, width)
    assert len(encoded) == width * len(path)
    assert decode_path(encoded, width, bits) == path


def test_path_decoding_rejects_bad_lengths_and_wide_hashes() -> None:
    with pytest.raises(ValueError, match="whole number"):
        decode_path(b"\x00\x01\x02", 2, 16)
    with pytest.raises(ValueError, match="wider than 4 bits"):
        decode_path(b"\x01\x10", 1, 4)


# -- tree --


def test_insert_search_and_prefix_closure() -> None:
    rng = random.Random(1)
    tree = make_tree("a", "b")
    system = tokens(rng, 32)  # two chunks
    pa = system + tokens(rng, 48)
    pb = system + tokens(rng, 16)
    assert tree.insert("a", pa) == 5
    assert tree.insert("b", pb) == 3  # b's entries; the tree gains one node, the rest is shared
    assert len(tree) == 6

    hit = tree.search(pa + tokens(rng, 5))
    assert (hit.depth, hit.holders, hit.matched) == (5, {"a"}, True)
    shared = tree.search(system + tokens(rng, 40))
    assert (shared.depth, shared.holders) == (2, {"a", "b"})
    miss = tree.search(tokens(rng, 64))
    assert miss.depth <= 1  # a chance 8-bit collision at most
    assert tree.search(system[:10]) == tree.search([])  # less than one chunk matches nothing
    assert not tree.search([]).matched and tree.search([]).holders == frozenset()


def test_match_threshold() -> None:
    rng = random.Random(2)
    tree = make_tree("a", min_depth=3)
    prompt = tokens(rng, 64)
    tree.insert("a", prompt)
    assert not tree.search(prompt[:32]).matched
    assert tree.search(prompt[:48]).matched


def test_evict_drops_the_subtree_of_that_node_only_and_prunes() -> None:
    rng = random.Random(3)
    tree = make_tree("a", "b")
    system = tokens(rng, 32)
    p1, p2 = system + tokens(rng, 32), system + tokens(rng, 32)
    tree.insert("a", p1)
    tree.insert("a", p2)
    tree.insert("b", p1)
    assert tree.entries("a") == 6 and tree.entries("b") == 4

    assert tree.evict("a", system[:16]) == 6  # the first chunk and everything below, for a only
    assert tree.entries("a") == 0
    assert tree.search(p1).holders == {"b"} and tree.search(p1).depth == 4
    assert tree.search(p2).depth == 2  # p2's own chunks were a's alone: pruned
    assert len(tree) == 4

    assert tree.evict("b", p1[:48]) == 2  # the third chunk and the one below it
    assert tree.search(p1).depth == 2
    assert tree.evict("b", tokens(rng, 16)) == 0
    assert tree.evict_path("b", ()) == 2
    assert len(tree) == 0


def test_replace_touches_only_that_node() -> None:
    rng = random.Random(4)
    tree = make_tree("big", "small")
    big_prompts = [tokens(rng, 64) for _ in range(300)]
    for p in big_prompts:
        tree.insert("big", p)
    tree.insert("small", big_prompts[0])
    before = {p: tree.search(p) for p in map(tuple, big_prompts[1:])}

    class Untouchable(set):
        def __iter__(self):  # type: ignore[override]
            raise AssertionError("replace walked another node's entries")

    slot = tree.table.get("big").slot
    tree._by_holder[slot] = Untouchable(tree._by_holder[slot])

    new = tokens(rng, 32)
    added, dropped = tree.replace("small", [tree.hasher.path(new)])
    assert (added, dropped) == (2, 4)
    assert tree.paths("small") == {tree.hasher.path(new)}
    assert tree.search(big_prompts[0]).holders == {"big"}
    assert all(tree.search(p) == result for p, result in before.items())


def test_replace_keeps_unchanged_entries_and_prunes_stale_ones() -> None:
    rng = random.Random(5)
    tree = make_tree("a")
    p1, p2, p3 = (tokens(rng, 48) for _ in range(3))
    tree.insert("a", p1)
    tree.insert("a", p2)
    h = tree.hasher.path
    assert tree.replace("a", [h(p1), h(p3)]) == (3, 3)
    assert tree.paths("a") == {h(p1), h(p3)}
    assert len(tree) == 6


def test_speculative_marks_expire_unless_confirmed() -> None:
    rng = random.Random(6)
    tree = make_tree("a", "b")
    p1, p2 = tokens(rng, 48), tokens(rng, 48)
    path1, path2 = tree.hasher.path(p1), tree.hasher.path(p2)
    assert tree.insert_path("a", path1, speculative_until=10.0) == 3
    assert tree.insert_path("b", path2, speculative_until=10.0) == 3
    assert tree.search(p1).holders == {"a"} and tree.speculative("a") == 3
    tree.insert("b", p2)  # b confirms
    assert tree.speculative("b") == 0
    assert tree.expire(9.9) == 0
    assert tree.expire(10.0) == 3
    assert tree.search(p1).depth == 0 and tree.search(p2).holders == {"b"}
    assert len(tree) == 3


def test_speculative_refresh_cap_and_eviction() -> None:
    rng = random.Random(7)
    tree = make_tree("a")
    tree.max_speculative = 4
    prompt = tokens(rng, 96)
    assert tree.insert_path("a", tree.hasher.path(prompt), speculative_until=5.0) == 4
    assert tree.search(prompt).depth == 4
    tree.insert_path("a", tree.hasher.path(prompt[:32]), speculative_until=20.0)  # refreshed
    assert tree.expire(6.0) == 2
    assert tree.search(prompt).depth == 2
    assert tree.evict("a", prompt) == 0  # eviction concerns confirmed entries only
    tree.clear_node("a")
    assert len(tree) == 0 and tree.speculative("a") == 0
    assert tree.expire(30.0) == 0


def test_remove_node_frees_its_slot() -> None:
    rng = random.Random(8)
    tree = make_tree("a", "b")
    prompt = tokens(rng, 32)
    tree.insert("a", prompt)
    tree.insert("b", prompt)
    tree.remove_node("a")
    assert "a" not in tree.table and tree.search(prompt).holders == {"b"}
    tree.table.upsert("c")
    tree.insert("c", prompt)
    assert tree.search(prompt).holders == {"b", "c"}
    with pytest.raises(KeyError):
        tree.insert("a", prompt)


def test_node_table_bounds_and_ids() -> None:
    table = NodeTable(max_nodes=2)
    a = table.upsert("a", address="x:1")
    b = table.upsert("b")
    assert table.ids((1 << a.slot) | (1 << b.slot)) == {"a", "b"}
    with pytest.raises(ValueError, match="full"):
        table.upsert("c")
    assert table.upsert("a", trusted=True).address == "x:1"
    assert len(table) == 2 and {e.node_id for e in table} == {"a", "b"}


ops = st.lists(st.tuples(st.sampled_from(["insert", "evict"]), st.sampled_from("abc"),
                         st.lists(st.integers(0, 3), max_size=4).map(tuple)), max_size=40)


@settings(max_examples=150)
@given(ops, st.lists(st.integers(0, 3), max_size=5).map(tuple))
def test_tree_matches_a_reference_model(operations: list[tuple[str, str, tuple[int, ...]]],
                                        query: tuple[int, ...]) -> None:
    tree = make_tree("a", "b", "c", hash_bits=2)
    held: dict[str, set[tuple[int, ...]]] = {"a": set(), "b": set(), "c": set()}
    for op, who, path in operations:
        if op == "insert":
            tree.insert_path(who, path)
            held[who] |= {path[:i] for i in range(1, len(path) + 1)}
        else:
            tree.evict_path(who, path)
            held[who] = {p for p in held[who] if p[: len(path)] != path}
    prefixes = set().union(*held.values())
    assert len(tree) == len(prefixes)
    for who in held:
        assert tree.entries(who) == len(held[who])
        assert tree.paths(who) == {p for p in held[who] if not any(q[: len(p)] == p and q != p for q in held[who])}
    depth = max((i for i in range(len(query) + 1) if query[:i] in prefixes), default=0)
    result = tree.search_path(query)
    assert result.depth == depth
    assert result.holders == ({w for w in held if query[:depth] in held[w]} if depth else set())


# -- Sentry --


def workload(rng: random.Random, count: int) -> tuple[list[list[int]], dict[str, list[int]]]:
    """Prompts behind three system prompts: 'tool' extends 'base'; 'code' is unrelated."""
    base = tokens(rng, 100)
    systems = {"base": base, "tool": base + tokens(rng, 200), "code": tokens(rng, 250)}
    prompts = []
    for _ in range(count):
        r = rng.random()
        system = systems["base"] if r < 0.35 else systems["tool"] if r < 0.65 else \
            systems["code"] if r < 0.9 else []
        prompts.append(system + tokens(rng, rng.randrange(10, 300)))
    return prompts, systems


def test_sentry_finds_system_prompts_and_builds_l_per_appendix_a3() -> None:
    rng = random.Random(10)
    prompts, _ = workload(rng, 1000)
    sentry = Sentry("n1", SentryConfig(delta=8, refresh_every=1000))
    plans = [p for p in map(sentry.observe, prompts) if p is not None]
    assert sentry.detect() == [100, 250, 300]
    assert len(plans) == 1 and plans[0] is sentry.plan
    plan = sentry.plan
    # l1 = s1, l2n = δ, l2n+1 = s(n+1) - s(n) - δ
    assert plan.lengths == (100, 8, 250 - 100 - 8, 8, 300 - 250 - 8, 8)
    assert plan.id == (1, "n1")
    assert sentry.chunk(list(range(500))) == [(0, 100), (100, 108), (108, 250), (250, 258), (258, 300),
                                              (300, 308), (308, 372), (372, 436), (436, 500)]
    assert sentry.chunk(list(range(99))) == []


def test_sentry_shared_system_prompt_is_one_chunk_path() -> None:
    rng = random.Random(11)
    prompts, systems = workload(rng, 1000)
    sentry = Sentry("n1", SentryConfig(refresh_every=1000))
    for p in prompts:
        sentry.observe(p)
    tree = HRTree(ChunkHasher(sentry.plan, KEY))
    tree.table.upsert("a")
    tree.insert("a", systems["tool"] + tokens(rng, 40))
    fresh = tree.search(systems["tool"] + tokens(rng, 40))  # a new question behind the same system prompt
    # base (100), separator (8), up to 'code' (142), separator (8), rest of tool (42): then the question
    assert fresh.depth == 5 and fresh.holders == {"a"}


def test_sentry_ignores_chance_shared_query_words() -> None:
    rng = random.Random(12)
    system = tokens(rng, 64)
    what_is = [7, 8]
    sentry = Sentry("n", SentryConfig(refresh_every=10**9, delta=8))
    for i in range(400):
        sentry.observe(system + (what_is if i % 3 == 0 else []) + tokens(rng, 30))
    assert sentry.detect() == [64]


def test_sentry_is_deterministic_and_order_independent_within_its_sample() -> None:
    rng = random.Random(13)
    prompts, _ = workload(rng, 600)
    a, b = Sentry("n", SentryConfig(refresh_every=600)), Sentry("n", SentryConfig(refresh_every=600))
    for p in prompts:
        a.observe(p)
    for p in reversed(prompts):
        b.observe(p)
    assert a.plan == b.plan and a.plan.version == 1


def test_sentry_refreshes_every_n_and_only_versions_real_changes() -> None:
    rng = random.Random(14)
    prompts, _ = workload(rng, 900)
    sentry = Sentry("n", SentryConfig(refresh_every=300))
    results = [sentry.observe(p) for p in prompts]
    assert [i for i, r in enumerate(results) if r is not None] == [299]  # 599 and 899: L unchanged
    assert sentry.plan.version == 1


def test_sentry_block_alignment() -> None:
    rng = random.Random(15)
    prompts, _ = workload(rng, 1000)
    sentry = Sentry("n", SentryConfig(refresh_every=1000, block_size=16, default_chunk=50))
    for p in prompts:
        sentry.observe(p)
    plan = sentry.plan
    assert plan.block_size == 16 and plan.default_chunk == 64
    assert all(end % 16 == 0 for _, end in plan.spans(2000))
    # 100 -> 96, 108 -> 96 (merged), 250 -> 240, 258 -> 256, 300 -> 288, 308 -> 304
    assert plan.lengths == (96, 144, 16, 32, 16)
    with pytest.raises(ValueError, match="multiple of block_size"):
        ChunkPlan(lengths=(10,), block_size=16)


def test_plan_adoption_orders_by_version_then_origin() -> None:
    sentry = Sentry("n")
    older = ChunkPlan(lengths=(32,), version=0, origin="z")
    newer = ChunkPlan(lengths=(48,), version=2, origin="a")
    tie_winner = ChunkPlan(lengths=(64,), version=2, origin="b")
    assert sentry.adopt(older)
    assert sentry.adopt(newer) and sentry.adopt(tie_winner)
    assert not sentry.adopt(newer) and sentry.plan is tie_winner


def test_plan_wire_round_trip_and_validation() -> None:
    plan = ChunkPlan(lengths=(100, 8, 92), default_chunk=64, version=3, origin="n7")
    assert ChunkPlan.from_wire(plan.to_wire()) == plan
    for bad in ([3, "n", [0], 64, 1], [3, "n", [True], 64, 1], [3, "n", [1], 0, 1], [-1, "n", [], 64, 1],
                [3, "n", [1] * 600, 64, 1], [3, 5, [], 64, 1], "plan", [3, "n", [], 64]):
        with pytest.raises((ValueError, TypeError)):
            ChunkPlan.from_wire(bad)


@given(st.lists(st.integers(1, 40), max_size=6), st.integers(1, 30), st.integers(0, 400))
def test_spans_tile_the_prompt_with_complete_chunks(lengths: list[int], default: int, n: int) -> None:
    plan = ChunkPlan(lengths=tuple(lengths), default_chunk=default)
    spans = plan.spans(n)
    assert all(s < e <= n for s, e in spans)
    assert [s for s, _ in spans] == [0, *(e for _, e in spans)][: len(spans)]
    covered = spans[-1][1] if spans else 0
    assert plan.span_at(covered)[1] > n or covered == n  # the next chunk would not be complete
    for s, e in spans:
        assert plan.span_at(s) == (s, e) and plan.span_at(e - 1) == (s, e)


@settings(max_examples=200)
@given(st.lists(st.lists(st.integers(0, 2), max_size=7), min_size=1, max_size=14), st.integers(2, 4),
       st.integers(1, 3))
def test_common_prefixes_match_brute_force(samples: list[list[int]], threshold: int, min_len: int) -> None:
    seqs = [tuple(s) for s in samples]

    def count(p: tuple[int, ...]) -> int:
        return sum(1 for s in seqs if s[: len(p)] == p)

    expected = []
    for p in {s[:i] for s in seqs for i in range(min_len, len(s) + 1)}:
        c = count(p)
        common_children = sum(count((*p, t)) for t in range(3) if count((*p, t)) >= threshold)
        if c >= threshold and c - common_children >= threshold:
            expected.append((len(p), c - common_children))
    found = common_prefixes(seqs, threshold, min_len)
    assert sorted(found) == sorted(expected)
