"""(n, k) S-IDA: one message becomes n cloves, any k of which recover it and k - 1 reveal nothing.

The paper's scheme (section 3.2): encrypt M under a fresh key K, split {M}_K k-of-n with an information
dispersal code, split K k-of-n with Shamir's secret sharing; clove C_i = (M_i, K_i).

- Encryption is AES-256-GCM under a fresh 32-byte key (so its random 12-byte nonce never repeats under
  one key), which runs on the CPU's AES instructions: 1.6x faster than ChaCha20-Poly1305 on a ToolUse
  prompt here. The associated data is the clove set's header (version, message id, n, k, ciphertext
  length), so a clove from another message, or with a changed parameter, makes the set fail
  authentication instead of decrypting to something else.
- The ciphertext, zero-padded to a multiple of k, is split into k fragments (1..k, the ciphertext
  itself) and n - k parity fragments. With one parity fragment (n = k + 1, as the default (4, 3)) it is
  the XOR of the k others, which any k of the k + 1 recover; with more, zfec's systematic Reed-Solomon
  code makes them. Both tolerate any n - k lost; the XOR costs a fifth of zfec's time. Padding must come
  back as zeros.
- The key, read as a 256-bit integer, is shared over GF(p), p = 2^521 - 1 (a Mersenne prime, so every
  key is a field element and reduction is cheap); coefficients from `secrets` (521 random bits each,
  drawn again in the one case, all ones, that is not below p), share i sits at x = i.
  With k = 1 every share is the key itself: (n, 1) buys resilience, not confidentiality.

Wire format of a clove (big-endian, 102 bytes then the fragment):

    version u8 | message id 16 | n u8 | k u8 | index u8 | ciphertext length u32 | nonce 12
    | key share 66 | fragment ceil(length / k)

The message id is random, so cloves of one message find each other without naming the sender.

Recovery tries k-subsets of what it holds (one clove per index) until one authenticates, at most
`max_attempts` AEAD checks per message, so one corrupted clove among n is tolerated when n - 1 >= k and
detected otherwise; wrong plaintext is never returned.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import zfec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

VERSION = 2
PRIME = 2**521 - 1
SHARE_SIZE = 66
KEY_SIZE = 32
NONCE_SIZE = 12
TAG_SIZE = 16
ID_SIZE = 16
MAX_N = 255
DEFAULT_N = 4
DEFAULT_K = 3
DEFAULT_MAX_MESSAGE = 4 * 1024 * 1024
DEFAULT_MAX_ATTEMPTS = 16
"""AEAD checks per message before it is given up: each costs an erasure decode and a decryption of the
whole message (up to 4 MiB), and a set of many cloves on many indices has more k-subsets than anyone
can try (at 128, 8.5 MiB of cloves built to fail held a node's event loop for 45 s). With one corrupted
clove among n, an honest message needs a few."""

_HEAD_SET, _HEAD_TAIL = struct.Struct(">B16sBB"), struct.Struct(">I12s")
"""A clove's header before and after its index byte: what all cloves of one set share."""
_HEAD = struct.Struct(_HEAD_SET.format + "B" + _HEAD_TAIL.format.lstrip(">"))
_INDEX = [bytes((i,)) for i in range(MAX_N + 1)]
HEADER_SIZE = _HEAD.size + SHARE_SIZE
_AD = struct.Struct(">16sB16sBBI")
_AD_DOMAIN = b"planetserve-sida"


class CloveError(Exception):
    """Base of everything that can go wrong with cloves received from the network."""


class MalformedCloveError(CloveError):
    """Bytes that are not a well-formed clove (truncated, oversized, inconsistent)."""


class MismatchedSetError(CloveError):
    """Cloves that belong to different messages or parameter sets were given as one message."""


class TooFewClovesError(CloveError):
    """Fewer than k distinct cloves of a set: the message cannot be recovered yet."""


class AuthenticationError(CloveError):
    """No k-subset of the cloves decrypts: some are corrupted or forged."""


class SetHeader(NamedTuple):
    """What every clove of one message shares; cloves are grouped (and authenticated) by it (a tuple:
    built and hashed for every clove received)."""

    message_id: bytes
    n: int
    k: int
    length: int
    nonce: bytes

    def associated_data(self) -> bytes:
        return _AD.pack(_AD_DOMAIN, VERSION, self.message_id, self.n, self.k, self.length)


@dataclass(slots=True)
class Clove:
    """One of n slices of a message; `index` (1..n) is both the fragment number and the share's x.
    `split` makes them well formed; `decode` checks every one from the network before it is made."""

    message_id: bytes
    index: int
    n: int
    k: int
    length: int
    nonce: bytes
    share: bytes = field(repr=False)
    fragment: bytes = field(repr=False)

    @property
    def header(self) -> SetHeader:
        return SetHeader(self.message_id, self.n, self.k, self.length, self.nonce)

    @property
    def size(self) -> int:
        return HEADER_SIZE + len(self.fragment)


def fragment_size(length: int, k: int) -> int:
    """Bytes per fragment: the ciphertext zero-padded to a multiple of k, over k."""
    return -(-length // k)


def _check_params(n: int, k: int, error: type[Exception]) -> None:
    if not 1 <= k <= n <= MAX_N:
        raise error(f"need 1 <= k <= n <= {MAX_N}, got n={n} k={k}")


# -- Shamir over GF(PRIME) -----------------------------------------------------------------------------


def random_elements(count: int, prime: int = PRIME) -> list[int]:
    """`count` uniform elements of GF(prime), from one read of `secrets` (rejection sampling: a value
    of prime's bit length that is not below it is drawn again)."""
    bits = prime.bit_length()
    size, mask = (bits + 7) // 8, (1 << bits) - 1
    out: list[int] = []
    while len(out) < count:
        raw = secrets.token_bytes(size * (count - len(out)))
        drawn = (int.from_bytes(raw[i : i + size]) & mask for i in range(0, len(raw), size))
        out += [v for v in drawn if v < prime]
    return out


def shamir_split(secret: int, n: int, k: int, prime: int = PRIME) -> list[int]:
    """Shares at x = 1..n of a random degree k-1 polynomial with constant term `secret`."""
    coefficients = random_elements(k - 1, prime)
    shares = []
    for x in range(1, n + 1):
        y = 0
        for c in reversed(coefficients):
            y = (y + c) * x % prime
        shares.append((y + secret) % prime)
    return shares


@lru_cache(maxsize=1024)
def _lagrange_at_zero(xs: tuple[int, ...], prime: int) -> tuple[int, ...]:
    """Public weights per x-set; cached because a modular inverse costs far more than the rest."""
    weights = []
    for i, xi in enumerate(xs):
        num = den = 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * xj % prime
                den = den * (xj - xi) % prime
        weights.append(num * pow(den, -1, prime) % prime)
    return tuple(weights)


def shamir_combine(points: Sequence[tuple[int, int]], prime: int = PRIME) -> int:
    """The polynomial's value at 0 from k points with distinct x."""
    weights = _lagrange_at_zero(tuple(x for x, _ in points), prime)
    return sum(w * y for w, (_, y) in zip(weights, points, strict=True)) % prime


# -- dispersal (zfec) ---------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _encoder(k: int, n: int) -> zfec.Encoder:
    return zfec.Encoder(k, n)


@lru_cache(maxsize=64)
def _decoder(k: int, n: int) -> zfec.Decoder:
    return zfec.Decoder(k, n)


def _xor(fragments: Sequence[bytes]) -> bytes:
    """The XOR of equal-sized fragments: the parity of an (k + 1, k) code (`_gather_parity` recovers a
    lost fragment the same way, in place)."""
    acc = np.frombuffer(fragments[0], np.uint8).copy()
    for fragment in fragments[1:]:
        np.bitwise_xor(acc, np.frombuffer(fragment, np.uint8), out=acc)
    return acc.tobytes()


def _disperse(data: bytes, n: int, k: int) -> list[bytes]:
    size = fragment_size(len(data), k)
    padded = data + bytes(size * k - len(data))
    blocks = tuple(padded[i * size : (i + 1) * size] for i in range(k))
    if n == k:
        return list(blocks)
    if n == k + 1:
        return [*blocks, _xor(blocks)]
    return [*blocks, *_encoder(k, n).encode(blocks, tuple(range(k, n)))]


def _gather(cloves: Sequence[Clove]) -> bytes | bytearray:
    """Padded ciphertext from k cloves; only needs the parity when a parity fragment is among them."""
    first = cloves[0]
    k = first.k
    if all(c.index <= k for c in cloves):
        return b"".join([c.fragment for c in sorted(cloves, key=lambda c: c.index)])
    if first.n == k + 1:
        return _gather_parity(cloves, k)
    fragments = tuple(c.fragment for c in cloves)
    return b"".join(_decoder(k, first.n).decode(fragments, tuple(c.index - 1 for c in cloves)))


def _gather_parity(cloves: Sequence[Clove], k: int) -> bytearray:
    """Padded ciphertext from the parity fragment and k - 1 others, written in place: the lost
    fragment is the XOR of the k held ones, computed into its slot."""
    size = len(cloves[0].fragment)
    padded = bytearray(size * k)
    lost = k * (k + 1) // 2 + k + 1 - sum(c.index for c in cloves)  # the one index of 1..k+1 not held
    for c in cloves:
        if c.index <= k:
            padded[(c.index - 1) * size : c.index * size] = c.fragment
    slot = np.frombuffer(padded, np.uint8)[(lost - 1) * size : lost * size]
    first, *rest = (np.frombuffer(c.fragment, np.uint8) for c in cloves)
    if not rest:  # k = 1: the parity is the fragment
        slot[:] = first
    else:
        np.bitwise_xor(first, rest[0], out=slot)
        for fragment in rest[1:]:
            np.bitwise_xor(slot, fragment, out=slot)
    return padded


# -- split / open -------------------------------------------------------------------------------------


def _seal(message: bytes, n: int, k: int, max_message: int) -> tuple[SetHeader, list[int], list[bytes]]:
    """The set header, key shares and fragments of a fresh encryption of `message`."""
    _check_params(n, k, ValueError)
    if len(message) > max_message:
        raise ValueError(f"message of {len(message)} bytes exceeds the {max_message}-byte limit")
    fresh = secrets.token_bytes(KEY_SIZE + ID_SIZE + NONCE_SIZE)
    key = fresh[:KEY_SIZE]
    message_id, nonce = fresh[KEY_SIZE : KEY_SIZE + ID_SIZE], fresh[KEY_SIZE + ID_SIZE :]
    header = SetHeader(message_id, n, k, len(message) + TAG_SIZE, nonce)
    ciphertext = AESGCM(key).encrypt(header.nonce, message, header.associated_data())
    return header, shamir_split(int.from_bytes(key), n, k), _disperse(ciphertext, n, k)


def split(
    message: bytes, n: int = DEFAULT_N, k: int = DEFAULT_K, *, max_message: int = DEFAULT_MAX_MESSAGE
) -> list[Clove]:
    """n cloves of `message`, any k of which recover it."""
    header, shares, fragments = _seal(message, n, k, max_message)
    return [
        Clove(header.message_id, i + 1, n, k, header.length, header.nonce, s.to_bytes(SHARE_SIZE), f)
        for i, (s, f) in enumerate(zip(shares, fragments, strict=True))
    ]


def split_encoded(
    message: bytes, n: int = DEFAULT_N, k: int = DEFAULT_K, *, max_message: int = DEFAULT_MAX_MESSAGE
) -> list[bytes]:
    """`encode` of each of `split`'s cloves, made without the Clove objects: what a sender puts on the
    wire, and the cloves' common header fields are packed once."""
    header, shares, fragments = _seal(message, n, k, max_message)
    before = _HEAD_SET.pack(VERSION, header.message_id, n, k)
    after = _HEAD_TAIL.pack(header.length, header.nonce)
    return [b"".join((before, _INDEX[i], after, s.to_bytes(SHARE_SIZE), f))
            for i, (s, f) in enumerate(zip(shares, fragments, strict=True), start=1)]


def _open(cloves: Sequence[Clove]) -> bytes | None:
    """The plaintext from exactly k cloves of one set, or None if they do not authenticate."""
    header = cloves[0].header
    key = shamir_combine([(c.index, int.from_bytes(c.share)) for c in cloves])
    if key.bit_length() > 8 * KEY_SIZE:
        return None
    padded = _gather(cloves)
    if padded.count(0, header.length) != len(padded) - header.length:
        return None
    aead = AESGCM(key.to_bytes(KEY_SIZE))
    try:
        return aead.decrypt(header.nonce, memoryview(padded)[: header.length], header.associated_data())
    except InvalidTag:
        return None


def _same(a: Clove, b: Clove) -> bool:
    return hmac.compare_digest(a.share, b.share) and a.fragment == b.fragment


class _Group:
    """Cloves of one set header, a few distinct variants per index so a forged early copy cannot
    shadow the genuine one."""

    def __init__(self, header: SetHeader, max_variants: int) -> None:
        self.header = header
        self.max_variants = max_variants
        self.variants: dict[int, list[Clove]] = {}
        self.cloves = 0
        """How many are kept, all indices together: k of them on k indices make one subset."""

    def accepts(self, clove: Clove) -> bool:
        """Whether the clove would be kept: not a duplicate, nor a variant beyond the cap."""
        kept = self.variants.get(clove.index, [])
        return len(kept) < self.max_variants and not any(_same(clove, c) for c in kept)

    def store(self, clove: Clove) -> None:
        """Keep a clove that `accepts` took (and still would: removals only make room)."""
        kept = self.variants.get(clove.index)
        if kept is None:
            self.variants[clove.index] = [clove]
        else:
            kept.append(clove)
        self.cloves += 1

    def add(self, clove: Clove) -> bool:
        """Whether the clove is new (kept); duplicates and variants beyond the cap are not."""
        if not self.accepts(clove):
            return False
        self.store(clove)
        return True

    def subsets(self, including: Clove | None = None) -> Iterator[tuple[Clove, ...]]:
        """k-subsets, one clove per index, earliest variants first; only those with `including`."""
        k = self.header.k
        if self.cloves == k and len(self.variants) == k:  # one clove on each of k indices: one subset
            yield tuple(kept[0] for kept in self.variants.values())
            return
        if including is None:
            for indices in itertools.combinations(sorted(self.variants), k):
                yield from itertools.product(*(self.variants[i] for i in indices))
            return
        others = sorted(i for i in self.variants if i != including.index)
        for indices in itertools.combinations(others, k - 1):
            for rest in itertools.product(*(self.variants[i] for i in indices)):
                yield (including, *rest)


def _search(subsets: Iterable[tuple[Clove, ...]], budget: int) -> tuple[bytes | None, int]:
    """First subset that authenticates, and how many AEAD checks it took."""
    spent = 0
    for subset in subsets:
        if spent >= budget:
            break
        spent += 1
        plaintext = _open(subset)
        if plaintext is not None:
            return plaintext, spent
    return None, spent


def join(cloves: Iterable[Clove], *, max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> bytes:
    """The message from cloves received all at once. Sets (by header) with fewer than k cloves are
    ignored, so a clove with a tampered header is tolerated if enough others are intact."""
    groups: dict[SetHeader, _Group] = {}
    for clove in cloves:
        header = clove.header
        if header not in groups:
            groups[header] = _Group(header, MAX_N)
        groups[header].add(clove)
    complete = [g for g in groups.values() if len(g.variants) >= g.header.k]
    if len({g.header.message_id for g in complete}) > 1:
        raise MismatchedSetError("cloves of more than one complete message")
    if not complete:
        if len(groups) > 1:
            raise MismatchedSetError("cloves of different sets, none with k of its own")
        have = len(next(iter(groups.values())).variants) if groups else 0
        raise TooFewClovesError(f"{have} distinct cloves, need k")
    budget = max_attempts
    for group in complete:
        plaintext, spent = _search(group.subsets(), budget)
        if plaintext is not None:
            return plaintext
        budget -= spent
    raise AuthenticationError("no k-subset of the cloves authenticates")


# -- encoding -----------------------------------------------------------------------------------------


def encode(clove: Clove) -> bytes:
    head = _HEAD.pack(VERSION, clove.message_id, clove.n, clove.k, clove.index, clove.length, clove.nonce)
    return b"".join((head, clove.share, clove.fragment))


def decode(data: bytes, *, max_message: int = DEFAULT_MAX_MESSAGE) -> Clove:
    """Strict: the version, the size limit and the fragment size are all checked before anything else
    is read."""
    if len(data) < HEADER_SIZE:
        raise MalformedCloveError(f"clove of {len(data)} bytes is shorter than its header")
    version, message_id, n, k, index, length, nonce = _HEAD.unpack_from(data)
    if version != VERSION:
        raise MalformedCloveError(f"unknown clove version {version}")
    if length > max_message + TAG_SIZE:
        raise MalformedCloveError(f"ciphertext of {length} bytes exceeds the {max_message}-byte limit")
    _check_params(n, k, MalformedCloveError)
    if not 1 <= index <= n:
        raise MalformedCloveError(f"index {index} outside 1..{n}")
    if length < TAG_SIZE:
        raise MalformedCloveError("ciphertext shorter than its tag")
    if len(data) != HEADER_SIZE + fragment_size(length, k):
        raise MalformedCloveError("clove size does not match its header")
    share = data[_HEAD.size : HEADER_SIZE]
    if int.from_bytes(share) >= PRIME:
        raise MalformedCloveError("key share is not a field element")
    return Clove(message_id, index, n, k, length, nonce, share, data[HEADER_SIZE:])


# -- reassembly ---------------------------------------------------------------------------------------


@dataclass
class _Pending:
    created: float
    groups: dict[SetHeader, _Group] = field(default_factory=dict)
    size: int = 0
    attempts: int = 0
    held: dict[Any, list[Clove]] = field(default_factory=dict)
    """The cloves stored, by the peer that sent them."""


class Reassembler:
    """Collects cloves as they arrive and returns each message once k valid cloves of it are in.

    Memory is bounded, and what one sending peer stores cannot push out what another stored:
    - per peer (the transport peer that delivered a clove, `add(clove, peer)`): at most
      `max_pending_per_peer` messages hold a clove of that peer and at most `max_pending_bytes_per_peer`
      bytes of its cloves are held; a clove that would pass either first evicts that peer's own oldest
      cloves (only its own: another peer's cloves of the same message stay);
    - in all: at most `max_pending` messages and `max_pending_bytes` of cloves; a clove that would
      pass either first evicts the oldest cloves of the peer that holds the most (messages or bytes,
      whichever is over), so many peers at once push out the largest holders first;
    - in time: a message expires `ttl` seconds after its first clove; each message keeps at most
      `max_sets` headers and `max_variants` distinct cloves per index.
    Everything is made room for before the clove is stored. Ids of finished messages are remembered
    for `ttl` so the late n - k cloves are dropped, not re-collected. Cloves added without a peer
    share one account with no per-peer limit (a user's relay, whose answer cloves come sealed under
    its own reply keys).
    """

    def __init__(
        self,
        *,
        max_pending: int = 1024,
        max_pending_bytes: int = 64 * 1024 * 1024,
        max_pending_per_peer: int = 128,
        max_pending_bytes_per_peer: int = 16 * 1024 * 1024,
        ttl: float = 30.0,
        max_message: int = DEFAULT_MAX_MESSAGE,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        max_sets: int = 4,
        max_variants: int = 2,
        max_n: int = MAX_N,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`max_n`: the most cloves a message may be split into (the overlay's is its paths' bound): a
        larger set is refused before it is stored, as it can only be built to make recovery search."""
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.max_pending_per_peer = max_pending_per_peer
        self.max_pending_bytes_per_peer = max_pending_bytes_per_peer
        self.ttl = ttl
        self.max_message = max_message
        self.max_attempts = max_attempts
        self.max_sets = max_sets
        self.max_variants = max_variants
        self.max_n = max_n
        self.clock = clock
        self.pending_bytes = 0
        self.dropped = 0
        """Evictions: a peer's cloves of one message pushed out to make room."""
        self.refused = 0
        """Cloves larger than a peer may hold at all."""
        self._pending: OrderedDict[bytes, _Pending] = OrderedDict()
        self._finished: OrderedDict[bytes, float] = OrderedDict()
        self._by_peer: dict[Any, OrderedDict[bytes, None]] = {}
        """Per peer, the messages holding its cloves, oldest first."""
        self._peer_bytes: dict[Any, int] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def held_by(self, peer: Any) -> tuple[int, int]:
        """(messages, bytes) that `peer`'s cloves take up."""
        return len(self._by_peer.get(peer, ())), self._peer_bytes.get(peer, 0)

    def add(self, clove: Clove | bytes, peer: Any = None) -> bytes | None:
        """The message if this clove completes one, else None. `peer` is who delivered it.

        Raises MalformedCloveError for bad bytes, and AuthenticationError when this clove gives k
        distinct cloves but no new k-subset authenticates; the message stays pending so a further
        clove can still recover it, until its attempt budget is spent.
        """
        if isinstance(clove, (bytes, bytearray, memoryview)):
            clove = decode(bytes(clove), max_message=self.max_message)
        elif clove.length > self.max_message + TAG_SIZE:
            raise MalformedCloveError("clove exceeds the message size limit")
        if clove.n > self.max_n:
            raise MalformedCloveError(f"clove of a set of {clove.n}, more than the {self.max_n} taken here")
        now = self.clock()
        self.expire(now)
        message_id = clove.message_id
        if message_id in self._finished:
            return None
        header = clove.header
        entry = self._pending.get(message_id)
        if entry is not None:
            group = entry.groups.get(header)
            if group is None and len(entry.groups) >= self.max_sets:
                return None
            if group is not None and not group.accepts(clove):
                return None
        size = clove.size
        if peer is not None and size > self.max_pending_bytes_per_peer:
            self.refused += 1
            return None
        if (peer is not None or self.pending_bytes + size > self.max_pending_bytes
                or len(self._pending) + (entry is None) > self.max_pending):
            self._make_room(peer, message_id, size)
            entry = self._pending.get(message_id)
        if entry is None:
            entry = self._pending[message_id] = _Pending(now)
        group = entry.groups.get(header)
        if group is None:
            group = entry.groups[header] = _Group(header, self.max_variants)
        group.store(clove)  # accepted above: evictions since only made room
        entry.size += size
        self.pending_bytes += size
        entry.held.setdefault(peer, []).append(clove)
        mine = self._by_peer.get(peer)
        if mine is None:
            mine = self._by_peer[peer] = OrderedDict()
        mine[message_id] = None
        self._peer_bytes[peer] = self._peer_bytes.get(peer, 0) + size
        return self._try(message_id, entry, group, clove)

    def _make_room(self, peer: Any, message_id: bytes, size: int) -> None:
        """Evict until a clove of `size` bytes from `peer` for `message_id` fits every bound."""
        if peer is not None:
            while (mine := self._by_peer.get(peer)) and (
                (message_id not in mine and len(mine) >= self.max_pending_per_peer)
                or self._peer_bytes[peer] + size > self.max_pending_bytes_per_peer
            ):
                self._evict(peer, next(iter(mine)))
        while self._pending:
            over_count = len(self._pending) + (message_id not in self._pending) > self.max_pending
            over_bytes = self.pending_bytes + size > self.max_pending_bytes
            if not (over_count or over_bytes):
                break
            if over_bytes:
                largest = max(self._peer_bytes, key=self._peer_bytes.__getitem__)
            else:
                largest = max(self._by_peer, key=lambda p: len(self._by_peer[p]))
            self._evict(largest, next(iter(self._by_peer[largest])))

    def _evict(self, peer: Any, message_id: bytes) -> None:
        """Remove `peer`'s cloves from one message (the message too, if nothing else is left)."""
        entry = self._pending[message_id]
        for clove in entry.held.pop(peer, []):
            group = entry.groups[clove.header]
            kept = group.variants[clove.index]
            kept[:] = [c for c in kept if c is not clove]
            group.cloves -= 1
            if not kept:
                del group.variants[clove.index]
            if not group.variants:
                del entry.groups[clove.header]
            entry.size -= clove.size
            self.pending_bytes -= clove.size
            self._peer_bytes[peer] -= clove.size
        self._forget_peer(peer, message_id)
        if not entry.held:
            del self._pending[message_id]
        self.dropped += 1

    def _forget_peer(self, peer: Any, message_id: bytes) -> None:
        mine = self._by_peer[peer]
        del mine[message_id]
        if not mine:
            del self._by_peer[peer]
            del self._peer_bytes[peer]

    def _try(self, message_id: bytes, entry: _Pending, group: _Group, clove: Clove) -> bytes | None:
        if len(group.variants) < group.header.k:
            return None
        budget = self.max_attempts - entry.attempts
        plaintext, spent = _search(group.subsets(including=clove), budget)
        entry.attempts += spent
        if plaintext is not None:
            self._finish(message_id)
            return plaintext
        if entry.attempts >= self.max_attempts:
            self._finish(message_id)
        raise AuthenticationError("no k-subset of this message's cloves authenticates")

    def _finish(self, message_id: bytes) -> None:
        self._drop(message_id)
        self._finished[message_id] = self.clock()
        while len(self._finished) > 4 * self.max_pending:
            self._finished.popitem(last=False)

    def _drop(self, message_id: bytes) -> None:
        entry = self._pending.pop(message_id)
        self.pending_bytes -= entry.size
        alone = len(entry.held) == 1
        for peer, cloves in entry.held.items():
            self._peer_bytes[peer] -= entry.size if alone else sum(c.size for c in cloves)
            self._forget_peer(peer, message_id)

    def expire(self, now: float | None = None) -> int:
        """Drop messages older than `ttl`; returns how many were pending."""
        now = self.clock() if now is None else now
        while self._finished and next(iter(self._finished.values())) + self.ttl <= now:
            self._finished.popitem(last=False)
        expired = 0
        while self._pending and next(iter(self._pending.values())).created + self.ttl <= now:
            self._drop(next(iter(self._pending)))
            expired += 1
        return expired
