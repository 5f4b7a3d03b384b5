"""Onion packets that set up a user's path to a proxy (the only public-key operations of the overlay),
and the per-hop layers of what then travels on the path.

A user wraps one layer per relay. Each layer is sealed to the relay's registered ed25519 key (as its
X25519 equivalent) under a fresh ephemeral key: X25519, HKDF-SHA256, ChaCha20-Poly1305. A layer tells
its relay only what it needs: whether it is a relay or the proxy, the next relay's key and the id of
the next link (a relay), or the acknowledgement token and path key (the proxy). Every layer also
carries the time the user built it (`issued`, Unix seconds): a relay accepts a setup only within a
short window of that time, so it need remember the ephemeral keys it has seen (its replay cache) only
for that window (`relay.py`). The same key agreement gives each relay a hop key (`Layer.hop_key`),
which the user knows too.

Afterwards, everything on the path between the user and its proxy is a path payload: (destination
or kind, data, reply id) sealed under the path key, inside one layer per relay before the proxy under
that relay's hop key, every layer ChaCha20-Poly1305 with a fresh random nonce. The user seals a forward
payload in all of them and each relay removes its own (`seal_forward`, `unwrap_forward`,
`open_forward`); the proxy seals a backward payload and each relay adds its own (`seal_backward`,
`wrap_backward`, `open_backward`). So the bytes a payload has on one link are unrelated to its bytes on
any other link, and a first relay and a proxy that collude cannot match what they carry by its bytes.
Symmetric only. The cloves themselves are sealed end to end as well, to the model node's key on the way
there (`seal_to`) and under a reply key the user chose for that request and path on the way back
(`seal_payload`), so not even colluding proxies can link the cloves of one message by their headers.

A path payload has the same length on every link of its path, in both directions, so its size does not
tell a relay its position (in particular the first relay does not learn that its predecessor is the
sender): its length is that of its encoding plus PATH_OVERHEAD, room for MAX_HOPS layers whatever the
path's length. Layers are nonce 12 | tag 16 | ciphertext. Forward, a relay removes its layer and appends
HOP_OVERHEAD bytes of filler, a PRF (keyed BLAKE2b) of its hop key and its layer's nonce; the user, who
knows every hop key and chose every nonce, builds each inner layer so that its authenticated ciphertext
already ends with the filler the relays before it will have appended (as setup packets do, below).
Backward, a relay cuts the last HOP_OVERHEAD bytes of what it receives and seals the rest in its layer;
the proxy's plaintext ends in (MAX_HOPS - 1) · HOP_OVERHEAD zeros, so the user can compute every byte
the relays cut (the keystreams under the path and hop keys, their nonces read from the layers inside)
and check every layer whole, the path key's last. Every byte is authenticated where it is opened: a
forward layer by the next relay (or the proxy), a backward one by the user; the bytes a relay cuts on
the way back carry nothing (the user recomputes them), so altering them changes nothing.

Setup packets, too, have one size at every hop, so a relay cannot tell its position on the path from
its setup either: after removing its layer, a relay appends `LAYER_SIZE` bytes of filler derived from
its own layer key, and the user, who knows every layer key, builds each inner layer so that its
authenticated ciphertext already ends with the filler the relays before it will have appended (the
filler technique of mix network formats such as Sphinx, with one explicit ephemeral key per layer).

Packet: ephemeral key 32 | tag 16 | ciphertext (PACKET_SIZE - 48); the plaintext is a header of
HEADER_SIZE bytes then the next packet without its last LAYER_SIZE bytes.
"""

from __future__ import annotations

import functools
import hashlib
import secrets
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from nacl.bindings import crypto_scalarmult, crypto_scalarmult_base
from nacl.exceptions import CryptoError
from nacl.public import PrivateKey
from nacl.signing import SigningKey, VerifyKey

from planetserve.node.overlay.routes import PATH_LENGTH
from planetserve.registry.codec import CodecError, Limits, unpack_bounded

VERSION = 4
"""Onion layer version: 4 since path payloads have one length at every hop (3 added the time of issue)."""
ID_SIZE = 16
TOKEN_SIZE = 16
KEY_SIZE = 32
TAG_SIZE = 16
ROLE_RELAY = 0
ROLE_PROXY = 1
MAX_HOPS = PATH_LENGTH
_HEADER = struct.Struct(">BB16s32s16s32sQ")
HEADER_SIZE = _HEADER.size
LAYER_SIZE = KEY_SIZE + TAG_SIZE + HEADER_SIZE
PACKET_SIZE = MAX_HOPS * LAYER_SIZE
_BODY = PACKET_SIZE - KEY_SIZE - TAG_SIZE
_NONCE = bytes(12)
_INFO = b"planetserve/onion/v2"
_ZERO_KEY = bytes(KEY_SIZE)
_PAYLOAD_DOMAIN = b"planetserve/path/v2/"
"""`seal_payload`'s (the answer cloves under their reply keys)."""
_PATH_DOMAIN = b"planetserve/path/v3/"
_HOP_DOMAIN = b"planetserve/hop/v2/"
_FILLER_PERSON = b"planetserve/fill"
NONCE_SIZE = 12
HOP_OVERHEAD = NONCE_SIZE + TAG_SIZE
"""Bytes of one layer's nonce and tag: what a relay removes and appends as filler (forward), or cuts and
adds (backward)."""
_LENGTH = struct.Struct(">I")
PATH_OVERHEAD = MAX_HOPS * HOP_OVERHEAD + _LENGTH.size
"""Bytes a path payload has beyond its encoding, on every link: MAX_HOPS layers' nonces and tags, whatever
the path's length, and the encoding's length."""
FORWARD = b"fwd"
BACKWARD = b"back"
REPLY = b"reply"
PAYLOAD_LIMITS = Limits(max_objects=4, max_depth=1, max_len=3, max_str=256, max_bin=8 << 20)
"""A path payload is [destination key or kind, data, reply id]: nothing else is decoded."""


class OnionError(Exception):
    """A setup packet that is malformed, not for us, or tampered with."""


@dataclass(frozen=True)
class Layer:
    """What one relay learns from its layer."""

    role: int
    out_id: bytes
    """The id of the link to the next relay (a relay), zeros at the proxy."""
    next_key: bytes
    """The next relay's identity key (a relay), zeros at the proxy."""
    token: bytes
    """Sent back to the user to confirm the path (the proxy only)."""
    path_key: bytes
    """Seals what the user and the proxy exchange over the path (the proxy only)."""
    issued: int = 0
    """When the user built the packet (Unix seconds): relays refuse setups outside a window of it."""
    hop_key: bytes = field(default=_ZERO_KEY, repr=False, compare=False)
    """Re-encrypts this hop's path payloads (`wrap`): derived from the layer's key agreement, not
    carried in the header."""

    @property
    def is_proxy(self) -> bool:
        return self.role == ROLE_PROXY

    def encode(self) -> bytes:
        return _HEADER.pack(VERSION, self.role, self.out_id, self.next_key, self.token, self.path_key,
                            self.issued)

    @classmethod
    def decode(cls, raw: bytes) -> Layer:
        version, role, out_id, next_key, token, path_key, issued = _HEADER.unpack(raw)
        if version != VERSION or role not in (ROLE_RELAY, ROLE_PROXY):
            raise OnionError(f"unknown layer version {version} or role {role}")
        if role == ROLE_RELAY and next_key == _ZERO_KEY:
            raise OnionError("relay layer names no next relay")
        return cls(role, out_id, next_key, token, path_key, issued)


ISSUED_STEP = 10
"""A setup layer's `issued` is the user's clock rounded down to this many seconds, as a prompt's `sent` is
(`messages.SENT_STEP`): to the second, the offset between arrival and issue, over the many setups a user
makes, told users with skewed clocks apart and let a proxy match a path to what a first relay saw."""


def _now(issued: int | None) -> int:
    return int(time.time()) // ISSUED_STEP * ISSUED_STEP if issued is None else issued


def relay_layer(out_id: bytes, next_key: bytes, issued: int | None = None) -> Layer:
    return Layer(ROLE_RELAY, out_id, next_key, bytes(TOKEN_SIZE), _ZERO_KEY, _now(issued))


def proxy_layer(token: bytes, path_key: bytes, issued: int | None = None) -> Layer:
    return Layer(ROLE_PROXY, bytes(ID_SIZE), _ZERO_KEY, token, path_key, _now(issued))


@dataclass(frozen=True)
class Payload:
    """What the user and its proxy exchange over a path."""

    first: bytes | str
    """Toward the proxy: the model node to deliver `data` to (empty: a ping). Toward the user: the
    kind ("ready", "pong", "clove", "unreachable")."""
    data: bytes
    reply_id: bytes = b""
    """With a prompt clove: the id under which the model node will answer this request on this path,
    fresh per request (the proxy keeps it for a while). With an answer clove: the id it came under."""


def _seal(key: bytes, domain: bytes, plaintext: bytes) -> bytes:
    nonce = secrets.token_bytes(NONCE_SIZE)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, domain)


def _open(key: bytes, domain: bytes, sealed: bytes, what: str) -> bytes:
    try:
        return ChaCha20Poly1305(key).decrypt(sealed[:NONCE_SIZE], sealed[NONCE_SIZE:], domain)
    except InvalidTag:
        raise OnionError(f"{what} does not authenticate") from None
    except Exception as exc:  # a nonce of the wrong size, or not bytes
        raise OnionError(f"malformed {what}: {type(exc).__name__}") from exc


def seal_payload(path_key: bytes, direction: bytes, payload: Payload) -> bytes:
    """A payload sealed under `path_key` alone (an answer clove under its reply key, REPLY): a fresh
    random nonce each time, and the direction bound in, so a payload cannot be reflected back. What
    travels on a path is sealed by `seal_forward` and `seal_backward`."""
    return _seal(path_key, _PAYLOAD_DOMAIN + direction, _packed(payload))


def open_payload(path_key: bytes, direction: bytes, sealed: bytes) -> Payload:
    """The payload inside a sealed one; OnionError if it was altered or is not for this path."""
    return _fields(_open(path_key, _PAYLOAD_DOMAIN + direction, sealed, "path payload"))


def _fields(packed: bytes) -> Payload:
    try:
        fields = unpack_bounded(packed, PAYLOAD_LIMITS)
    except CodecError as exc:
        raise OnionError(f"malformed path payload: {exc}") from exc
    if not isinstance(fields, list) or len(fields) != 3:
        raise OnionError("malformed path payload")
    first, data, reply_id = fields
    if not isinstance(first, bytes | str) or type(data) is not bytes:
        raise OnionError("malformed path payload")
    if type(reply_id) is not bytes or len(reply_id) not in (0, ID_SIZE):
        raise OnionError("malformed reply id in a path payload")
    return Payload(first, data, reply_id)


def _layer(key: bytes, domain: bytes, nonce: bytes, plaintext: bytes) -> bytes:
    """nonce | tag | ciphertext: the tag before the ciphertext, so that filler appended after it is
    ciphertext the layer authenticates."""
    sealed = ChaCha20Poly1305(key).encrypt(nonce, plaintext, domain)
    return b"".join((nonce, sealed[-TAG_SIZE:], memoryview(sealed)[:-TAG_SIZE]))


def _open_layer(key: bytes, domain: bytes, layer: bytes, what: str) -> bytes:
    try:
        return ChaCha20Poly1305(key).decrypt(layer[:NONCE_SIZE], b"".join(
            (memoryview(layer)[HOP_OVERHEAD:], layer[NONCE_SIZE:HOP_OVERHEAD])), domain)
    except InvalidTag:
        raise OnionError(f"{what} does not authenticate") from None


def _stream(key: bytes, nonce: bytes, start: int, size: int) -> bytes:
    """ChaCha20-Poly1305's keystream under `key` and `nonce` for plaintext bytes [start, start + size)
    (its ChaCha20 counter starts at 1)."""
    block, skip = divmod(start, 64)
    cipher = Cipher(algorithms.ChaCha20(key, (1 + block).to_bytes(4, "little") + nonce), mode=None)
    return cipher.encryptor().update(bytes(skip + size))[skip:]


def _filler(hop_key: bytes, nonce: bytes) -> bytes:
    """What a relay appends to a forward payload after removing its layer: unpredictable without its hop
    key, so the next relay cannot tell it from ciphertext, and fixed by the layer, so the user can build
    the inner layers to authenticate it."""
    return hashlib.blake2b(nonce, digest_size=HOP_OVERHEAD, key=hop_key, person=_FILLER_PERSON).digest()


def _check_size(payload: bytes) -> None:
    if type(payload) is not bytes or len(payload) < PATH_OVERHEAD:
        raise OnionError(f"path payload shorter than {PATH_OVERHEAD} bytes")


def _check_hops(hop_keys: Sequence[bytes]) -> None:
    if len(hop_keys) >= MAX_HOPS:
        raise ValueError(f"a path has at most {MAX_HOPS - 1} relays before its proxy, not {len(hop_keys)}")


def _packed(payload: Payload) -> bytes:
    return msgpack.packb([payload.first, payload.data, payload.reply_id], use_bin_type=True)


def _encode(payload: Payload) -> bytes:
    """A path payload's plaintext: its packed fields behind their length (the rest is filler)."""
    packed = _packed(payload)
    return _LENGTH.pack(len(packed)) + packed


def _decode(plaintext: bytes) -> Payload:
    if len(plaintext) < _LENGTH.size:
        raise OnionError("malformed path payload")
    (size,) = _LENGTH.unpack_from(plaintext)
    if size > len(plaintext) - _LENGTH.size:
        raise OnionError("malformed path payload: its length runs past its end")
    return _fields(plaintext[_LENGTH.size:_LENGTH.size + size])


def seal_forward(path_key: bytes, hop_keys: Sequence[bytes], payload: Payload) -> bytes:
    """A payload for the proxy, as the first relay receives it: sealed under the path key, inside one
    layer per relay of `hop_keys` (the relays before the proxy, first relay first), of the same length
    at every hop (its encoding's plus PATH_OVERHEAD)."""
    _check_hops(hop_keys)
    body = _encode(payload)
    room = len(body) + (MAX_HOPS - 1) * HOP_OVERHEAD  # every layer's plaintext (and ciphertext) length
    nonces = [secrets.token_bytes(NONCE_SIZE) for _ in range(len(hop_keys) + 1)]
    # tail: the fillers the relays before the next layer's reader will have appended, as it receives them
    tail = b""
    for hop_key, nonce in zip(hop_keys, nonces[:-1], strict=True):
        if tail:
            tail = _xor(tail, _stream(hop_key, nonce, room - len(tail), len(tail)))
        tail += _filler(hop_key, nonce)
    spare = secrets.token_bytes(room - len(body) - len(tail))  # random: the proxy learns no path length
    if tail:
        tail = _xor(tail, _stream(path_key, nonces[-1], room - len(tail), len(tail)))
    plaintext = body + spare + tail
    sealed = _layer(path_key, _PATH_DOMAIN + FORWARD, nonces[-1], plaintext)
    for hop_key, nonce in zip(reversed(hop_keys), reversed(nonces[:-1]), strict=True):
        sealed = _layer(hop_key, _HOP_DOMAIN + FORWARD, nonce, sealed[:room])
    return sealed


def unwrap_forward(hop_key: bytes, payload: bytes) -> bytes:
    """A forward payload without this relay's layer, with its filler appended: as long as it came.
    OnionError if the layer was altered (or the filler of the relay before)."""
    _check_size(payload)
    inner = _open_layer(hop_key, _HOP_DOMAIN + FORWARD, payload, "hop layer")
    return inner + _filler(hop_key, payload[:NONCE_SIZE])


def open_forward(path_key: bytes, payload: bytes) -> Payload:
    """The proxy's reading of a forward payload; OnionError if it was altered or is not for this path."""
    _check_size(payload)
    return _decode(_open_layer(path_key, _PATH_DOMAIN + FORWARD, payload, "path payload"))


def seal_backward(path_key: bytes, payload: Payload) -> bytes:
    """The proxy's payload for the user: sealed under the path key, its plaintext ending in the zeros
    that the relays' cuts come from, so that the user can recompute what they cut."""
    body = _encode(payload)
    zeros = bytes((MAX_HOPS - 1) * HOP_OVERHEAD)
    return _layer(path_key, _PATH_DOMAIN + BACKWARD, secrets.token_bytes(NONCE_SIZE), body + zeros)


def wrap_backward(hop_key: bytes, payload: bytes) -> bytes:
    """A backward payload with this relay's layer around all of it but its last HOP_OVERHEAD bytes: as
    long as it came."""
    _check_size(payload)
    return _layer(hop_key, _HOP_DOMAIN + BACKWARD, secrets.token_bytes(NONCE_SIZE), payload[:-HOP_OVERHEAD])


def open_backward(path_key: bytes, hop_keys: Sequence[bytes], payload: bytes) -> Payload:
    """A payload from the proxy, as the first relay of `hop_keys` passed it on; OnionError if anyone
    altered what it carries."""
    _check_hops(hop_keys)
    _check_size(payload)
    if not hop_keys:
        return _decode(_open_layer(path_key, _PATH_DOMAIN + BACKWARD, payload, "path payload"))
    hops, room = len(hop_keys), len(payload) - HOP_OVERHEAD
    keys = [*hop_keys, path_key]  # keys[m]: the layer hop m (the proxy last) put around what it sent back
    inner = _open_layer(hop_keys[0], _HOP_DOMAIN + BACKWARD, payload, "hop layer")  # whole: nobody cut it
    # The nonces of the layers inside, read before those layers can be checked (each is at the start of
    # what the layer outside it encloses); the checks below cover them.
    nonces, head = [b""] * (hops + 1), inner[:(hops - 1) * HOP_OVERHEAD + NONCE_SIZE]
    for m in range(1, hops):
        nonces[m] = head[:NONCE_SIZE]
        head = _xor(head[HOP_OVERHEAD:], _stream(keys[m], nonces[m], 0, len(head) - HOP_OVERHEAD))
    nonces[hops] = head
    # cut[m]: the last bytes of what hop m sent back, which hop m - 1 cut: the path key's keystream over
    # the proxy's zeros, through the layers added since.
    cut, tail = [b""] * (hops + 1), bytes(HOP_OVERHEAD * (hops + 1))
    for m in range(hops, 0, -1):
        size = HOP_OVERHEAD * m
        tail = _xor(tail[:size], _stream(keys[m], nonces[m], room - size, size))
        cut[m] = tail[-HOP_OVERHEAD:]
    for m in range(1, hops):
        inner = _open_layer(keys[m], _HOP_DOMAIN + BACKWARD, inner + cut[m], "hop layer")
    return _decode(_open_layer(path_key, _PATH_DOMAIN + BACKWARD, inner + cut[hops], "path payload"))


@functools.lru_cache(maxsize=4096)
def exchange_key(identity: bytes) -> bytes:
    """A registered ed25519 identity key as the X25519 key that onion layers are sealed to. The ledger
    registers no key that does not convert (`chain.keys.exchange_capable`); one listed all the same is
    an OnionError, not a library error that ends the caller's loop."""
    try:
        return bytes(VerifyKey(identity).to_curve25519_public_key())
    except CryptoError as exc:
        reason = f"key {identity.hex()[:16]} has no X25519 form: nothing can be sealed to it"
        raise OnionError(reason) from exc


@functools.lru_cache(maxsize=16)
def _own_public(secret: bytes) -> bytes:
    """Our X25519 public key, bound into every key derivation: computed once, not per clove or setup."""
    return crypto_scalarmult_base(secret)


def exchange_secret(identity: SigningKey) -> bytes:
    return bytes(identity.to_curve25519_private_key())


@dataclass(frozen=True)
class _Keys:
    aead: ChaCha20Poly1305
    seed: bytes
    hop: bytes

    @property
    def filler(self) -> bytes:
        """The bytes a relay appends after removing its layer (only setup packets need them)."""
        stream = Cipher(algorithms.ChaCha20(self.seed, bytes(16)), mode=None).encryptor()
        return stream.update(bytes(LAYER_SIZE))


def _derive(shared: bytes, ephemeral: bytes, recipient: bytes) -> _Keys:
    if shared == bytes(KEY_SIZE):
        raise OnionError("degenerate ephemeral key")
    okm = HKDF(hashes.SHA256(), 3 * KEY_SIZE, salt=None, info=_INFO + ephemeral + recipient).derive(shared)
    return _Keys(ChaCha20Poly1305(okm[:KEY_SIZE]), okm[KEY_SIZE:2 * KEY_SIZE], okm[2 * KEY_SIZE:])


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a) ^ int.from_bytes(b)).to_bytes(len(a))


def build(route: Sequence[bytes], layers: Sequence[Layer]) -> tuple[bytes, tuple[bytes, ...]]:
    """The packet for the first relay of `route` (identity keys), whose relays read `layers` in order,
    and each relay's hop key."""
    hops = len(route)
    if not 1 <= hops <= MAX_HOPS:
        raise ValueError(f"a path has 1..{MAX_HOPS} relays, not {hops}")
    if len(layers) != hops:
        raise ValueError(f"a path needs one layer per relay: {hops} relays, {len(layers)} layers")
    ephemerals, keys = [], []
    for identity in route:
        secret = PrivateKey(secrets.token_bytes(KEY_SIZE))
        public = crypto_scalarmult_base(bytes(secret))
        recipient = exchange_key(identity)
        ephemerals.append(public)
        keys.append(_derive(crypto_scalarmult(bytes(secret), recipient), public, recipient))
    streams = [k.aead.encrypt(_NONCE, bytes(_BODY), e)[:_BODY] for k, e in zip(keys, ephemerals, strict=True)]
    # filler[j]: the bytes the relays before hop j will have appended, as hop j receives them.
    filler = [b""]
    for j in range(hops - 1):
        tail = filler[-1]
        filler.append(_xor(tail, streams[j][_BODY - len(tail):]) + keys[j].filler)
    tail = filler[-1]
    body = secrets.token_bytes(_BODY - HEADER_SIZE - len(tail))
    plaintext = layers[-1].encode() + body + _xor(tail, streams[-1][_BODY - len(tail):])
    packet = _seal_layer(keys[-1], ephemerals[-1], plaintext)
    for j in range(hops - 2, -1, -1):
        packet = _seal_layer(keys[j], ephemerals[j], layers[j].encode() + packet[:PACKET_SIZE - LAYER_SIZE])
    return packet, tuple(k.hop for k in keys)


def _seal_layer(keys: _Keys, ephemeral: bytes, plaintext: bytes) -> bytes:
    sealed = keys.aead.encrypt(_NONCE, plaintext, ephemeral)
    return ephemeral + sealed[-TAG_SIZE:] + sealed[:-TAG_SIZE]


def seal_to(identity: bytes, data: bytes) -> bytes:
    """Data only the holder of the ed25519 key `identity` can open: a prompt clove for its model node
    (one key agreement by the user and one by the node; relays never do any)."""
    secret = secrets.token_bytes(KEY_SIZE)
    ephemeral = crypto_scalarmult_base(secret)
    recipient = exchange_key(identity)
    keys = _derive(crypto_scalarmult(secret, recipient), ephemeral, recipient)
    return ephemeral + keys.aead.encrypt(_NONCE, data, ephemeral)


def open_sealed(secret: bytes, sealed: bytes) -> bytes:
    """What `seal_to` sealed for us; OnionError if it is not for us or was altered."""
    ephemeral = sealed[:KEY_SIZE]
    try:
        keys = _derive(crypto_scalarmult(secret, ephemeral), ephemeral, _own_public(secret))
        return keys.aead.decrypt(_NONCE, sealed[KEY_SIZE:], ephemeral)
    except (CryptoError, InvalidTag, ValueError):
        raise OnionError("sealed data is not for us, or was altered") from None


def peel(secret: bytes, packet: bytes) -> tuple[Layer, bytes]:
    """Our layer and the packet for the next relay (meaningless at the proxy). `secret` is our
    X25519 secret (`exchange_secret`)."""
    if len(packet) != PACKET_SIZE:
        raise OnionError(f"setup packet of {len(packet)} bytes, expected {PACKET_SIZE}")
    ephemeral, tag = packet[:KEY_SIZE], packet[KEY_SIZE:KEY_SIZE + TAG_SIZE]
    body = packet[KEY_SIZE + TAG_SIZE:]
    try:
        shared = crypto_scalarmult(secret, ephemeral)
    except CryptoError as exc:
        raise OnionError("malformed ephemeral key") from exc
    keys = _derive(shared, ephemeral, _own_public(secret))
    try:
        plaintext = keys.aead.decrypt(_NONCE, body + tag, ephemeral)
    except InvalidTag:
        raise OnionError("setup packet does not authenticate (not for us, or tampered)") from None
    layer = replace(Layer.decode(plaintext[:HEADER_SIZE]), hop_key=keys.hop)
    return layer, plaintext[HEADER_SIZE:] + keys.filler
