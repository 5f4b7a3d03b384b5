"""Onion setup packets and the end-to-end overlay messages: every hop reads its own layer and nothing
else, packets look the same at every position, tampering and replay are refused; messages are padded to
buckets and decoded strictly."""

from __future__ import annotations

import functools
import itertools
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


def forward_hops(path_key: bytes, hop_keys: list[bytes], payload: onion.Payload) -> list[bytes]:
    """A forward payload as each hop receives it, the proxy last."""
    seen = [onion.seal_forward(path_key, hop_keys, payload)]
    for hop_key in hop_keys:
        seen.append(onion.unwrap_forward(hop_key, seen[-1]))
    return seen


def backward_hops(path_key: bytes, hop_keys: list[bytes], payload: onion.Payload) -> list[bytes]:
    """A backward payload as each hop sends it, the proxy first and the first relay (to the user) last."""
    seen = [onion.seal_backward(path_key, payload)]
    for hop_key in reversed(hop_keys):
        seen.append(onion.wrap_backward(hop_key, seen[-1]))
    return seen


def test_hop_layers_change_every_byte_of_a_payload_at_every_hop_and_refuse_tampering():
    path_key, hop_keys = secrets.token_bytes(32), [secrets.token_bytes(32) for _ in range(2)]
    payload = onion.Payload(b"n" * 32, bytes(300), secrets.token_bytes(16))
    plain = msgpack.packb([payload.first, payload.data, payload.reply_id])
    windows = {plain[i:i + 16] for i in range(len(plain) - 15)}
    for links in (forward_hops(path_key, hop_keys, payload), backward_hops(path_key, hop_keys, payload)):
        assert len(set(links)) == 3
        assert not any(link[i:i + 16] in windows for link in links for i in range(len(link) - 15))
        for one, other in itertools.combinations(links, 2):  # no 16 bytes in common between links
            assert not {one[i:i + 16] for i in range(len(one) - 15)} & {other[i:i + 16] for i in range(len(other) - 15)}
    first = forward_hops(path_key, hop_keys, payload)[0]
    assert onion.seal_forward(path_key, hop_keys, payload) != first  # a fresh nonce per layer
    assert onion.open_forward(path_key, onion.unwrap_forward(hop_keys[1], onion.unwrap_forward(hop_keys[0], first))) \
        == payload
    with pytest.raises(onion.OnionError, match="hop layer does not authenticate"):
        onion.unwrap_forward(hop_keys[1], first)  # not the second relay's layer
    back = backward_hops(path_key, hop_keys, payload)[-1]
    assert onion.open_backward(path_key, hop_keys, back) == payload
    with pytest.raises(onion.OnionError, match="authenticate"):
        onion.open_backward(path_key, hop_keys, first)  # a forward payload reflected back
    with pytest.raises(onion.OnionError, match="authenticate"):
        onion.open_backward(path_key, hop_keys[::-1], back)
    for short in (b"short", first[:onion.PATH_OVERHEAD - 1]):
        for refuse in (lambda p: onion.unwrap_forward(hop_keys[0], p), lambda p: onion.open_forward(path_key, p),
                       lambda p: onion.wrap_backward(hop_keys[0], p),
                       lambda p: onion.open_backward(path_key, hop_keys, p)):
            with pytest.raises(onion.OnionError, match="shorter"):
                refuse(short)


@pytest.mark.parametrize("hops", [0, 1, 2])
def test_a_path_payload_has_one_length_at_every_hop_in_both_directions(hops):
    """What a relay receives or sends on a path is as long at every position (and on paths of every
    length), so its size does not tell a first relay that its predecessor is the sender."""
    path_key, hop_keys = secrets.token_bytes(32), [secrets.token_bytes(32) for _ in range(hops)]
    for payload in (onion.Payload(b"", secrets.token_bytes(16)), onion.Payload("ready", secrets.token_bytes(16)),
                    onion.Payload(b"n" * 32, secrets.token_bytes(messages.BUCKETS[0]), secrets.token_bytes(16)),
                    onion.Payload("clove", secrets.token_bytes(70_000), secrets.token_bytes(16))):
        size = len(msgpack.packb([payload.first, payload.data, payload.reply_id])) + onion.PATH_OVERHEAD
        forward = forward_hops(path_key, hop_keys, payload)
        assert [len(p) for p in forward] == [size] * (hops + 1)
        assert onion.open_forward(path_key, forward[-1]) == payload
        backward = backward_hops(path_key, hop_keys, payload)
        assert [len(p) for p in backward] == [size] * (hops + 1)
        assert onion.open_backward(path_key, hop_keys, backward[-1]) == payload


def test_every_byte_a_hop_receives_is_authenticated_where_it_is_opened():
    """Forward, a bit flipped anywhere in what a hop receives (the fillers appended by the relays before
    it included) is refused by that hop; backward, anywhere in what a hop sends but the last bytes,
    which the next relay cuts (and the user recomputes), is refused by the user."""
    path_key, hop_keys = secrets.token_bytes(32), [secrets.token_bytes(32) for _ in range(2)]
    payload = onion.Payload(b"n" * 32, secrets.token_bytes(100), secrets.token_bytes(16))
    forward = forward_hops(path_key, hop_keys, payload)
    size = len(forward[0])
    openers = [*(functools.partial(onion.unwrap_forward, k) for k in hop_keys),
               functools.partial(onion.open_forward, path_key)]
    for received, opener in zip(forward, openers, strict=True):
        for position in range(0, size, 7):
            tampered = bytearray(received)
            tampered[position] ^= 0x10
            with pytest.raises(onion.OnionError, match="authenticate"):
                opener(bytes(tampered))
    backward = backward_hops(path_key, hop_keys, payload)
    for hop, sent in enumerate(backward):
        for position in range(0, size, 7):
            tampered = bytearray(sent)
            tampered[position] ^= 0x10
            later = bytes(tampered)
            for hop_key in reversed(hop_keys[:len(hop_keys) - hop]):
                later = onion.wrap_backward(hop_key, later)
            if hop < len(hop_keys) and position >= size - onion.HOP_OVERHEAD:
                assert onion.open_backward(path_key, hop_keys, later) == payload  # cut: nothing changed
            else:
                with pytest.raises(onion.OnionError, match="authenticate"):
                    onion.open_backward(path_key, hop_keys, later)


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
    for version in (3, 9):  # 3: paths whose payloads lost a layer's length at every hop
        raw = bytearray(good.encode())
        raw[0] = version
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
