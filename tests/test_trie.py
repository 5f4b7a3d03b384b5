"""The Merkle trie: canonical roots, prefix proofs, and that no tampering gets through."""

from __future__ import annotations

import contextlib
import hashlib
import random

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planetserve.chain import trie
from planetserve.chain.trie import (
    EMPTY_ROOT,
    InnerOpening,
    LeafOpening,
    MemoryNodes,
    PrefixProof,
    ProofError,
    ProofKind,
    apply_changes,
    make_prefix_proof,
    subtree_root,
    verify_key,
    verify_prefix,
)

# Small alphabets make long shared prefixes, keys that are prefixes of others, and deep tries.
key_st = st.one_of(
    st.text(alphabet="ab", min_size=1, max_size=10),
    st.text(alphabet="a/\x01\x7f0", min_size=1, max_size=6),
    st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=127), min_size=1, max_size=5),
).map(lambda s: s.encode())
value_st = st.binary(max_size=12)
state_st = st.dictionaries(key_st, value_st, max_size=40)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- an independent reference implementation of the documented hashing ----------------------------


def _ref_root(items: dict[bytes, bytes]) -> bytes:
    """Recursive, by the module docstring: a node per byte position where the terminated keys
    below it first differ, a child per distinct byte there."""
    if not items:
        return hashlib.sha256(b"\x02").digest()

    def node(tks: list[bytes]) -> bytes:
        if len(tks) == 1:
            k = tks[0][:-1]
            vh = hashlib.sha256(items[k]).digest()
            return hashlib.sha256(b"\x00" + len(k).to_bytes(4, "big") + k + vh).digest()
        d = 0
        while all(tk[d] == tks[0][d] for tk in tks):
            d += 1
        branches = sorted({tk[d] for tk in tks})
        children = b"".join(bytes([c]) + node([tk for tk in tks if tk[d] == c]) for c in branches)
        body = b"\x01" + d.to_bytes(2, "big") + tks[0][:d] + bytes([len(branches) - 1]) + children
        return hashlib.sha256(body).digest()

    return node(sorted(k + b"\x00" for k in items))


class MemTrie:
    """Nodes in a dict, updated through apply_changes as the store does."""

    def __init__(self, tell_current: bool = True) -> None:
        self.nodes = MemoryNodes()
        self.root = EMPTY_ROOT
        self.state: dict[bytes, bytes] = {}
        self.tell_current = tell_current
        self.loads = 0
        self.loaded_leaves = 0

    def load(self, hashes: list[bytes]) -> dict[bytes, trie.NodeRecord]:
        self.loads += 1
        got = self.nodes.load(hashes)
        self.loaded_leaves += sum(1 for body, _ in got.values() if body[0] == 0)
        return got

    def apply(self, changes: dict[bytes, bytes | None], current: dict[bytes, bytes] | None = None) -> bytes:
        before = self.reachable()
        if current is None and self.tell_current:
            current = self.state
        self.root, ref, new, replaced, previous = apply_changes(
            self.root, self.root, sorted(changes.items()), self.load, current=current
        )
        assert previous == {k: self.state.get(k) for k in changes}
        assert self.root == EMPTY_ROOT or ref == self.root  # refs are hashes here
        self.nodes.add(new)
        after = self.reachable()
        # what the update reports replaced is what left the trie (a rewrite may recreate a node)
        assert set(replaced) <= before and set(replaced) - after == before - after
        for k, v in changes.items():
            if v is None:
                self.state.pop(k, None)
            else:
                self.state[k] = v
        return self.root

    def reachable(self) -> set[bytes]:
        todo = [] if self.root == EMPTY_ROOT else [self.root]
        seen = set()
        while todo:
            h = todo.pop()
            seen.add(h)
            todo += self.nodes.record(h)[1]
        return seen

    def prove(self, prefix: bytes) -> tuple[list[tuple[bytes, bytes]], PrefixProof]:
        proof, sub = make_prefix_proof(self.root, self.root, prefix, self.nodes.record)
        entries = trie.collect_leaves(sub[1], self.load) if sub is not None else []
        return entries, proof

    def expected(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        return sorted((k, v) for k, v in self.state.items() if (k + b"\x00").startswith(prefix))


def mem_trie(state: dict[bytes, bytes], tell_current: bool = True) -> MemTrie:
    t = MemTrie(tell_current)
    t.apply(dict(state))
    return t


def prefixes_for(state: dict[bytes, bytes], rnd: random.Random) -> list[bytes]:
    out = {b"", b"a", b"b", b"ab", b"zz", b"a/", b"\x7f", b"q\x00"}
    for k in list(state)[:12]:
        out.add(k + b"\x00")
        for i in range(1, len(k) + 1):
            out.add(k[:i])
        out.add(k + b"a")
        out.add(k[:-1] + bytes([(k[-1] % 127) + 1]))
    for _ in range(5):
        out.add(bytes(rnd.randrange(1, 128) for _ in range(rnd.randrange(1, 4))))
    return sorted(out)


# -- canonical roots ------------------------------------------------------------------------------


def test_empty_root_constant() -> None:
    assert hashlib.sha256(b"\x02").digest() == EMPTY_ROOT
    assert subtree_root([]) == EMPTY_ROOT


def test_known_answer() -> None:
    """Pins the encodings: any change to them changes these hashes."""
    leaf = hashlib.sha256(b"\x00\x00\x00\x00\x01a" + hashlib.sha256(b"1").digest()).digest()
    assert subtree_root([(b"a", b"1")]) == leaf
    assert subtree_root([(b"a", b"1"), (b"b", b"2")]) == _ref_root({b"a": b"1", b"b": b"2"})
    root = subtree_root([(b"a", b"1"), (b"ab", b"2"), (b"b", b"3")])
    assert root.hex() == _ref_root({b"a": b"1", b"ab": b"2", b"b": b"3"}).hex()
    assert root.hex() == "7e8162b19fdf3fcce60c2818fddb965649bcdc8adf11d9dab8862f06f76bb0e9"


@SETTINGS
@given(state_st)
def test_builder_matches_reference(state: dict[bytes, bytes]) -> None:
    assert subtree_root(sorted(state.items())) == _ref_root(state)


@SETTINGS
@given(state_st, st.randoms(use_true_random=False))
def test_root_independent_of_insertion_order(state: dict[bytes, bytes], rnd: random.Random) -> None:
    expected = subtree_root(sorted(state.items()))
    items = list(state.items())
    rnd.shuffle(items)
    t = MemTrie()
    while items:
        cut = rnd.randrange(1, len(items) + 1)
        t.apply(dict(items[:cut]))
        items = items[cut:]
    assert t.root == expected
    # detours: insert junk, delete it again, delete and re-insert real keys
    junk = {k + b"~": b"junk" for k in list(state)[:5] if len(k) < trie.MAX_KEY_LEN}
    junk = {k: v for k, v in junk.items() if k not in state}
    t.apply(dict(junk))
    t.apply({k: None for k in junk})
    some = list(state)[:7]
    t.apply({k: None for k in some})
    t.apply({k: state[k] for k in some})
    assert t.root == expected


@SETTINGS
@given(state_st, st.dictionaries(key_st, st.one_of(st.none(), value_st), max_size=30))
def test_apply_changes_matches_rebuild(state: dict[bytes, bytes], changes: dict[bytes, bytes | None]) -> None:
    final = dict(state)
    for k, v in changes.items():
        if v is None:
            final.pop(k, None)
        else:
            final[k] = v
    for tell_current in (True, False):
        t = mem_trie(state, tell_current)
        t.apply(changes)
        assert t.root == subtree_root(sorted(final.items())) == _ref_root(final)


def test_present_values_spare_the_leaf_loads() -> None:
    """Told the present values, an update finds its own leaves by hash instead of loading them;
    a wrong present value only costs the load."""
    rnd = random.Random(3)
    state = {f"user/{rnd.getrandbits(128):032x}".encode(): b"v" for _ in range(2000)}
    updates = {k: b"w" for k in list(state)[:40]}
    expected = subtree_root(sorted({**state, **updates}.items()))
    told, untold = mem_trie(state), mem_trie(state, tell_current=False)
    told.loaded_leaves = untold.loaded_leaves = 0
    assert told.apply(updates) == untold.apply(updates) == expected
    assert told.loaded_leaves == 0 and untold.loaded_leaves == len(updates)
    wrong = mem_trie(state)
    wrong.loaded_leaves = 0
    assert wrong.apply(updates, current={k: b"stale" for k in updates}) == expected
    assert wrong.loaded_leaves == len(updates)


def test_apply_changes_loads_one_query_per_level() -> None:
    rnd = random.Random(7)
    state = {f"user/{rnd.getrandbits(128):032x}".encode(): b"v" for _ in range(3000)}
    t = mem_trie(state)
    t.loads = 0
    t.apply({k: b"w" for k in list(state)[:50]})
    assert t.loads < 40  # one per level of the trie, not one per node
    assert t.root == subtree_root(sorted({**state, **{k: b"w" for k in list(state)[:50]}}.items()))


def test_delete_everything() -> None:
    t = mem_trie({b"a": b"1", b"ab": b"2", b"b": b""})
    assert t.apply({b"a": None, b"ab": None, b"b": None, b"zz": None}) == EMPTY_ROOT


# -- inputs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (b"", "state key must not be empty"),
        (b"a\x00b", "is not ASCII without NUL"),
        (b"\x00", "is not ASCII without NUL"),
        ("é".encode(), "is not ASCII without NUL"),
        (b"\xff", "is not ASCII without NUL"),
        (b"a" * (trie.MAX_KEY_LEN + 1), f"longer than {trie.MAX_KEY_LEN}$"),
    ],
)
def test_invalid_keys(key: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        trie.check_key(key)
    with pytest.raises(ValueError, match=message):
        subtree_root([(key, b"v")])


def test_key_must_be_bytes() -> None:
    with pytest.raises(TypeError, match="state key must be bytes, not str"):
        trie.check_key("abc")  # type: ignore[arg-type]


def test_subtree_root_rejects_unsorted_and_duplicates() -> None:
    with pytest.raises(ValueError, match="increasing"):
        subtree_root([(b"b", b"1"), (b"a", b"2")])
    with pytest.raises(ValueError, match="increasing"):
        subtree_root([(b"a", b"1"), (b"a", b"2")])
    with pytest.raises(ValueError, match="changes not in strictly increasing key order"):
        apply_changes(EMPTY_ROOT, None, [(b"b", b"1"), (b"a", b"2")], dict)


@pytest.mark.parametrize(
    ("prefix", "message"),
    [
        (b"a\x00b", "is not ASCII with at most one final NUL"),
        (b"\x00", "selects the empty key, which cannot exist"),
        (b"\x80", "is not ASCII with at most one final NUL"),
        (b"ab\x00\x00", "is not ASCII with at most one final NUL"),
    ],
)
def test_invalid_prefixes(prefix: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        verify_prefix(EMPTY_ROOT, prefix, [], PrefixProof(ProofKind.EMPTY))


# -- proofs verify -------------------------------------------------------------------------------


@SETTINGS
@given(state_st, st.randoms(use_true_random=False))
def test_prefix_proofs_verify(state: dict[bytes, bytes], rnd: random.Random) -> None:
    t = mem_trie(state)
    for prefix in prefixes_for(state, rnd):
        entries, proof = t.prove(prefix)
        assert entries == t.expected(prefix)
        decoded = PrefixProof.decode(proof.encode())
        assert decoded == proof
        verify_prefix(t.root, prefix, entries, decoded)
        if prefix.endswith(b"\x00"):
            key = prefix[:-1]
            verify_key(t.root, key, state.get(key), decoded)
        if proof.kind is ProofKind.SUBTREE:
            # the subtree is the highest one under the prefix: its parent's prefix is shorter
            assert not proof.steps or proof.steps[-1][0] < len(prefix)


def test_empty_trie_and_single_key() -> None:
    t = MemTrie()
    for prefix in (b"", b"a", b"a\x00"):
        entries, proof = t.prove(prefix)
        assert entries == [] and proof.kind is ProofKind.EMPTY
        verify_prefix(EMPTY_ROOT, prefix, [], proof)
        with pytest.raises(ProofError):
            verify_prefix(EMPTY_ROOT, prefix, [(b"a", b"1")], proof)
    t.apply({b"key": b"value"})
    for prefix, want in [
        (b"", 1),
        (b"k", 1),
        (b"key", 1),
        (b"key\x00", 1),
        (b"kez", 0),
        (b"keyx", 0),
        (b"j", 0),
        (b"ke", 1),
    ]:
        entries, proof = t.prove(prefix)
        assert len(entries) == want
        verify_prefix(t.root, prefix, entries, proof)
    _, proof = t.prove(b"kez")
    assert proof.kind is ProofKind.LEAF_OPENING
    with pytest.raises(ProofError, match="does not diverge"):
        verify_prefix(t.root, b"key", [], proof)


def test_a_10k_entry_prefix_proof_round_trips_and_verifies() -> None:
    """The size the signed lists reach (bench/list_verify.py measures its speed)."""
    rnd = random.Random(1)
    state = {f"node/{rnd.getrandbits(256):064x}".encode(): rnd.randbytes(200) for _ in range(10_000)}
    state.update({f"user/{rnd.getrandbits(256):064x}".encode(): b"u" for _ in range(2_000)})
    t = mem_trie(state)
    entries, proof = t.prove(b"node/")
    assert len(entries) == 10_000
    verify_prefix(t.root, b"node/", entries, PrefixProof.decode(proof.encode()))
    with pytest.raises(ProofError, match="recomputed root does not match app hash"):
        verify_prefix(t.root, b"node/", entries[1:], PrefixProof.decode(proof.encode()))


# -- soundness: nothing else verifies ------------------------------------------------------------


@SETTINGS
@given(state_st, st.randoms(use_true_random=False))
def test_proofs_only_verify_the_true_answer(state: dict[bytes, bytes], rnd: random.Random) -> None:
    """Cross every proof with every prefix and every candidate answer: whenever verification
    passes, the answer is exactly the true one for that prefix."""
    t = mem_trie(state)
    prefixes = prefixes_for(state, rnd)[:14]
    proofs = [t.prove(p)[1] for p in prefixes]
    answers = {tuple(t.expected(p)) for p in prefixes}
    answers.add(())
    for prefix in prefixes:
        truth = t.expected(prefix)
        for proof in proofs:
            for answer in answers:
                try:
                    verify_prefix(t.root, prefix, list(answer), proof)
                except ProofError:
                    continue
                assert list(answer) == truth, (prefix, answer, proof)


def _tamper_entries(entries: list[tuple[bytes, bytes]], prefix: bytes, rnd: random.Random):  # type: ignore[no-untyped-def]
    out = []
    if entries:
        i = rnd.randrange(len(entries))
        out.append(("drop", entries[:i] + entries[i + 1 :]))
        k, v = entries[i]
        out.append(("value", entries[:i] + [(k, v + b"!")] + entries[i + 1 :]))
        out.append(("dup", entries[: i + 1] + entries[i:]))
        if len(entries) > 1:
            j = (i + 1) % len(entries)
            swapped = list(entries)
            swapped[i], swapped[j] = swapped[j], swapped[i]
            out.append(("reorder", swapped))
        out.append(("outside", [*entries, (b"\x7f" * 3 + b"zz", b"x")]))
    if not prefix.endswith(b"\x00") and len(prefix) < trie.MAX_KEY_LEN:
        extra = prefix + b"\x01\x01new"
        if all(k != extra for k, _ in entries):
            out.append(("add", sorted([*entries, (extra, b"x")])))
    return out


def _tamper_proof(proof: PrefixProof, rnd: random.Random) -> list[PrefixProof]:
    out = []
    steps = list(proof.steps)

    def with_step(i: int, step: tuple) -> PrefixProof:
        return PrefixProof(proof.kind, (*steps[:i], step, *steps[i + 1 :]), proof.opening)

    if steps:
        i = rnd.randrange(len(steps))
        d, sibs = steps[i]
        c, h = sibs[0]
        out.append(with_step(i, (d, ((c, bytes([h[0] ^ 1]) + h[1:]), *sibs[1:]))))
        out.append(PrefixProof(proof.kind, tuple(steps[:i] + steps[i + 1 :]), proof.opening))
        if len(sibs) > 1:
            out.append(with_step(i, (d, sibs[1:])))  # a sibling left out
        if c + 1 < 128 and (len(sibs) == 1 or sibs[1][0] > c + 1):
            out.append(with_step(i, (d, ((c + 1, h), *sibs[1:]))))  # a sibling moved to another byte
        for delta in (-1, 1):
            if 0 <= d + delta < trie.MAX_DEPTH:
                out.append(with_step(i, (d + delta, sibs)))
    op = proof.opening
    if isinstance(op, InnerOpening):
        (c0, h0), (c1, h1), *more = op.children
        swapped = ((c0, h1), (c1, h0), *more)
        out.append(PrefixProof(proof.kind, proof.steps, InnerOpening(op.depth, op.prefix, swapped)))
        zeroed = ((c0, bytes(32)), (c1, h1), *more)
        out.append(PrefixProof(proof.kind, proof.steps, InnerOpening(op.depth, op.prefix, zeroed)))
        if more:
            out.append(PrefixProof(proof.kind, proof.steps, InnerOpening(op.depth, op.prefix, op.children[:-1])))
    if isinstance(op, LeafOpening):
        out.append(PrefixProof(proof.kind, proof.steps, LeafOpening(op.key + b"x", op.value_hash)))
        out.append(PrefixProof(proof.kind, proof.steps, LeafOpening(op.key, bytes(32))))
    if proof.kind is not ProofKind.EMPTY:
        out.append(PrefixProof(ProofKind.EMPTY, (), None))
    return out


@SETTINGS
@given(state_st, st.randoms(use_true_random=False))
def test_tampering_fails(state: dict[bytes, bytes], rnd: random.Random) -> None:
    t = mem_trie(state)
    for prefix in prefixes_for(state, rnd)[:10]:
        entries, proof = t.prove(prefix)
        for _, bad in _tamper_entries(entries, prefix, rnd):
            with pytest.raises(ProofError):
                verify_prefix(t.root, prefix, bad, proof)
        for bad_proof in _tamper_proof(proof, rnd):
            with pytest.raises(ProofError):
                verify_prefix(t.root, prefix, entries, bad_proof)
        # a wrong app hash
        with pytest.raises(ProofError, match="does not match app hash"):
            verify_prefix(hashlib.sha256(t.root).digest(), prefix, entries, proof)
        # truncated encodings never decode
        encoded = proof.encode()
        for cut in {0, 1, len(encoded) // 2, len(encoded) - 1}:
            with pytest.raises(ProofError):
                PrefixProof.decode(encoded[:cut])
        # extra bytes
        with pytest.raises(ProofError):
            PrefixProof.decode(encoded + b"\x00")


@SETTINGS
@given(state_st)
def test_absence_of_present_key_cannot_be_proven(state: dict[bytes, bytes]) -> None:
    assume(state)
    t = mem_trie(state)
    absent = [k + b"\x01zz" for k in state if k + b"\x01zz" not in state][:5]
    proofs = [t.prove(k + b"\x00")[1] for k in absent] + [t.prove(b"\x7f\x7f")[1]]
    for key in list(state)[:10]:
        for proof in proofs:
            with pytest.raises(ProofError):
                verify_key(t.root, key, None, proof)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_are_not_a_proof(data: bytes) -> None:
    t = mem_trie({b"a": b"1", b"ab": b"2", b"b": b"3"})
    try:
        proof = PrefixProof.decode(data)
    except ProofError:
        return
    for prefix, truth in [(b"a", [(b"a", b"1"), (b"ab", b"2")]), (b"c", [])]:
        try:
            verify_prefix(t.root, prefix, truth, proof)
        except ProofError:
            continue
        # a random proof that verifies must at least be a real one
        assert proof == t.prove(prefix)[1]


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**63), 2**64 - 1),
            st.binary(max_size=40),
            st.text(max_size=5),
        ),
        lambda inner: st.lists(inner, max_size=5),
        max_leaves=12,
    )
)
def test_random_msgpack_shapes_are_rejected_cleanly(obj: object) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    with contextlib.suppress(ProofError):
        PrefixProof.decode(data)


def test_decode_strictness() -> None:
    t = mem_trie({b"a": b"1", b"ab": b"2", b"b": b"3"})
    _, proof = t.prove(b"ab")
    good = proof.encode()
    assert PrefixProof.decode(good) == proof
    version, kind, steps, opening = msgpack.unpackb(good)
    cases = [
        [1, kind, steps, opening],  # the binary trie's version
        [version, 9, steps, opening],  # unknown kind
        [version, kind, steps + b"\x00", opening],  # partial step
        [version, kind, steps, [1, b"a", b"\x01" + bytes(32) + b"\x02" + bytes(32)]],  # opening on a subtree
        [version, kind, steps],  # wrong arity
        [True, kind, steps, opening],  # bool for int
        [version, kind, steps.hex(), opening],  # str for bin
        {"v": 1},
    ]
    for case in cases:
        with pytest.raises(ProofError):
            PrefixProof.decode(msgpack.packb(case, use_bin_type=True))
    # the same value, non-canonically encoded (uint8 for a positive fixint)
    non_canonical = b"\x94\xcc\x02" + good[2:]
    with pytest.raises(ProofError, match="canonical"):
        PrefixProof.decode(non_canonical)
    with pytest.raises(ProofError, match="too|more than"):
        PrefixProof.decode(b"\x00" * (trie.MAX_PROOF_BYTES + 1))
    with pytest.raises(ProofError):
        PrefixProof.decode("text")  # type: ignore[arg-type]
    # steps must strictly increase
    bad_steps = (b"\x00\x05\x00" + b"a" + bytes(32)) * 2
    with pytest.raises(ProofError, match="increasing"):
        PrefixProof.decode(msgpack.packb([2, 0, bad_steps, None], use_bin_type=True))
    # a step whose siblings run past the end of the path
    with pytest.raises(ProofError, match="truncated"):
        PrefixProof.decode(msgpack.packb([2, 0, b"\x00\x05\x01" + b"a" + bytes(32), None], use_bin_type=True))
    for children, reason in (
        (b"\x01" + bytes(32), "2 to 128"),  # one child
        (b"\x02" + bytes(32) + b"\x01" + bytes(32), "strictly increasing"),
        (b"\x01" + bytes(32) + b"\x80" + bytes(32), "increasing order of key byte"),  # not a key byte
        (b"\x01" + bytes(32) + b"\x02" + bytes(31), "whole number"),
    ):
        with pytest.raises(ProofError, match=reason):
            PrefixProof.decode(msgpack.packb([2, 2, b"", [1, b"a", children]], use_bin_type=True))
    with pytest.raises(ProofError, match="prefix does not match its depth"):
        PrefixProof.decode(msgpack.packb([2, 2, b"", [2, b"a", b"\x01" + bytes(32) + b"\x02" + bytes(32)]],
                                         use_bin_type=True))  # fmt: skip


def test_error_messages_are_specific() -> None:
    t = mem_trie({b"user/a": b"1", b"user/b": b"2", b"node/x": b"3"})
    entries, proof = t.prove(b"user/")
    with pytest.raises(ProofError, match="entry key outside prefix"):
        verify_prefix(t.root, b"user/", [*entries, (b"vser", b"x")], proof)
    with pytest.raises(ProofError, match="entry key outside prefix: b'node/x'"):
        verify_prefix(t.root, b"user/", [(b"node/x", b"3"), *entries], proof)
    for bad, reason in (
        ((b"user/a",), "not enough values"),
        ((b"user/a", "1"), "value must be bytes"),
        ((b"user/\x00", b"1"), "not ASCII"),
        (None, "cannot unpack"),
    ):
        with pytest.raises(ProofError, match=f"malformed entry: .*{reason}"):
            verify_prefix(t.root, b"user/", [bad, *entries[1:]], proof)
    with pytest.raises(ProofError, match="recomputed root does not match app hash"):
        verify_prefix(t.root, b"user/", entries[:1], proof)
    absent = t.prove(b"nodf")[1]
    assert absent.kind is ProofKind.LEAF_OPENING
    with pytest.raises(ProofError, match="absence proof does not diverge from prefix"):
        verify_prefix(t.root, b"node/", [], absent)
    with pytest.raises(ProofError, match="not in strictly increasing"):
        verify_prefix(t.root, b"user/", entries[::-1], proof)
    with pytest.raises(ProofError, match="subtree proof with no entries"):
        verify_prefix(t.root, b"user/", [], proof)
    # "user/" has children a and b only: the node itself shows that no key starts with "user/c"
    missing, no_c = t.prove(b"user/c")
    assert missing == [] and no_c.kind is ProofKind.INNER_OPENING and no_c.opening.prefix == b"user/"
    verify_prefix(t.root, b"user/c", [], no_c)
    with pytest.raises(ProofError, match="absence proof does not diverge from prefix"):
        verify_prefix(t.root, b"user/a", [], no_c)  # it has a child for a
    (d, sibs), *_ = proof.steps  # the root's other child is "n"; claim it lies on the path too
    onpath = PrefixProof(proof.kind, ((d, (*sibs, (ord("u"), bytes(32)))),), None)
    with pytest.raises(ProofError, match="path sibling has the byte of the path itself"):
        verify_prefix(t.root, b"user/", entries, onpath)


def test_changes_shorter_than_the_trie_keys() -> None:
    """Node prefixes and leaf keys longer than every changed key."""
    state = {b"a" * 40 + bytes([c]): b"v" for c in range(33, 60)}
    state.update({b"b" * 30: b"w", b"a" * 41: b"x"})
    for changes in (
        {b"a": b"1"},
        {b"b": b"2", b"a" * 40 + b"!": None},
        {b"aa": None, b"c": b"3", b"a" * 39: b"4"},
        {b"b" * 30: None, b"b": b"5"},
    ):
        t = mem_trie(state)
        t.apply(dict(changes))
        final = {**state, **changes}
        expected = {k: v for k, v in final.items() if v is not None}
        assert t.root == subtree_root(sorted(expected.items()))


@SETTINGS
@given(state_st, st.lists(st.tuples(key_st, st.one_of(st.none(), value_st)), max_size=25))
def test_single_key_updates(state: dict[bytes, bytes], ops: list[tuple[bytes, bytes | None]]) -> None:
    """One change per update, including deletes that collapse a node into its last child."""
    t = mem_trie(state)
    model = dict(state)
    for key, value in ops:
        t.apply({key: value})
        if value is None:
            model.pop(key, None)
        else:
            model[key] = value
        assert t.root == subtree_root(sorted(model.items()))
