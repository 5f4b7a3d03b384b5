"""Onion setup packets and the end-to-end overlay messages: every hop reads its own layer and nothing
else, packets look the same at every position, tampering and replay are refused; messages are padded to
buckets and decoded strictly."""

from __future__ import annotations

import random
import secrets
import time

import msgpack
import pytest
from nacl.signing import SigningKey

from planetserve.node.overlay import messages, onion
from planetserve.node.overlay.messages import MessageError, Part, Prompt, open_message, sent_now
from planetserve.node.overlay.routes import NotEnoughRelays, choose_routes


def keys(count: int) -> list[SigningKey]:
    return [SigningKey(secrets.token_bytes(32)) for _ in range(count)]


def layers_for(route: list[bytes]) -> list[onion.Layer]:
    hops = [onion.relay_layer(secrets.token_bytes(16), route[i + 1]) for i in range(len(route) - 1)]
    return [*hops, onion.proxy_layer(secrets.token_bytes(16), secrets.token_bytes(32))]


@pytest.mark.parametrize("hops", [1, 2, 3])
def test_each_hop_reads_exactly_its_layer_from_a_packet_of_constant_size(hops):
    signers = keys(hops)
    route = [bytes(k.verify_key) for k in signers]
    layers = layers_for(route)
    packet, hop_keys = onion.build(route, layers)
    for signer, expected, hop_key in zip(signers, layers, hop_keys, strict=True):
        assert len(packet) == onion.PACKET_SIZE
        layer, packet = onion.peel(onion.exchange_secret(signer), packet)
        assert layer == expected and layer.hop_key == hop_key
    assert len(packet) == onion.PACKET_SIZE
    assert len(set(hop_keys)) == hops and bytes(32) not in hop_keys


def test_every_layer_carries_its_issue_time_rounded_down_to_ten_seconds():
    """The relays of a path read when its user made each setup layer; to the second, the offset between
    arrival and issue, over a user's many setups, told users with skewed clocks apart."""
    signers = keys(3)
    route = [bytes(k.verify_key) for k in signers]
    before = time.time()
    packet, _ = onion.build(route, layers_for(route))
    for signer in signers:
        layer, packet = onion.peel(onion.exchange_secret(signer), packet)
        assert layer.issued % onion.ISSUED_STEP == 0 and before - onion.ISSUED_STEP < layer.issued <= before


def test_a_relay_cannot_read_another_relays_layer_or_a_tampered_packet():
    signers = keys(3)
    route = [bytes(k.verify_key) for k in signers]
    packet = onion.build(route, layers_for(route))[0]
    with pytest.raises(onion.OnionError, match="does not authenticate"):
        onion.peel(onion.exchange_secret(signers[1]), packet)
    for position in (0, 40, 100, onion.PACKET_SIZE - 1):
        tampered = bytearray(packet)
        tampered[position] ^= 1
        with pytest.raises(onion.OnionError):
            onion.peel(onion.exchange_secret(signers[0]), bytes(tampered))
    with pytest.raises(onion.OnionError, match="expected"):
        onion.peel(onion.exchange_secret(signers[0]), packet[:-1])
    with pytest.raises(onion.OnionError):
        onion.peel(onion.exchange_secret(signers[0]), bytes(onion.PACKET_SIZE))


def test_a_second_hops_packet_is_tampered_by_the_first_and_detected():
    signers = keys(3)
    route = [bytes(k.verify_key) for k in signers]
    _, inner = onion.peel(onion.exchange_secret(signers[0]), onion.build(route, layers_for(route))[0])
    flipped = bytearray(inner)
    flipped[-1] ^= 0x80  # the filler the first relay appended
    with pytest.raises(onion.OnionError):
        onion.peel(onion.exchange_secret(signers[1]), bytes(flipped))


def test_path_payloads_open_only_with_their_key_and_direction():
    key = secrets.token_bytes(32)
    payload = onion.Payload(b"n" * 32, b"clove", secrets.token_bytes(16))
    sealed = onion.seal_payload(key, onion.FORWARD, payload)
    assert onion.open_payload(key, onion.FORWARD, sealed) == payload
    assert sealed != onion.seal_payload(key, onion.FORWARD, payload)  # fresh nonce
    with pytest.raises(onion.OnionError, match="authenticate"):
        onion.open_payload(key, onion.BACKWARD, sealed)  # reflected back toward the user
    with pytest.raises(onion.OnionError, match="authenticate"):
        onion.open_payload(secrets.token_bytes(32), onion.FORWARD, sealed)
    flipped = bytearray(sealed)
    flipped[20] ^= 4
    with pytest.raises(onion.OnionError, match="authenticate"):
        onion.open_payload(key, onion.FORWARD, bytes(flipped))
    with pytest.raises(onion.OnionError):
        onion.open_payload(key, onion.FORWARD, b"short")


def test_hop_layers_change_every_byte_of_a_payload_at_every_hop_and_refuse_tampering():
    hop_keys = [secrets.token_bytes(32) for _ in range(2)]
    sealed = onion.seal_payload(secrets.token_bytes(32), onion.FORWARD, onion.Payload(b"n" * 32, bytes(300)))
    first = onion.wrap_all(hop_keys, onion.FORWARD, sealed)
    second = onion.unwrap(hop_keys[0], onion.FORWARD, first)
    assert onion.unwrap(hop_keys[1], onion.FORWARD, second) == sealed
    assert len(first) == len(second) + onion.HOP_OVERHEAD == len(sealed) + 2 * onion.HOP_OVERHEAD
    windows = {sealed[i:i + 16] for i in range(len(sealed) - 15)}
    assert not any(link[i:i + 16] in windows for link in (first, second) for i in range(0, len(link) - 15))
    assert onion.wrap_all(hop_keys, onion.FORWARD, sealed) != first  # a fresh nonce per layer
    backward = onion.wrap(hop_keys[0], onion.BACKWARD, onion.wrap(hop_keys[1], onion.BACKWARD, sealed))
    assert onion.unwrap_all(hop_keys, onion.BACKWARD, backward) == sealed
    with pytest.raises(onion.OnionError, match="hop layer does not authenticate"):
        onion.unwrap(hop_keys[0], onion.BACKWARD, first)  # reflected
    with pytest.raises(onion.OnionError, match="hop layer does not authenticate"):
        onion.unwrap(hop_keys[0], onion.FORWARD, first[:-1] + bytes([first[-1] ^ 1]))
    with pytest.raises(onion.OnionError):
        onion.unwrap(hop_keys[0], onion.FORWARD, b"short")


def test_cloves_sealed_to_a_node_open_only_there():
    node, other = keys(2)
    sealed = onion.seal_to(bytes(node.verify_key), b"clove bytes")
    assert onion.open_sealed(onion.exchange_secret(node), sealed) == b"clove bytes"
    assert sealed[32:] != onion.seal_to(bytes(node.verify_key), b"clove bytes")[32:]
    with pytest.raises(onion.OnionError, match="not for us"):
        onion.open_sealed(onion.exchange_secret(other), sealed)
    with pytest.raises(onion.OnionError, match="not for us"):
        onion.open_sealed(onion.exchange_secret(node), sealed[:-1] + bytes([sealed[-1] ^ 1]))
    with pytest.raises(onion.OnionError):
        onion.open_sealed(onion.exchange_secret(node), b"")


def test_layer_decoding_refuses_unknown_versions_roles_and_relays_without_a_successor():
    good = onion.relay_layer(bytes(16), bytes(range(32)))
    assert onion.Layer.decode(good.encode()) == good
    raw = bytearray(good.encode())
    raw[0] = 9
    with pytest.raises(onion.OnionError, match="version"):
        onion.Layer.decode(bytes(raw))
    raw = bytearray(good.encode())
    raw[1] = 7
    with pytest.raises(onion.OnionError, match="role"):
        onion.Layer.decode(bytes(raw))
    with pytest.raises(onion.OnionError, match="next relay"):
        onion.Layer.decode(onion.relay_layer(bytes(16), bytes(32)).encode())


def test_build_refuses_paths_that_are_too_long_or_mismatched():
    route = [bytes(k.verify_key) for k in keys(4)]
    with pytest.raises(ValueError, match=r"a path has 1\.\.3 relays, not 4"):
        onion.build(route, layers_for(route))
    with pytest.raises(ValueError, match="one layer per relay: 2 relays, 3 layers"):
        onion.build(route[:2], layers_for(route[:3]))


def test_routes_are_disjoint_when_the_list_allows_and_never_repeat_within_a_path():
    users = [bytes([i]) * 32 for i in range(40)]
    me = users[0]
    routes = choose_routes(users, 5, exclude={me}, rng=random.Random(1))
    flat = [r for route in routes for r in route]
    assert len(flat) == 15 and len(set(flat)) == 15 and me not in flat
    few = choose_routes(users[:6], 4, exclude={me}, rng=random.Random(2))
    assert all(len(set(route)) == 3 and me not in route for route in few)
    avoided = set(users[1:30])
    spare = choose_routes(users, 3, exclude={me}, avoid=avoided, rng=random.Random(3))
    assert not avoided & {r for route in spare for r in route}
    only_bad = choose_routes(users[:5], 1, exclude={me}, avoid=set(users[1:4]), rng=random.Random(4))
    assert len(set(only_bad[0])) == 3
    with pytest.raises(NotEnoughRelays, match="2 usable relays"):
        choose_routes(users[:3], 1, exclude={me})


def test_paths_end_at_distinct_proxies_whenever_the_list_allows():
    users = [bytes([i]) * 32 for i in range(40)]
    me = users[0]
    for seed in range(20):
        rng = random.Random(seed)
        # all at once from a list too small for disjoint paths: 5 relays, 5 paths, 5 proxies
        few = choose_routes(users[:6], 5, exclude={me}, rng=rng)
        assert all(len(set(route)) == 3 for route in few)
        assert len({route[-1] for route in few}) == 5
        # one at a time, as a user builds them, each avoiding the others' relays and proxies
        built: list[tuple[bytes, ...]] = []
        for _ in range(5):
            (route,) = choose_routes(users[:7], 1, exclude={me}, avoid={r for p in built for r in p},
                                     proxies={p[-1] for p in built}, rng=rng)
            built.append(route)
        assert len({route[-1] for route in built}) == 5
    # a proxy is reused only when every relay of the list already ends a path
    (again,) = choose_routes(users[:4], 1, exclude={me}, proxies=set(users[1:4]), rng=random.Random(5))
    assert len(set(again)) == 3


# -- messages ------------------------------------------------------------------------------------------


def prompt(body: bytes = b'{"model": "gt"}', proxies: int = 4) -> Prompt:
    return Prompt(secrets.token_bytes(16), secrets.token_bytes(32), "chat", body,
                  tuple((secrets.token_bytes(32), secrets.token_bytes(16), secrets.token_bytes(32))
                        for _ in range(proxies)), min(3, proxies), sent_now())


def test_messages_round_trip_padded_to_buckets():
    for size in (0, 100, 900, 5000, 70_000):
        original = prompt(b"x" * size)
        sealed = original.seal()
        assert len(sealed) in messages.BUCKETS and len(sealed) >= size
        assert open_message(sealed) == original
    part = Part(secrets.token_bytes(16), 3, 200, "text/event-stream", b"data: {}\n\n", False)
    assert open_message(part.seal()) == part
    # a short prompt and a short answer part are the same size on the wire
    assert len(prompt(b"hi").seal()) == len(part.seal()) == messages.BUCKETS[0]


def test_oversized_messages_are_refused_before_splitting():
    with pytest.raises(MessageError, match="exceeds"):
        prompt(b"x" * messages.MAX_MESSAGE).seal()


@pytest.mark.parametrize("fields, error", [
    (["prompt", b"r" * 16, b"n" * 32, "embeddings", b"{}", [[b"p" * 32, b"i" * 16, b"k" * 32]], 1, 1_700_000_000], "endpoint"),
    (["prompt", b"r" * 16, b"n" * 32, "chat", "text", [[b"p" * 32, b"i" * 16, b"k" * 32]], 1, 1_700_000_000], "body"),
    (["prompt", b"r" * 16, b"n" * 32, "chat", b"{}", [], 1, 1_700_000_000], "proxies"),
    (["prompt", b"r" * 16, b"n" * 32, "chat", b"{}", [[b"p" * 31, b"i" * 16, b"k" * 32]], 1, 1_700_000_000], "proxy key"),
    (["prompt", b"r" * 15, b"n" * 32, "chat", b"{}", [[b"p" * 32, b"i" * 16, b"k" * 32]], 1, 1_700_000_000], "request id"),
    (["prompt", b"r" * 16, b"n" * 32, "chat", b"{}", [[b"p" * 32, b"i" * 16, b"k" * 32]] * 17, 1], "max_array_len"),
    (["prompt", b"r" * 16, b"n" * 32, "chat", b"{}", [[b"p" * 32, b"i" * 16]], 1, 1_700_000_000], "reply key"),
    (["prompt", b"r" * 16, b"n" * 32, "chat", b"{}", [[b"p" * 32, b"i" * 16, b"k" * 31]], 1, 1_700_000_000], "reply key"),
    (["prompt", b"r" * 16, b"n" * 32, "chat", b"{}", [[b"p" * 32, b"i" * 16, b"k" * 32]], 2, 1_700_000_000], "answer threshold"),
    (["prompt", b"r" * 16, b"n" * 32, "chat", b"{}", [[b"p" * 32, b"i" * 16, b"k" * 32]], 0, 1_700_000_000], "answer threshold"),
    (["prompt", b"r" * 16, b"n" * 32, "chat", b"{}", [[b"p" * 32, b"i" * 16, b"k" * 32]], 1], "with 7 fields"),
    (["prompt", b"r" * 16, b"n" * 32, "chat", b"{}", [[b"p" * 32, b"i" * 16, b"k" * 32]], 1, -10], "sent time"),
    (["prompt", b"r" * 16, b"n" * 32, "chat", b"{}", [[b"p" * 32, b"i" * 16, b"k" * 32]], 1, "now"], "sent time"),
    (["part", b"r" * 16, -1, 200, "a", b"", True], "sequence"),
    (["part", b"r" * 16, 0, 700, "a", b"", True], "status"),
    (["part", b"r" * 16, 0, 200, "a", "text", True], "data"),
    (["hello"], "unknown message kind"),
    ({"prompt": 1}, "not a list"),
])
def test_malformed_messages_get_specific_errors(fields, error):
    with pytest.raises(MessageError, match=error):
        open_message(messages.pad(msgpack.packb(fields, use_bin_type=True)))


def test_unpadded_or_garbled_messages_are_refused():
    with pytest.raises(MessageError, match="padded size"):
        open_message(b"\x00" * 100)
    garbage = bytearray(messages.BUCKETS[0])
    garbage[:4] = (500).to_bytes(4, "big")
    with pytest.raises(MessageError, match="undecodable"):
        open_message(bytes(garbage))
    garbage[:4] = (5000).to_bytes(4, "big")
    with pytest.raises(MessageError, match="exceeds its padding"):
        open_message(bytes(garbage))
