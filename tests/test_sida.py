"""(n, k) S-IDA: recovery from any k cloves, tamper detection and tolerance, strict decoding, Shamir
secrecy and the reassembler's bounds."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
import secrets
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planetserve.node.overlay import sida
from planetserve.node.overlay.sida import (
    AuthenticationError,
    Clove,
    CloveError,
    MalformedCloveError,
    MismatchedSetError,
    Reassembler,
    TooFewClovesError,
    decode,
    encode,
    join,
    split,
)


def wire(cloves: list[Clove]) -> list[Clove]:
    """Cloves as a receiver sees them: through encode and decode."""
    return [decode(encode(c)) for c in cloves]


def flip(data: bytes, position: int, bit: int = 0) -> bytes:
    return data[:position] + bytes([data[position] ^ (1 << bit)]) + data[position + 1 :]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- recovery -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k"), [(4, 3), (2, 1), (6, 5), (5, 2), (1, 1), (3, 3), (6, 1), (7, 4), (8, 5)])
def test_every_k_subset_recovers(n: int, k: int) -> None:
    message = secrets.token_bytes(1000)
    cloves = wire(split(message, n, k))
    for subset in itertools.permutations(cloves, k) if n <= 5 else itertools.combinations(cloves, k):
        assert join(subset) == message
    assert join(cloves) == message


@pytest.mark.parametrize(("n", "k"), [(4, 3), (1, 1), (7, 4), (255, 200)])
def test_split_encoded_gives_the_wire_bytes_of_split(n: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The senders' path: with the same randomness, byte for byte what encoding `split`'s cloves gives."""
    message = secrets.token_bytes(3001)
    state = random.Random(7)
    monkeypatch.setattr(sida.secrets, "token_bytes", lambda size: state.randbytes(size))
    encoded = sida.split_encoded(message, n, k)
    state.seed(7)
    assert encoded == [sida.encode(c) for c in split(message, n, k)]
    assert sida.join(sida.decode(b) for b in encoded[n - k :]) == message
    with pytest.raises(ValueError, match="exceeds the 3000-byte limit"):
        sida.split_encoded(message, n, k, max_message=3000)


def test_large_parameters() -> None:
    message = secrets.token_bytes(5000)
    cloves = wire(split(message, 255, 200))
    rng = random.Random(7)
    subsets = [cloves[:200], cloves[55:], rng.sample(cloves, 200)]
    for subset in subsets:
        assert join(subset) == message
    with pytest.raises(TooFewClovesError):
        join(cloves[:199])


@pytest.mark.parametrize(("n", "k"), [(4, 3), (5, 2), (7, 7)])
def test_fewer_than_k_fails(n: int, k: int) -> None:
    cloves = split(b"attack at dawn", n, k)
    for size in range(k):
        for subset in itertools.combinations(cloves, size):
            with pytest.raises(TooFewClovesError):
                join(subset)


def test_duplicates_do_not_count_towards_k() -> None:
    cloves = split(b"hello", 4, 3)
    with pytest.raises(TooFewClovesError):
        join([cloves[0], cloves[0], cloves[1], cloves[1]])
    assert join([cloves[2], cloves[0], cloves[2], cloves[1]]) == b"hello"


@pytest.mark.parametrize("k", [1, 2, 3, 5, 7])
def test_sizes_around_multiples_of_k(k: int) -> None:
    n = k + 2
    for size in [*range(3 * k + 3), 1024 * k - 16 - 1, 1024 * k - 16, 1024 * k - 16 + 1]:
        message = secrets.token_bytes(size)
        cloves = wire(split(message, n, k))
        assert join(cloves[:k]) == message
        assert join(cloves[n - k :]) == message


def test_size_limit() -> None:
    assert join(split(bytes(1000), max_message=1000)) == bytes(1000)
    with pytest.raises(ValueError, match="limit"):
        split(bytes(1001), max_message=1000)
    big = encode(split(bytes(1001))[0])
    with pytest.raises(MalformedCloveError, match="limit"):
        decode(big, max_message=1000)
    assert decode(big, max_message=1001).length == 1001 + sida.TAG_SIZE


def test_default_limit() -> None:
    limit = sida.DEFAULT_MAX_MESSAGE
    message = secrets.token_bytes(limit)
    cloves = wire(split(message))
    assert join(cloves[1:]) == message
    with pytest.raises(ValueError, match="limit"):
        split(message + b"x")
    oversized = dataclasses.replace(cloves[0], length=limit + sida.TAG_SIZE + 1)
    with pytest.raises(MalformedCloveError, match="limit"):
        decode(encode(oversized))


@pytest.mark.parametrize(("n", "k"), [(0, 0), (3, 0), (3, 4), (256, 3), (256, 256)])
def test_bad_parameters(n: int, k: int) -> None:
    with pytest.raises(ValueError, match=f"need 1 <= k <= n <= {sida.MAX_N}, got n={n} k={k}$"):
        split(b"x", n, k)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3000), st.data())
def test_any_k_in_any_order_recovers(message: bytes, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 10))
    k = data.draw(st.integers(1, n))
    order = data.draw(st.permutations(range(n)))
    cloves = split(message, n, k)
    chosen = [encode(cloves[i]) for i in order[:k]]
    assert join([decode(c) for c in chosen]) == message
    reassembler = Reassembler()
    results = [reassembler.add(c) for c in chosen]
    assert results == [None] * (k - 1) + [message]
    assert all(reassembler.add(encode(cloves[i])) is None for i in order[k:])
    assert len(reassembler) == 0


# -- tampering ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("victim", range(4))
def test_tampered_fragment_detected_and_tolerated(victim: int) -> None:
    message = secrets.token_bytes(300)
    cloves = split(message)
    fragment = flip(cloves[victim].fragment, 17)
    bad = dataclasses.replace(cloves[victim], fragment=fragment)
    others = [c for i, c in enumerate(cloves) if i != victim]
    with pytest.raises(AuthenticationError):
        join([bad, *others[:2]])
    assert join([bad, *others]) == message
    assert join([*others, bad]) == message


@pytest.mark.parametrize("victim", range(4))
def test_tampered_key_share_detected_and_tolerated(victim: int) -> None:
    message = secrets.token_bytes(300)
    cloves = split(message)
    share = (int.from_bytes(cloves[victim].share) + 1) % sida.PRIME
    bad = dataclasses.replace(cloves[victim], share=share.to_bytes(sida.SHARE_SIZE))
    others = [c for i, c in enumerate(cloves) if i != victim]
    with pytest.raises(AuthenticationError):
        join([bad, *others[:2]])
    assert join([bad, *others]) == message


def test_padding_is_authenticated() -> None:
    message = b"x" * 20  # ciphertext of 36 bytes: 1 byte of padding at k = 5
    cloves = split(message, 6, 5)
    last = cloves[4]
    bad = dataclasses.replace(last, fragment=last.fragment[:-1] + b"\x01")
    with pytest.raises(AuthenticationError):
        join([*cloves[:4], bad])
    assert join([*cloves[:4], bad, cloves[5]]) == message


def test_every_bit_flip_is_detected_and_tolerated() -> None:
    message = secrets.token_bytes(50)
    cloves = split(message)
    raw = encode(cloves[0])
    for position in range(len(raw)):
        for bit in (0, 7):
            try:
                bad = decode(flip(raw, position, bit))
            except MalformedCloveError:
                assert join(cloves[1:]) == message
                continue
            with pytest.raises(CloveError):
                join([bad, *cloves[1:3]])
            assert join([bad, *cloves[1:]]) == message


def test_subset_search_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    cloves = [dataclasses.replace(c, nonce=bytes(12)) for c in split(b"m" * 50, 5, 2)]
    opened: list[int] = []
    real = sida._open

    def counting(subset: tuple[Clove, ...]) -> bytes | None:
        opened.append(len(subset))
        return real(subset)

    monkeypatch.setattr(sida, "_open", counting)
    with pytest.raises(AuthenticationError):
        join(cloves)
    assert opened == [2] * 10  # C(5, 2)
    good = split(b"m" * 50)
    bad = dataclasses.replace(good[0], fragment=flip(good[0].fragment, 0))
    with pytest.raises(AuthenticationError):
        join([bad, *good[1:]], max_attempts=1)


@pytest.mark.parametrize(
    "change",
    [
        {"message_id": bytes(16)},
        {"nonce": bytes(12)},
        {"n": 5},
        {"length": 300 + sida.TAG_SIZE + 1},  # same fragment size at k = 3
    ],
)
def test_header_is_bound_as_associated_data(change: dict[str, object]) -> None:
    """The whole set relabelled consistently still fails: the header is authenticated, not just
    compared."""
    message = secrets.token_bytes(300)
    cloves = [dataclasses.replace(c, **change) for c in split(message)]
    with pytest.raises(AuthenticationError):
        join(cloves)


def test_cloves_of_two_messages_do_not_mix() -> None:
    a, b = split(b"first message"), split(b"second message")
    with pytest.raises(MismatchedSetError):
        join([a[0], a[1], b[2], b[3]])
    with pytest.raises(MismatchedSetError):
        join([*a, *b])
    relabelled = dataclasses.replace(b[2], message_id=a[0].message_id, nonce=a[0].nonce, length=a[0].length)
    spliced = [relabelled, a[0], a[1]]
    with pytest.raises(AuthenticationError):
        join(spliced)


# -- decoding -----------------------------------------------------------------------------------------


def test_truncated_and_extended_bytes_rejected() -> None:
    raw = encode(split(b"some prompt text")[0])
    for size in range(len(raw)):
        with pytest.raises(MalformedCloveError):
            decode(raw[:size])
    with pytest.raises(MalformedCloveError):
        decode(raw + b"\x00")


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x01",
        bytes(200),
        b"\xff" * 200,
        b"\x01" + bytes(16) + bytes([4, 0, 1]) + bytes(200),  # k = 0
        b"\x01" + bytes(16) + bytes([3, 4, 1]) + bytes(200),  # k > n
        b"\x01" + bytes(16) + bytes([4, 3, 5]) + bytes(200),  # index > n
        b"\x01" + bytes(16) + bytes([4, 3, 0]) + bytes(200),  # index 0
    ],
)
def test_garbage_rejected(raw: bytes) -> None:
    with pytest.raises(MalformedCloveError):
        decode(raw)


def test_a_clove_of_the_earlier_version_is_refused() -> None:
    """Version 1 (ChaCha20-Poly1305, zfec for every n) does not mix with version 2: named, not guessed."""
    raw = bytearray(encode(split(b"abc")[0]))
    assert raw[0] == sida.VERSION == 2
    raw[0] = 1
    with pytest.raises(MalformedCloveError, match="unknown clove version 1"):
        decode(bytes(raw))


def test_share_outside_the_field_rejected() -> None:
    raw = bytearray(encode(split(b"abc")[0]))
    raw[sida.HEADER_SIZE - sida.SHARE_SIZE : sida.HEADER_SIZE] = b"\xff" * sida.SHARE_SIZE
    with pytest.raises(MalformedCloveError, match="field"):
        decode(bytes(raw))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_never_crash_decode(raw: bytes) -> None:
    with contextlib.suppress(MalformedCloveError):
        decode(raw)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 400), st.integers(0, 255))
def test_random_header_bytes_rejected_or_consistent(position: int, value: int) -> None:
    raw = bytearray(encode(split(bytes(64), 4, 3)[1]))
    raw[position % sida.HEADER_SIZE] = value
    try:
        clove = decode(bytes(raw))
    except MalformedCloveError:
        return
    assert len(encode(clove)) == len(raw)


def test_repr_hides_key_material() -> None:
    clove = split(b"secret prompt")[0]
    text = repr(clove)
    assert clove.share.hex() not in text and "share" not in text and "fragment" not in text


# -- Shamir -------------------------------------------------------------------------------------------


def test_shamir_roundtrip_any_k_points() -> None:
    secret = secrets.randbits(256)
    shares = sida.shamir_split(secret, 6, 4)
    for xs in itertools.combinations(range(1, 7), 4):
        assert sida.shamir_combine([(x, shares[x - 1]) for x in xs]) == secret


def test_k_minus_1_shares_are_uniform_whatever_the_secret() -> None:
    """Over a small field, the joint distribution of k - 1 shares is the same (uniform) for every
    secret: chi-square over p^2 cells, well below the 1e-6 tail, for two different secrets."""
    prime, per_cell = 11, 60
    cells = prime * prime
    for secret in (0, 7):
        counts = Counter(tuple(sida.shamir_split(secret, 3, 3, prime)[:2]) for _ in range(cells * per_cell))
        assert len(counts) == cells
        chi2 = sum((c - per_cell) ** 2 / per_cell for c in counts.values())
        assert chi2 < 230  # df = 120: mean 120, sd 15.5


def test_coefficients_come_from_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key, the message id, the nonce and the k - 1 coefficients all come from `secrets`: one read for
    the first three, one for the coefficients (66 bytes each, 521 bits kept)."""
    calls: list[int] = []
    real = secrets.token_bytes

    def recording(size: int) -> bytes:
        calls.append(size)
        return real(size)

    monkeypatch.setattr(sida.secrets, "token_bytes", recording)
    split(b"m", 5, 3)
    assert calls == [sida.KEY_SIZE + sida.ID_SIZE + sida.NONCE_SIZE, 2 * sida.SHARE_SIZE]


def test_a_draw_outside_the_field_is_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    draws = iter([b"\xff" * sida.SHARE_SIZE, (5).to_bytes(sida.SHARE_SIZE)])  # all ones masks to p itself
    monkeypatch.setattr(sida.secrets, "token_bytes", lambda size: next(draws))
    assert sida.random_elements(1) == [5]


def test_shares_and_ids_change_between_splits() -> None:
    first, second = split(b"same message"), split(b"same message")
    assert first[0].message_id != second[0].message_id
    assert first[0].nonce != second[0].nonce
    for a, b in zip(first, second, strict=True):
        assert a.share != b.share and a.fragment != b.fragment


# -- reassembler --------------------------------------------------------------------------------------


def test_reassembler_duplicates_and_order() -> None:
    cloves = [encode(c) for c in split(b"payload")]
    reassembler = Reassembler()
    assert reassembler.add(cloves[3]) is None
    assert reassembler.add(cloves[3]) is None
    assert reassembler.add(cloves[0]) is None
    assert reassembler.add(cloves[0]) is None
    assert reassembler.add(cloves[2]) == b"payload"
    assert reassembler.add(cloves[1]) is None
    assert len(reassembler) == 0 and reassembler.pending_bytes == 0


def test_reassembler_interleaved_messages() -> None:
    a, b = split(b"message a", 5, 3), split(b"message b", 4, 2)
    reassembler = Reassembler()
    results = [reassembler.add(encode(c)) for c in (a[4], b[3], a[0], b[1], a[2], b[0], a[1])]
    assert results == [None, None, None, b"message b", b"message a", None, None]
    assert len(reassembler) == 0


def test_reassembler_reports_then_tolerates_a_corrupt_clove() -> None:
    message = secrets.token_bytes(500)
    cloves = split(message)
    bad = dataclasses.replace(cloves[1], fragment=flip(cloves[1].fragment, 0))
    reassembler = Reassembler()
    assert reassembler.add(cloves[0]) is None
    assert reassembler.add(bad) is None
    with pytest.raises(AuthenticationError):
        reassembler.add(cloves[2])
    assert reassembler.add(cloves[3]) == message


def test_reassembler_forged_copy_does_not_shadow_the_genuine_clove() -> None:
    message = secrets.token_bytes(500)
    cloves = split(message)
    forged = dataclasses.replace(cloves[2], fragment=flip(cloves[2].fragment, 3))
    reassembler = Reassembler()
    assert reassembler.add(forged) is None
    assert reassembler.add(cloves[0]) is None
    with pytest.raises(AuthenticationError):
        reassembler.add(cloves[1])
    assert reassembler.add(cloves[2]) == message


def test_reassembler_attempt_budget() -> None:
    message = b"m" * 100
    cloves = split(message, 5, 2)
    bad = [dataclasses.replace(c, fragment=flip(c.fragment, 0)) for c in cloves[:2]]
    reassembler = Reassembler(max_attempts=1)
    assert reassembler.add(bad[0]) is None
    with pytest.raises(AuthenticationError):
        reassembler.add(bad[1])
    assert len(reassembler) == 0
    assert reassembler.add(cloves[2]) is None
    assert reassembler.add(cloves[3]) is None


def failing_set(n: int, k: int) -> list[Clove]:
    """A set built to make recovery search: valid key shares (each subset passes the key check) over
    random fragments (none authenticates)."""
    return [dataclasses.replace(c, fragment=secrets.token_bytes(len(c.fragment)))
            for c in split(secrets.token_bytes(4096), n, k)]


def test_a_set_built_to_make_recovery_search_is_refused_or_given_up_within_the_budget() -> None:
    """More cloves than `max_n` are refused before anything is stored; a set of 16 on 8 indices that
    no subset authenticates is given up once 16 subsets were tried (after its tenth clove: 1 + 8 + 36
    subsets include the eighth, ninth and tenth), where 128 let it run to its eleventh."""
    reassembler = Reassembler(max_n=16)
    for clove in split(b"x" * 1000, 17, 2):
        with pytest.raises(MalformedCloveError, match="a set of 17, more than the 16 taken here"):
            reassembler.add(encode(clove), "peer")
    assert len(reassembler) == 0 and reassembler.pending_bytes == 0
    cloves = failing_set(16, 8)
    for clove in cloves[:7]:
        assert reassembler.add(clove, "peer") is None
    for clove in cloves[7:10]:
        with pytest.raises(AuthenticationError):
            reassembler.add(clove, "peer")
    assert len(reassembler) == 0
    assert reassembler.add(cloves[10], "peer") is None  # given up: its late cloves are dropped


def test_reassembler_caps_pending_messages() -> None:
    reassembler = Reassembler(max_pending=2)
    sets = [split(bytes([i]) * 10) for i in range(3)]
    for cloves in sets:
        reassembler.add(cloves[0])
    assert len(reassembler) == 2 and reassembler.dropped == 1
    assert reassembler.add(sets[0][1]) is None  # the oldest went; its clove starts over
    assert reassembler.add(sets[2][1]) is None
    assert reassembler.add(sets[2][2]) == bytes([2]) * 10


def test_reassembler_caps_pending_bytes() -> None:
    cloves = [split(secrets.token_bytes(3000))[0] for _ in range(10)]
    cap = int(2.5 * cloves[0].size)
    reassembler = Reassembler(max_pending_bytes=cap)
    for clove in cloves:
        reassembler.add(clove)
        assert reassembler.pending_bytes <= cap
    assert len(reassembler) == 2 and reassembler.dropped == 8


def test_reassembler_caps_variants_and_sets() -> None:
    cloves = split(b"x" * 100)
    reassembler = Reassembler(max_variants=2, max_sets=2)
    for i in range(5):
        reassembler.add(dataclasses.replace(cloves[0], fragment=flip(cloves[0].fragment, i)))
    for i in range(5):
        reassembler.add(dataclasses.replace(cloves[0], length=cloves[0].length - 1, nonce=bytes([i]) * 12))
    assert reassembler.pending_bytes == 3 * cloves[0].size


def test_reassembler_expiry() -> None:
    clock = Clock()
    reassembler = Reassembler(ttl=10.0, clock=clock)
    cloves = split(b"late")
    reassembler.add(cloves[0])
    reassembler.add(cloves[1])
    clock.now = 10.0
    assert reassembler.expire() == 1
    assert len(reassembler) == 0 and reassembler.pending_bytes == 0
    assert reassembler.add(cloves[2]) is None
    clock.now = 15.0
    assert reassembler.add(cloves[0]) is None
    assert reassembler.add(cloves[1]) == b"late"


def test_reassembler_forgets_finished_ids_after_ttl() -> None:
    clock = Clock()
    reassembler = Reassembler(ttl=5.0, clock=clock)
    cloves = split(b"done")
    for c in cloves[:3]:
        reassembler.add(c)
    assert reassembler.add(cloves[3]) is None and len(reassembler) == 0
    clock.now = 6.0
    assert reassembler.add(cloves[3]) is None and len(reassembler) == 1


def test_reassembler_enforces_its_size_limit() -> None:
    reassembler = Reassembler(max_message=100)
    clove = split(bytes(101))[0]
    with pytest.raises(MalformedCloveError):
        reassembler.add(clove)
    with pytest.raises(MalformedCloveError):
        reassembler.add(encode(clove))


def test_reassembler_bounds_each_peer_and_evicts_only_its_own() -> None:
    honest = split(b"honest message")
    reassembler = Reassembler(max_pending=8, max_pending_per_peer=3,
                              max_pending_bytes_per_peer=10 * honest[0].size)
    assert reassembler.add(honest[0], "proxy a") is None
    assert reassembler.add(honest[1], "junk") is None  # the adversary also carried a clove of it
    for _ in range(20):
        reassembler.add(split(secrets.token_bytes(8))[0], "junk")
        assert reassembler.held_by("junk")[0] <= 3 and len(reassembler) <= 8
    assert reassembler.held_by("proxy a") == (1, honest[0].size)
    assert reassembler.add(honest[2], "proxy b") is None  # the junk peer's clove of it was evicted
    assert reassembler.add(honest[3], "proxy c") == b"honest message"
    big = split(secrets.token_bytes(3000))[0]
    small = Reassembler(max_pending_bytes_per_peer=big.size - 1)
    assert small.add(big, "peer") is None and small.refused == 1 and len(small) == 0


def test_reassembler_full_evicts_the_largest_holder_first() -> None:
    honest = split(b"honest message")
    reassembler = Reassembler(max_pending=6, max_pending_per_peer=4)
    reassembler.add(honest[0], "proxy a")
    for peer in ("junk 1", "junk 2"):
        for _ in range(4):
            reassembler.add(split(secrets.token_bytes(8))[0], peer)
            assert len(reassembler) <= 6
    assert reassembler.held_by("proxy a")[0] == 1
    assert reassembler.add(honest[1], "proxy b") is None
    assert reassembler.add(honest[2], "proxy c") == b"honest message"
