"""Limits on what network input decodes into (issue 24), and every decoder of network input under
random and mutated bytes.

The load tests send frames built to exhaust memory over a real TLS peer connection on loopback and
measure the listening process with tracemalloc. The property tests check, for each decoder, that
random bytes and mutations of valid encodings raise nothing but the decoder's own error types, and
that valid encodings round-trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import struct
import tracemalloc

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from waiting import run

from planetserve.chain.client import QueryRefused, decode_entries
from planetserve.chain.keys import KeySet
from planetserve.chain.rpc import RpcClient, RpcError
from planetserve.chain.trie import PrefixProof, ProofError
from planetserve.node.api.openai import ApiError, parse_json_body
from planetserve.node.overlay import onion, sida
from planetserve.node.overlay.messages import MessageError, Part, Prompt, open_message, pad
from planetserve.node.overlay.transport import FRAME_LIMITS, MAX_FRAME, Peering, TransportError, read_frame
from planetserve.node.routing.cachesync import Delta, SyncConfig, SyncError, WireCodec
from planetserve.registry import codec
from planetserve.registry.codec import CodecError, LimitExceeded, Limits, unpack_bounded

FAST = settings(max_examples=200, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
MEMORY_BOUND = 48 << 20
"""Peak Python allocations while a 4 MiB hostile frame arrives and is refused. The frame itself is
held up to three times (socket buffer, body, the sender's copy): 12 MiB; the values a refused frame
may build before its refusal are at most FRAME_LIMITS.max_objects containers (about 18 MiB)."""


# -- the bounded decoder itself --------------------------------------------------------------------


def shape(value) -> tuple[int, int]:
    """(values, depth) as Limits counts them."""
    if isinstance(value, list):
        inner = [shape(v) for v in value]
        return 1 + sum(n for n, _ in inner), 1 + max((d for _, d in inner), default=0)
    if isinstance(value, dict):
        inner = [shape(v) for v in value.values()]
        return 1 + len(value) + sum(n for n, _ in inner), 1 + max((d for _, d in inner), default=0)
    return 1, 0


scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=8)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=40)


@FAST
@given(values, st.integers(1, 40), st.integers(0, 6))
def test_a_value_decodes_exactly_when_it_is_within_the_limits(value, max_objects, max_depth) -> None:
    data = msgpack.packb(value, use_bin_type=True)
    count, depth = shape(value)
    limits = Limits(max_objects=max_objects, max_depth=max_depth)
    if count <= max_objects and depth <= max_depth:
        assert unpack_bounded(data, limits) == value
        assert unpack_bounded(data, limits, use_list=False) == msgpack.unpackb(data, use_list=False)
    else:
        with pytest.raises(LimitExceeded):
            unpack_bounded(data, limits)


@FAST
@given(st.binary(max_size=256))
def test_random_bytes_raise_only_codec_errors(data: bytes) -> None:
    with contextlib.suppress(CodecError):
        unpack_bounded(data, Limits(max_objects=64, max_depth=4, max_len=16, max_str=64, max_bin=64))


def test_a_refused_decode_stops_early() -> None:
    flat = b"\xdd" + struct.pack(">I", 1 << 20) + b"\x90" * (1 << 20)  # 2^20 empty arrays
    with pytest.raises(LimitExceeded, match="max_array_len"):
        unpack_bounded(flat, FRAME_LIMITS)
    nested = msgpack.packb([[[]] * 31] * (1 << 15))  # 2^15 arrays of 31 empty arrays: 2^20 values
    tracemalloc.start()
    try:
        with pytest.raises(LimitExceeded, match="more than"):
            unpack_bounded(nested, FRAME_LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 24 << 20, f"{peak / 2**20:.1f} MiB built before the refusal"
    with pytest.raises(LimitExceeded, match="nesting deeper than 8"):
        unpack_bounded(b"\x91" * 9 + b"\xc0", FRAME_LIMITS)
    assert unpack_bounded(b"\x91" * 8 + b"\xc0", FRAME_LIMITS) is not None


def test_json_limits_count_what_is_outside_strings() -> None:
    assert codec.json_values_bound(b'{"a": [1, 2, "x,[{"]}') == (2, 9)
    assert codec.json_loads_bounded(b'["[[[,,,", "]]]"]', 5, 1) == ["[[[,,,", "]]]"]
    with pytest.raises(LimitExceeded, match="arrays and objects"):
        codec.json_loads_bounded(b"[" + b"[]," * 100 + b"[]]", 1000, 100)
    with pytest.raises(LimitExceeded, match="values"):
        codec.json_loads_bounded(b"[" + b"1," * 100 + b"1]", 100)
    with pytest.raises(CodecError, match="nests too deeply"):
        codec.json_loads_bounded(b"[" * 100_000 + b"]" * 100_000, 10**6)


# -- peer frames over a real connection ------------------------------------------------------------


async def echo(peer: bytes, msg_type: str, body):
    return body


def _hostile_frames() -> dict[str, bytes]:
    body = MAX_FRAME - 5
    flat = b"\xdd" + struct.pack(">I", body) + b"\x90" * body  # about 4M empty arrays
    inner = b"\xdc" + struct.pack(">H", 31) + b"\x90" * 31  # 34 bytes, 32 values
    count = MAX_FRAME // len(inner) - 1
    nested = b"\xdd" + struct.pack(">I", count) + inner * count  # 123,000 arrays of 31 empty arrays
    deep = b"\x91" * (MAX_FRAME - 1) + b"\xc0"  # 4M nested arrays
    return {"flat": flat, "nested": nested, "deep": deep}


@pytest.mark.parametrize("kind", ["flat", "nested", "deep"])
def test_a_4_mib_frame_of_arrays_is_refused_within_a_memory_bound(kind: str) -> None:
    """A listed peer sends a 4 MiB frame of empty arrays (or arrays of arrays, or arrays nested 4M
    deep). The listener refuses it and ends that connection (the transport's policy for a malformed
    frame) with its Python allocations under MEMORY_BOUND; the listener keeps serving the same peer
    on a new connection, including a large honest frame."""
    frame = _hostile_frames()[kind]
    assert len(frame) <= MAX_FRAME

    async def main():
        a_keys, b_keys = KeySet.generate(), KeySet.generate()
        a = Peering(a_keys, echo, lambda key: key == b_keys.public)
        b = Peering(b_keys, echo, lambda key: key == a_keys.public)
        port = await b.listen("127.0.0.1", 0)
        conn = await a.connect(b.keys.public, f"127.0.0.1:{port}")
        assert await conn.call("echo", 1) == 1
        await asyncio.sleep(0.05)
        served = b.connections[a.keys.public]
        data = struct.pack(">I", len(frame)) + frame
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            before, _ = tracemalloc.get_traced_memory()
            conn.writer.write(data)
            await conn.writer.drain()
            await asyncio.wait_for(served.closed.wait(), 10)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak - before < MEMORY_BOUND, f"{(peak - before) / 2**20:.0f} MiB while refusing the frame"
        await asyncio.wait_for(conn.closed.wait(), 10)
        again = await a.connect(b.keys.public, f"127.0.0.1:{port}")
        assert again is not conn
        tokens = list(range(1 << 17))  # a stage request's token ids for a 128k context
        assert await again.call("echo", {"op": "start", "tokens": tokens}) == {"op": "start", "tokens": tokens}
        await a.close()
        await b.close()

    run(main(), 60)


class _Bytes(asyncio.StreamReader):
    def __init__(self, data: bytes) -> None:
        super().__init__()
        self.feed_data(data)
        self.feed_eof()


def mutations(valid: bytes):
    """Bytes near `valid`: a byte changed, bytes cut, bytes inserted."""
    return st.one_of(
        st.tuples(st.integers(0, max(len(valid) - 1, 0)), st.integers(0, 255)).map(
            lambda p: valid[:p[0]] + bytes([p[1]]) + valid[p[0] + 1:]),
        st.integers(0, len(valid)).map(lambda n: valid[:n]),
        st.tuples(st.integers(0, len(valid)), st.binary(min_size=1, max_size=8)).map(
            lambda p: valid[:p[0]] + p[1] + valid[p[0]:]),
    )


VALID_FRAME = msgpack.packb(["req", 3, "stage", {"op": "start", "tokens": [1, 2, 3], "id": b"r"}],
                            use_bin_type=True)


@FAST
@given(st.binary(max_size=128) | mutations(VALID_FRAME))
def test_frames_raise_only_transport_errors(body: bytes) -> None:
    async def main():
        with contextlib.suppress(TransportError):
            await read_frame(_Bytes(struct.pack(">I", len(body)) + body))

    asyncio.run(main())


def test_a_valid_frame_round_trips() -> None:
    async def main():
        return await read_frame(_Bytes(struct.pack(">I", len(VALID_FRAME)) + VALID_FRAME))

    assert asyncio.run(main()) == msgpack.unpackb(VALID_FRAME)


# -- overlay messages, path payloads, cloves -------------------------------------------------------


PROMPT = Prompt(b"r" * 16, b"n" * 32, "chat", b'{"messages": []}',
                tuple((secrets.token_bytes(32), secrets.token_bytes(16), secrets.token_bytes(32)) for _ in range(4)), 3,
                1_700_000_000)
PART = Part(b"r" * 16, 2, 200, "text/event-stream", b"data: {}\n\n", True)


@FAST
@given(st.binary(max_size=64) | mutations(msgpack.packb(["prompt", PROMPT.request_id, PROMPT.node, "chat", b"{}",
                                                            [list(r) for r in PROMPT.reply_to], 3, PROMPT.sent])))
def test_messages_raise_only_message_errors(raw: bytes) -> None:
    for data in (raw, pad(raw)):  # as recovered, and padded as a sender pads
        with contextlib.suppress(MessageError):
            open_message(data)


@FAST
@given(st.integers(0, 1020), st.integers(0, 255))
def test_mutated_messages_raise_only_message_errors_or_decode(position: int, value: int) -> None:
    sealed = bytearray(PROMPT.seal())
    sealed[position] = value
    with contextlib.suppress(MessageError):
        assert isinstance(open_message(bytes(sealed)), Prompt)


def test_messages_round_trip_and_nested_ones_are_refused() -> None:
    assert open_message(PROMPT.seal()) == PROMPT
    assert open_message(PART.seal()) == PART
    with pytest.raises(MessageError, match="nesting deeper than 3"):
        open_message(pad(msgpack.packb(["prompt", [[[[]]]]])))


PATH_KEY = bytes(range(32))


@FAST
@given(st.binary(max_size=64) | mutations(msgpack.packb([b"k" * 32, b"data", b"r" * 16], use_bin_type=True)))
def test_path_payloads_raise_only_onion_errors(plaintext: bytes) -> None:
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    nonce = bytes(12)
    sealed = nonce + ChaCha20Poly1305(PATH_KEY).encrypt(nonce, plaintext, b"planetserve/path/v2/" + onion.FORWARD)
    try:
        payload = onion.open_payload(PATH_KEY, onion.FORWARD, sealed)
        assert isinstance(payload.first, bytes | str) and type(payload.data) is bytes
        assert len(payload.reply_id) in (0, onion.ID_SIZE)
    except onion.OnionError:
        pass
    with contextlib.suppress(onion.OnionError):
        onion.open_payload(PATH_KEY, onion.FORWARD, plaintext)


def test_path_payloads_round_trip() -> None:
    payload = onion.Payload(b"k" * 32, b"data", b"r" * 16)
    sealed = onion.seal_payload(PATH_KEY, onion.FORWARD, payload)
    assert onion.open_payload(PATH_KEY, onion.FORWARD, sealed) == payload


CLOVE = sida.encode(sida.split(b"a prompt", 4, 3)[0])


@FAST
@given(st.binary(max_size=128) | mutations(CLOVE))
def test_cloves_raise_only_clove_errors(raw: bytes) -> None:
    with contextlib.suppress(sida.CloveError):
        assert sida.encode(sida.decode(raw)) == raw


# -- cache sync, light-client answers, proofs --------------------------------------------------------


CACHE = WireCodec(b"k" * 16, 8, SyncConfig())
DELTA = Delta("n1", 7, 3, (2, "n4"), ((True, (1, 2, 3)), (False, (4,))), None)


@FAST
@given(st.binary(max_size=128) | mutations(CACHE.encode(DELTA)))
def test_cache_messages_raise_only_sync_errors(raw: bytes) -> None:
    with contextlib.suppress(SyncError):
        CACHE.decode(raw)


def test_cache_messages_round_trip_and_floods_are_refused() -> None:
    assert CACHE.decode(CACHE.encode(DELTA)) == DELTA
    body = msgpack.unpackb(CACHE.encode(DELTA))
    body["o"] = [[[]] * 1000] * 1000  # within the per-array limit, a million values in all
    with pytest.raises(SyncError, match="more than|nesting"):
        CACHE.decode(msgpack.packb(body, use_bin_type=True))


ENTRIES = msgpack.packb([[b"a", b"1"], [b"bc", b"22"]], use_bin_type=True)


@FAST
@given(st.binary(max_size=128) | mutations(ENTRIES))
def test_prefix_answers_raise_only_query_refusals(raw: bytes) -> None:
    try:
        pairs = decode_entries(raw, b"p/")
        assert all(type(k) is bytes and type(v) is bytes for k, v in pairs)
    except QueryRefused:
        pass


def test_prefix_answers_round_trip_and_deep_ones_are_refused() -> None:
    assert decode_entries(ENTRIES, b"p/") == [(b"p/a", b"1"), (b"p/bc", b"22")]
    with pytest.raises(QueryRefused, match="nesting deeper than 2"):
        decode_entries(msgpack.packb([[[b"a"], b"1"]]), b"p/")


@FAST
@given(st.binary(max_size=128) | mutations(msgpack.packb([1, 0, b"", None], use_bin_type=True)))
def test_proofs_raise_only_proof_errors(raw: bytes) -> None:
    with contextlib.suppress(ProofError):
        PrefixProof.decode(raw)


# -- JSON: OpenAI request bodies, RPC answers --------------------------------------------------------


REQUEST = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()


@FAST
@given(st.binary(max_size=128) | mutations(REQUEST))
def test_request_bodies_raise_only_api_errors(raw: bytes) -> None:
    with contextlib.suppress(ApiError):
        assert isinstance(parse_json_body(raw), dict)


def test_request_bodies_round_trip_and_floods_are_refused() -> None:
    assert parse_json_body(REQUEST) == json.loads(REQUEST)
    with pytest.raises(ApiError) as refused:
        parse_json_body(b'{"a": [' + b"[]," * 100_000 + b"[]]}")
    assert refused.value.status == 413 and "arrays and objects" in str(refused.value)
    with pytest.raises(ApiError) as refused:
        parse_json_body(b"[" * 60_000 + b"]" * 60_000)
    assert refused.value.status == 400


RPC = RpcClient("http://127.0.0.1:9")
"""Never connects: its answers are set per test."""
ANSWER = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"node_info": {"network": "c"}}}).encode()


@FAST
@given(st.binary(max_size=128) | mutations(ANSWER))
def test_rpc_answers_raise_only_rpc_errors(raw: bytes) -> None:
    RPC._post = lambda method, body: raw  # the endpoint's answer, as read within its size limit
    with contextlib.suppress(RpcError):
        RPC.call("status")


def test_rpc_answers_round_trip_and_floods_are_refused() -> None:
    client = RpcClient("http://127.0.0.1:9")
    try:
        client._post = lambda method, body: ANSWER
        assert client.call("status") == {"node_info": {"network": "c"}}
        client._post = lambda method, body: b'{"result": [' + b"[]," * (1 << 18) + b"[]]}"
        with pytest.raises(RpcError, match="more than"):
            client.call("status")
        client._post = lambda method, body: b"[" * 100_000
        with pytest.raises(RpcError, match="nests too deeply"):
            client.call("status")
    finally:
        client.close()
