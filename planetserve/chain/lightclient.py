"""Light-client verification of CometBFT headers that trusts nothing but the genesis file.

Written from CometBFT v0.38's specification (light client spec; types/block.go, validator_set.go,
vote.go, canonical.go, validation.go; crypto/merkle). What a client checks for a header at height H:

- the header is well formed, belongs to the genesis chain id, and hashes (RFC 6962 Merkle tree over
  the protobuf encodings of its 14 fields) to the block id its commit signs;
- the validator set served for H hashes to the header's `validators_hash` (validators ordered by
  voting power descending, then address; each leaf a protobuf SimpleValidator);
- every COMMIT signature in the commit is a valid ed25519 signature of the canonical vote sign bytes
  by the validator at that index, and those validators hold more than 2/3 of the set's power;
- the set itself is trusted by following CometBFT's light client from the genesis validator set at
  the initial height: sequentially (header H+1's `validators_hash` must equal trusted header H's
  `next_validators_hash`) or by skipping (more than 1/3 of a trusted set's power signed the new
  commit), bisecting when the trusted set's signatures are not enough.

Unlike CometBFT's `VerifyCommitLight`, which stops once 2/3 is reached, every COMMIT signature is
checked: an endpoint that alters any signature is refused.

The trust root is the genesis file, so there is no trusting period by default: a client that has
been offline longer than the unbonding period is exposed to long-range attacks by validators that
have since left (pass `trusting_period` to refuse such stale trust instead).

Signatures say who committed a header, not when it is read: an endpoint can keep answering with an
old, validly signed header (and the state it commits) for as long as it likes. So the latest header
a client is given must be fresh by the local clock: no older than `max_age` seconds
(DEFAULT_MAX_AGE) and no more than `max_clock_drift` seconds ahead, else `FreshnessError`. With a
`witness` (a second endpoint), every header returned must also be the one the witness has at that
height, else `WitnessMismatch`: a fork, or one of the two endpoints lying.

Every failure raises `VerificationError` (`ProviderError` when the endpoint gave no usable answer).
"""

from __future__ import annotations

import base64
import calendar
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from google.protobuf import timestamp_pb2, wrappers_pb2
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey
from tendermint.crypto import keys_pb2
from tendermint.types import canonical_pb2, types_pb2, validator_pb2
from tendermint.version import types_pb2 as version_pb2

from planetserve.chain.rpc import RpcClient, RpcError, RpcMalformed, b64, hexb, integer
from planetserve.chain.varint import encode_uvarint

BLOCK_PROTOCOL = 11
MAX_CHAIN_ID_LEN = 50
ADDRESS_SIZE = 20
HASH_SIZE = 32
MAX_SIGNATURE_SIZE = 64
MAX_TOTAL_VOTING_POWER = (2**63 - 1) // 8
FLAG_ABSENT = validator_pb2.BLOCK_ID_FLAG_ABSENT
FLAG_COMMIT = validator_pb2.BLOCK_ID_FLAG_COMMIT
FLAG_NIL = validator_pb2.BLOCK_ID_FLAG_NIL
ED25519_TYPE = "tendermint/PubKeyEd25519"
DEFAULT_TRUST_LEVEL = (1, 3)
STORE_VERSION = 1
DEFAULT_MAX_AGE = 300.0
"""Seconds the latest header may be older than the local clock. A healthy network commits a block every
`timeout_commit` (1 s for `planetserve genesis init` and localnet, 300 ms in tests) and never pauses
for want of transactions (`create_empty_blocks` is on), so its latest header is a second or two old; a
height whose proposer is down adds a failed round (CometBFT's `timeout_propose`, 3 s, plus 0.5 s for
each further round): even ten failed rounds in a row stay under a minute. Five minutes leaves a wide
margin over that and over ordinary clock error between this machine and the validators, while a list
read under the bound lags the chain by five minutes at most (about five of localnet's 40-block epochs,
two to three of the default 100-block ones)."""
DEFAULT_MAX_CLOCK_DRIFT = 10.0
"""Seconds a header time may be ahead of the local clock (CometBFT's light client default)."""
DEFAULT_WITNESS_WAIT = 5.0
"""Seconds to wait for a witness that has not yet committed the height it is asked about."""


class VerificationError(Exception):
    """A header, commit or validator set could not be verified."""


class ProviderError(VerificationError):
    """The RPC endpoint gave no usable answer."""


class NotEnoughTrust(VerificationError):
    """A trusted validator set signed too little of a non-adjacent commit: bisect."""


class FreshnessError(ProviderError):
    """A validly signed header that is too old to serve a view from (older than `max_age`, checked
    against the local clock), or too far ahead of the local clock (`max_clock_drift`). `age` is the
    local time minus the header time, in seconds: negative for a header from the future."""

    def __init__(self, message: str, height: int, time: Timestamp, age: float) -> None:
        super().__init__(message)
        self.height = height
        self.time = time
        self.age = age


class WitnessMismatch(VerificationError):
    """The witness endpoint's header at a height is not the one verified from the primary endpoint."""


def _seconds(t: Timestamp) -> float:
    return t.seconds + t.nanos / 1e9


def check_header_time(header: Header, now: float, max_age: float | None,
                max_clock_drift: float = DEFAULT_MAX_CLOCK_DRIFT, endpoint: str = "") -> None:
    """FreshnessError unless `header` is at most `max_age` seconds old (None: any age) and at most
    `max_clock_drift` seconds ahead of `now`, the local clock."""
    age = now - _seconds(header.time)
    where = f" from {endpoint}" if endpoint else ""
    if -age > max_clock_drift:
        raise FreshnessError(
            f"header {header.height}{where} has time {header.time}, {-age:.0f} s ahead of the local "
            f"clock: a header time is in the future beyond the allowed clock drift of "
            f"{max_clock_drift:g} s (check this machine's clock)", header.height, header.time, age)
    if max_age is not None and age > max_age:
        raise FreshnessError(
            f"header {header.height}{where} has time {header.time}, {age:.0f} s old, older than "
            f"max_age {max_age:g} s: a stale view (the endpoint is behind or replaying old answers, "
            f"or the chain has stopped committing blocks)", header.height, header.time, age)


# --- encoding primitives ------------------------------------------------------------------------


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def merkle_root(items: Sequence[bytes]) -> bytes:
    """RFC 6962 Merkle root as in CometBFT's crypto/merkle: leaves 0x00‖x, inner nodes 0x01‖l‖r,
    split at the largest power of two smaller than the number of items; empty tree = sha256("")."""
    n = len(items)
    if n == 0:
        return _sha256(b"")
    if n == 1:
        return _sha256(b"\x00" + items[0])
    k = 1 << ((n - 1).bit_length() - 1)
    return _sha256(b"\x01" + merkle_root(items[:k]) + merkle_root(items[k:]))



def address_of(pub_key: bytes) -> bytes:
    """A validator's address: the first 20 bytes of sha256 of its ed25519 public key."""
    return _sha256(pub_key)[:ADDRESS_SIZE]


_TIME = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:\d{2})$"
)


@dataclass(frozen=True, order=True)
class Timestamp:
    """A protobuf Timestamp: seconds since the Unix epoch and nanoseconds, compared exactly."""

    seconds: int
    nanos: int

    @classmethod
    def parse(cls, text: Any) -> Timestamp:
        """RFC 3339 with up to nanosecond precision, as CometBFT writes times in JSON."""
        m = _TIME.match(text) if isinstance(text, str) else None
        if not m:
            raise VerificationError(f"malformed time {text!r:.60}")
        year, mon, day, hh, mm, ss = (int(x) for x in m.groups()[:6])
        frac = m.group(7) or ""
        try:
            datetime(year, mon, day, hh, mm, ss)  # range checks
        except ValueError as exc:
            raise VerificationError(f"malformed time {text!r:.60}") from exc
        seconds = calendar.timegm((year, mon, day, hh, mm, ss, 0, 0, 0))
        tz = m.group(8)
        if tz != "Z":
            sign = 1 if tz[0] == "+" else -1
            seconds -= sign * (int(tz[1:3]) * 3600 + int(tz[4:6]) * 60)
        return cls(seconds, int(frac.ljust(9, "0")) if frac else 0)

    @property
    def datetime(self) -> datetime:
        return datetime.fromtimestamp(self.seconds, UTC).replace(microsecond=self.nanos // 1000)

    def to_proto(self) -> bytes:
        return timestamp_pb2.Timestamp(seconds=self.seconds, nanos=self.nanos).SerializeToString()

    def __str__(self) -> str:
        base = datetime.fromtimestamp(self.seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        frac = f".{self.nanos:09d}".rstrip("0").rstrip(".")
        return base + frac + "Z"


# --- JSON field readers: any shape error is a VerificationError ---------------------------------


def _get(d: Any, key: str, what: str) -> Any:
    if not isinstance(d, Mapping) or key not in d:
        raise VerificationError(f"malformed {what}: missing {key}")
    return d[key]


def _int(v: Any, what: str) -> int:
    try:
        return integer(v, what)
    except RpcMalformed:
        raise VerificationError(f"malformed {what}: not an int64") from None


def _hex(v: Any, what: str, size: int | None = None) -> bytes:
    try:
        out = hexb(v, what)
    except RpcMalformed as exc:
        raise VerificationError(f"malformed {what}: not a hex string") from exc
    if size is not None and out and len(out) != size:
        raise VerificationError(f"malformed {what}: {len(out)} bytes, expected {size}")
    return out


def _b64(v: Any, what: str) -> bytes:
    try:
        return b64(v, what)
    except RpcMalformed as exc:
        raise VerificationError(f"malformed {what}: not base64") from exc


# --- data types ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockID:
    hash: bytes
    parts_total: int
    parts_hash: bytes

    @classmethod
    def from_json(cls, raw: Any, what: str = "block_id") -> BlockID:
        parts = _get(raw, "parts", what)
        total = _int(_get(parts, "total", what), f"{what}.parts.total")
        if not 0 <= total < 2**32:
            raise VerificationError(f"malformed {what}: parts total out of range")
        return cls(
            hash=_hex(_get(raw, "hash", what), f"{what}.hash", HASH_SIZE),
            parts_total=total,
            parts_hash=_hex(_get(parts, "hash", what), f"{what}.parts.hash", HASH_SIZE),
        )

    @property
    def is_zero(self) -> bool:
        return not self.hash and self.parts_total == 0 and not self.parts_hash

    def to_proto(self) -> bytes:
        msg = types_pb2.BlockID(hash=self.hash)
        msg.part_set_header.total = self.parts_total
        msg.part_set_header.hash = self.parts_hash
        msg.part_set_header.SetInParent()  # gogoproto non-nullable: always encoded
        return msg.SerializeToString()


@dataclass(frozen=True)
class Header:
    """A block header as served in JSON; `hash` is computed as CometBFT's Header.Hash()."""

    version_block: int
    version_app: int
    chain_id: str
    height: int
    time: Timestamp
    last_block_id: BlockID
    last_commit_hash: bytes
    data_hash: bytes
    validators_hash: bytes
    next_validators_hash: bytes
    consensus_hash: bytes
    app_hash: bytes
    last_results_hash: bytes
    evidence_hash: bytes
    proposer_address: bytes

    @classmethod
    def from_json(cls, raw: Any) -> Header:
        w = "header"
        version = _get(raw, "version", w)
        if not isinstance(version, Mapping):
            raise VerificationError("malformed header: version is not an object")
        chain_id = _get(raw, "chain_id", w)
        if not isinstance(chain_id, str):
            raise VerificationError("malformed header: chain_id is not a string")
        return cls(
            version_block=_int(_get(version, "block", w), "header.version.block"),
            version_app=_int(version.get("app", 0), "header.version.app"),
            chain_id=chain_id,
            height=_int(_get(raw, "height", w), "header.height"),
            time=Timestamp.parse(_get(raw, "time", w)),
            last_block_id=BlockID.from_json(_get(raw, "last_block_id", w), "header.last_block_id"),
            last_commit_hash=_hex(raw.get("last_commit_hash"), "last_commit_hash", HASH_SIZE),
            data_hash=_hex(raw.get("data_hash"), "data_hash", HASH_SIZE),
            validators_hash=_hex(raw.get("validators_hash"), "validators_hash", HASH_SIZE),
            next_validators_hash=_hex(
                raw.get("next_validators_hash"), "next_validators_hash", HASH_SIZE
            ),
            consensus_hash=_hex(raw.get("consensus_hash"), "consensus_hash", HASH_SIZE),
            app_hash=_hex(raw.get("app_hash"), "app_hash"),
            last_results_hash=_hex(raw.get("last_results_hash"), "last_results_hash", HASH_SIZE),
            evidence_hash=_hex(raw.get("evidence_hash"), "evidence_hash", HASH_SIZE),
            proposer_address=_hex(raw.get("proposer_address"), "proposer_address"),
        )

    def to_json(self) -> dict[str, Any]:
        def h(b: bytes) -> str:
            return b.hex().upper()

        return {
            "version": {"block": str(self.version_block), "app": str(self.version_app)},
            "chain_id": self.chain_id,
            "height": str(self.height),
            "time": str(self.time),
            "last_block_id": _block_id_json(self.last_block_id),
            "last_commit_hash": h(self.last_commit_hash),
            "data_hash": h(self.data_hash),
            "validators_hash": h(self.validators_hash),
            "next_validators_hash": h(self.next_validators_hash),
            "consensus_hash": h(self.consensus_hash),
            "app_hash": h(self.app_hash),
            "last_results_hash": h(self.last_results_hash),
            "evidence_hash": h(self.evidence_hash),
            "proposer_address": h(self.proposer_address),
        }

    @cached_property
    def hash(self) -> bytes:
        """Merkle root over the 14 field encodings (types/block.go Header.Hash)."""
        if not self.validators_hash:
            return b""

        def wrap_bytes(b: bytes) -> bytes:
            return wrappers_pb2.BytesValue(value=b).SerializeToString()

        return merkle_root(
            [
                version_pb2.Consensus(
                    block=self.version_block, app=self.version_app
                ).SerializeToString(),
                wrappers_pb2.StringValue(value=self.chain_id).SerializeToString(),
                wrappers_pb2.Int64Value(value=self.height).SerializeToString(),
                self.time.to_proto(),
                self.last_block_id.to_proto(),
                wrap_bytes(self.last_commit_hash),
                wrap_bytes(self.data_hash),
                wrap_bytes(self.validators_hash),
                wrap_bytes(self.next_validators_hash),
                wrap_bytes(self.consensus_hash),
                wrap_bytes(self.app_hash),
                wrap_bytes(self.last_results_hash),
                wrap_bytes(self.evidence_hash),
                wrap_bytes(self.proposer_address),
            ]
        )

    def validate_basic(self, chain_id: str) -> None:
        if self.chain_id != chain_id:
            raise VerificationError(
                f"chain id mismatch: header {self.height} is for {self.chain_id!r:.60}, "
                f"expected {chain_id!r}"
            )
        if self.version_block != BLOCK_PROTOCOL:
            raise VerificationError(
                f"block protocol mismatch: {self.version_block}, expected {BLOCK_PROTOCOL}"
            )
        if len(self.chain_id) > MAX_CHAIN_ID_LEN:
            raise VerificationError("chain id too long")
        if self.height <= 0:
            raise VerificationError(f"invalid header height {self.height}")
        if len(self.proposer_address) != ADDRESS_SIZE:
            raise VerificationError("invalid proposer address length")
        if not self.validators_hash:
            raise VerificationError("header has no validators hash")


def _block_id_json(b: BlockID) -> dict[str, Any]:
    return {
        "hash": b.hash.hex().upper(),
        "parts": {"total": b.parts_total, "hash": b.parts_hash.hex().upper()},
    }


@dataclass(frozen=True)
class CommitSig:
    flag: int
    validator_address: bytes
    timestamp: Timestamp
    signature: bytes

    @classmethod
    def from_json(cls, raw: Any, idx: int) -> CommitSig:
        w = f"commit signature #{idx}"
        flag = _int(_get(raw, "block_id_flag", w), f"{w} flag")
        if flag not in (FLAG_ABSENT, FLAG_COMMIT, FLAG_NIL):
            raise VerificationError(f"malformed {w}: unknown block id flag {flag}")
        ts = raw.get("timestamp")
        sig = cls(
            flag=flag,
            validator_address=_hex(raw.get("validator_address"), f"{w} address"),
            timestamp=Timestamp.parse(ts) if ts else Timestamp(-62135596800, 0),
            signature=_b64(raw.get("signature"), f"{w} signature"),
        )
        if flag == FLAG_ABSENT:
            if sig.validator_address or sig.signature:
                raise VerificationError(f"malformed {w}: absent vote carries an address or signature")
        else:
            if len(sig.validator_address) != ADDRESS_SIZE:
                raise VerificationError(f"malformed {w}: address is not {ADDRESS_SIZE} bytes")
            if not sig.signature or len(sig.signature) > MAX_SIGNATURE_SIZE:
                raise VerificationError(f"malformed {w}: missing or oversized signature")
        return sig


@dataclass(frozen=True)
class Commit:
    height: int
    round: int
    block_id: BlockID
    signatures: tuple[CommitSig, ...]

    @classmethod
    def from_json(cls, raw: Any) -> Commit:
        sigs = _get(raw, "signatures", "commit")
        if not isinstance(sigs, list) or not sigs:
            raise VerificationError("malformed commit: no signatures")
        commit = cls(
            height=_int(_get(raw, "height", "commit"), "commit.height"),
            round=_int(_get(raw, "round", "commit"), "commit.round"),
            block_id=BlockID.from_json(_get(raw, "block_id", "commit"), "commit.block_id"),
            signatures=tuple(CommitSig.from_json(s, i) for i, s in enumerate(sigs)),
        )
        if commit.height < 1 or not 0 <= commit.round < 2**31:
            raise VerificationError("malformed commit: bad height or round")
        if commit.block_id.is_zero:
            raise VerificationError("malformed commit: commit for a nil block")
        return commit

    def vote_sign_bytes(self, chain_id: str, idx: int) -> bytes:
        """What validator `idx` signed: a length-delimited CanonicalVote (types/vote.go)."""
        sig = self.signatures[idx]
        vote = canonical_pb2.CanonicalVote(
            type=types_pb2.SIGNED_MSG_TYPE_PRECOMMIT,
            height=self.height,
            round=self.round,
            chain_id=chain_id,
        )
        if sig.flag == FLAG_COMMIT:  # a nil vote's block id is zero: the field is left out
            vote.block_id.hash = self.block_id.hash
            vote.block_id.part_set_header.total = self.block_id.parts_total
            vote.block_id.part_set_header.hash = self.block_id.parts_hash
            vote.block_id.part_set_header.SetInParent()
            vote.block_id.SetInParent()
        vote.timestamp.seconds = sig.timestamp.seconds
        vote.timestamp.nanos = sig.timestamp.nanos
        vote.timestamp.SetInParent()  # non-nullable stdtime: always encoded
        body = vote.SerializeToString()
        return encode_uvarint(len(body)) + body


@dataclass(frozen=True)
class Validator:
    address: bytes
    pub_key: bytes
    power: int

    def to_proto(self) -> bytes:
        """The leaf of the validator-set hash: protobuf SimpleValidator."""
        return validator_pb2.SimpleValidator(
            pub_key=keys_pb2.PublicKey(ed25519=self.pub_key), voting_power=self.power
        ).SerializeToString()


class ValidatorSet:
    """Validators in CometBFT's order: voting power descending, then address ascending."""

    def __init__(self, validators: Iterable[Validator]) -> None:
        vals = sorted(validators, key=lambda v: (-v.power, v.address))
        if not vals:
            raise VerificationError("empty validator set")
        self.by_address: dict[bytes, tuple[int, Validator]] = {}
        for i, v in enumerate(vals):
            if len(v.pub_key) != 32:
                raise VerificationError(f"validator {v.address.hex().upper()}: bad ed25519 key")
            if v.address != address_of(v.pub_key):
                raise VerificationError(
                    f"validator {v.address.hex().upper()}: address does not match its public key"
                )
            if v.power <= 0:
                raise VerificationError(f"validator {v.address.hex().upper()}: non-positive power")
            if v.address in self.by_address:
                raise VerificationError(f"duplicate validator {v.address.hex().upper()}")
            self.by_address[v.address] = (i, v)
        self.validators: tuple[Validator, ...] = tuple(vals)
        self.total_power = sum(v.power for v in vals)
        if self.total_power > MAX_TOTAL_VOTING_POWER:
            raise VerificationError("total voting power too large")

    @classmethod
    def from_json(cls, raw: Any, power_key: str = "voting_power") -> ValidatorSet:
        if not isinstance(raw, list):
            raise VerificationError("malformed validator set: not a list")
        vals = []
        for i, r in enumerate(raw):
            w = f"validator #{i}"
            pk = _get(r, "pub_key", w)
            if _get(pk, "type", w) != ED25519_TYPE:
                raise VerificationError(f"{w}: unsupported key type {pk.get('type')!r:.40}")
            pub = _b64(_get(pk, "value", w), f"{w} pub_key")
            addr = _hex(r.get("address"), f"{w} address") or address_of(pub)
            vals.append(Validator(addr, pub, _int(_get(r, power_key, w), f"{w} power")))
        return cls(vals)

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {
                "address": v.address.hex().upper(),
                "pub_key": {"type": ED25519_TYPE, "value": base64.b64encode(v.pub_key).decode()},
                "voting_power": str(v.power),
            }
            for v in self.validators
        ]

    def __len__(self) -> int:
        return len(self.validators)

    @cached_property
    def hash(self) -> bytes:
        return merkle_root([v.to_proto() for v in self.validators])


@dataclass(frozen=True)
class LightBlock:
    header: Header
    commit: Commit
    validators: ValidatorSet

    @property
    def height(self) -> int:
        return self.header.height

    def to_json(self) -> dict[str, Any]:
        c = self.commit
        return {
            "header": self.header.to_json(),
            "commit": {
                "height": str(c.height),
                "round": c.round,
                "block_id": _block_id_json(c.block_id),
                "signatures": [_sig_json(s) for s in c.signatures],
            },
            "validators": self.validators.to_json(),
        }

    @classmethod
    def from_json(cls, raw: Any) -> LightBlock:
        return cls(
            header=Header.from_json(_get(raw, "header", "light block")),
            commit=Commit.from_json(_get(raw, "commit", "light block")),
            validators=ValidatorSet.from_json(_get(raw, "validators", "light block")),
        )


def _sig_json(s: CommitSig) -> dict[str, Any]:
    return {
        "block_id_flag": s.flag,
        "validator_address": s.validator_address.hex().upper(),
        "timestamp": str(s.timestamp) if s.flag != FLAG_ABSENT else "0001-01-01T00:00:00Z",
        "signature": base64.b64encode(s.signature).decode() if s.signature else None,
    }


# --- genesis ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Genesis:
    chain_id: str
    initial_height: int
    genesis_time: Timestamp
    validators: ValidatorSet
    doc_hash: bytes  # sha256 of the canonical JSON of the document: binds a trusted store to it

    @classmethod
    def from_json(cls, doc: Any) -> Genesis:
        chain_id = _get(doc, "chain_id", "genesis")
        if not isinstance(chain_id, str) or not chain_id or len(chain_id) > MAX_CHAIN_ID_LEN:
            raise VerificationError("malformed genesis: bad chain_id")
        vals = doc.get("validators") or []
        if not vals:
            raise VerificationError("genesis lists no validators: it cannot be a trust root")
        initial = _int(doc.get("initial_height", "1") or "1", "genesis.initial_height")
        canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return cls(
            chain_id=chain_id,
            initial_height=max(initial, 1),
            genesis_time=Timestamp.parse(_get(doc, "genesis_time", "genesis")),
            validators=ValidatorSet.from_json(vals, power_key="power"),
            doc_hash=_sha256(canonical),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Genesis:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise VerificationError(f"cannot read genesis {path}: {exc}") from exc
        return cls.from_json(doc)


# --- verification -------------------------------------------------------------------------------


def _verify_sig(v: Validator, msg: bytes, sig: bytes) -> bool:
    try:
        VerifyKey(v.pub_key).verify(msg, sig)
    except (BadSignatureError, ValueError):
        return False
    return True


def _check_commit_sig(
    chain_id: str, commit: Commit, idx: int, val: Validator, checked: set[tuple[bytes, int]] | None
) -> None:
    """Verify signature `idx` of `commit` by `val`; `checked` remembers successes across the two
    tallies of a skipping verification so that no signature is verified twice."""
    if checked is not None and (val.pub_key, idx) in checked:
        return
    if not _verify_sig(val, commit.vote_sign_bytes(chain_id, idx), commit.signatures[idx].signature):
        raise VerificationError(
            f"commit signature invalid for validator {val.address.hex().upper()} "
            f"at height {commit.height}"
        )
    if checked is not None:
        checked.add((val.pub_key, idx))


def check_signed_header(header: Header, commit: Commit, chain_id: str) -> None:
    """SignedHeader.ValidateBasic: chain id, heights, and the commit signs this header's hash."""
    header.validate_basic(chain_id)
    if commit.height != header.height:
        raise VerificationError(
            f"commit height {commit.height} does not match header height {header.height}"
        )
    if header.hash != commit.block_id.hash:
        raise VerificationError(
            f"header hash mismatch at height {header.height}: header hashes to "
            f"{header.hash.hex().upper()}, commit signs {commit.block_id.hash.hex().upper()}"
        )


def verify_commit(
    chain_id: str,
    vals: ValidatorSet,
    header: Header,
    commit: Commit,
    checked: set[tuple[bytes, int]] | None = None,
) -> int:
    """More than 2/3 of `vals` (the header's own set) signed; every COMMIT signature is checked.

    Signatures correspond to validators by index. Returns the power that signed.
    """
    if len(commit.signatures) != len(vals):
        raise VerificationError(
            f"commit has {len(commit.signatures)} signatures for {len(vals)} validators"
        )
    if commit.height != header.height or commit.block_id.hash != header.hash:
        raise VerificationError("commit is not for this header")
    tallied = 0
    for idx, sig in enumerate(commit.signatures):
        if sig.flag == FLAG_ABSENT:
            continue
        val = vals.validators[idx]
        if sig.validator_address != val.address:
            raise VerificationError(
                f"unknown validator {sig.validator_address.hex().upper()} at commit index {idx} "
                f"(expected {val.address.hex().upper()})"
            )
        if sig.flag != FLAG_COMMIT:
            continue
        _check_commit_sig(chain_id, commit, idx, val, checked)
        tallied += val.power
    needed = vals.total_power * 2 // 3
    if tallied <= needed:
        raise VerificationError(
            f"insufficient voting power: {tallied}/{vals.total_power} signed at height "
            f"{commit.height}, more than 2/3 needed"
        )
    return tallied


def verify_commit_trusting(
    chain_id: str,
    trusted: ValidatorSet,
    commit: Commit,
    trust_level: tuple[int, int],
    checked: set[tuple[bytes, int]] | None = None,
) -> int:
    """More than `trust_level` of the trusted set's power signed `commit` (matched by address;
    signatures by validators outside the trusted set are skipped, double votes refused)."""
    num, den = trust_level
    seen: set[bytes] = set()
    tallied = 0
    for idx, sig in enumerate(commit.signatures):
        if sig.flag != FLAG_COMMIT:
            continue
        found = trusted.by_address.get(sig.validator_address)
        if found is None:
            continue
        if sig.validator_address in seen:
            raise VerificationError(
                f"duplicate signature from validator {sig.validator_address.hex().upper()}"
            )
        seen.add(sig.validator_address)
        val = found[1]
        _check_commit_sig(chain_id, commit, idx, val, checked)
        tallied += val.power
    needed = trusted.total_power * num // den
    if tallied <= needed:
        raise NotEnoughTrust(
            f"insufficient trusted voting power: {tallied}/{trusted.total_power} of the trusted "
            f"set signed height {commit.height}, more than {num}/{den} needed"
        )
    return tallied


def _verify_new_header_and_vals(
    untrusted: LightBlock, trusted: LightBlock, chain_id: str, now: float, max_drift: float
) -> None:
    h, th = untrusted.header, trusted.header
    check_signed_header(h, untrusted.commit, chain_id)
    if h.height <= th.height:
        raise VerificationError(f"header height {h.height} not above trusted height {th.height}")
    if not h.time > th.time:
        raise VerificationError(
            f"header time {h.time} at height {h.height} not after trusted header time {th.time}"
        )
    if not h.time < Timestamp(int(now + max_drift), 0):
        age = now - _seconds(h.time)
        raise FreshnessError(
            f"header time {h.time} at height {h.height} is in the future: {-age:.0f} s ahead of the "
            f"local clock, beyond the allowed clock drift of {max_drift:g} s", h.height, h.time, age)
    if h.validators_hash != untrusted.validators.hash:
        raise VerificationError(
            f"validators hash mismatch at height {h.height}: header has "
            f"{h.validators_hash.hex().upper()}, served set hashes to "
            f"{untrusted.validators.hash.hex().upper()}"
        )


def _check_expiry(trusted: LightBlock, now: float, trusting_period: float | None) -> None:
    if trusting_period is not None and trusted.header.time.seconds + trusting_period <= now:
        raise VerificationError(
            f"trusted header {trusted.height} expired (older than the trusting period)"
        )


def verify_adjacent(
    trusted: LightBlock,
    untrusted: LightBlock,
    chain_id: str,
    *,
    now: float | None = None,
    max_clock_drift: float = DEFAULT_MAX_CLOCK_DRIFT,
    trusting_period: float | None = None,
) -> None:
    """Header H+1 against trusted header H: its set must be H's announced next set."""
    now = time.time() if now is None else now
    if untrusted.height != trusted.height + 1:
        raise VerificationError("headers must be adjacent in height")
    _check_expiry(trusted, now, trusting_period)
    _verify_new_header_and_vals(untrusted, trusted, chain_id, now, max_clock_drift)
    if untrusted.header.validators_hash != trusted.header.next_validators_hash:
        raise VerificationError(
            f"next validators hash mismatch: trusted header {trusted.height} announced "
            f"{trusted.header.next_validators_hash.hex().upper()}, header {untrusted.height} has "
            f"{untrusted.header.validators_hash.hex().upper()}"
        )
    verify_commit(chain_id, untrusted.validators, untrusted.header, untrusted.commit)


def verify_non_adjacent(
    trusted: LightBlock,
    untrusted: LightBlock,
    chain_id: str,
    *,
    trust_level: tuple[int, int] = DEFAULT_TRUST_LEVEL,
    now: float | None = None,
    max_clock_drift: float = DEFAULT_MAX_CLOCK_DRIFT,
    trusting_period: float | None = None,
) -> None:
    """Skipping verification: `trust_level` of the trusted set signed, and 2/3 of the new set.

    Raises NotEnoughTrust when only the trusted set's share is short (the caller bisects)."""
    now = time.time() if now is None else now
    if untrusted.height == trusted.height + 1:
        raise VerificationError("headers must be non-adjacent in height")
    _check_expiry(trusted, now, trusting_period)
    _verify_new_header_and_vals(untrusted, trusted, chain_id, now, max_clock_drift)
    checked: set[tuple[bytes, int]] = set()
    verify_commit_trusting(chain_id, trusted.validators, untrusted.commit, trust_level, checked)
    verify_commit(chain_id, untrusted.validators, untrusted.header, untrusted.commit, checked)


# --- the client ---------------------------------------------------------------------------------


class LightClient:
    """Verified headers from one (untrusted) RPC endpoint, rooted in the genesis file.

    Trusted light blocks are kept in memory and, with `store_path`, in a JSON file, so later
    verifications start from the nearest trusted header below the target. `sequential=True`
    verifies every intermediate header; the default skips with bisection as CometBFT does.

    The latest header (`verified_light_block()` without a height) must be fresh by `clock`, the local
    clock: at most `max_age` seconds old (None: any age) and at most `max_clock_drift` seconds ahead,
    else FreshnessError. A header asked for by height is history and may be of any age. With
    `witness`, a second endpoint, every header returned must hash as the witness's header of the
    same height does, else WitnessMismatch (the witness is given `witness_wait` seconds to reach a
    height it has not committed yet); a witness that gives no usable answer is a ProviderError.
    """

    def __init__(
        self,
        genesis: Genesis | Mapping[str, Any] | str | Path,
        rpc: RpcClient | str,
        *,
        store_path: str | Path | None = None,
        trust_level: tuple[int, int] = DEFAULT_TRUST_LEVEL,
        sequential: bool = False,
        max_clock_drift: float = DEFAULT_MAX_CLOCK_DRIFT,
        trusting_period: float | None = None,
        max_stored: int = 200,
        max_age: float | None = DEFAULT_MAX_AGE,
        witness: RpcClient | str | None = None,
        witness_wait: float = DEFAULT_WITNESS_WAIT,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(genesis, Genesis):
            self.genesis = genesis
        elif isinstance(genesis, Mapping):
            self.genesis = Genesis.from_json(genesis)
        else:
            self.genesis = Genesis.from_file(genesis)
        num, den = trust_level
        if not (den > 0 and 3 * num >= den and num <= den):
            raise ValueError("trust level must be within [1/3, 1]")
        if max_age is not None and not 0 < max_age < float("inf"):
            raise ValueError(f"max_age must be a positive number of seconds, got {max_age!r}")
        if not 0 <= max_clock_drift < float("inf"):
            raise ValueError(f"max_clock_drift must be a number of seconds >= 0, got {max_clock_drift!r}")
        self.rpc = RpcClient(rpc) if isinstance(rpc, str) else rpc
        self.witness = RpcClient(witness) if isinstance(witness, str) else witness
        self.trust_level = trust_level
        self.sequential = sequential
        self.max_clock_drift = max_clock_drift
        self.trusting_period = trusting_period
        self.max_age = max_age
        self.witness_wait = witness_wait
        self.clock = clock
        self.max_stored = max(max_stored, 2)
        self.store_path = Path(store_path) if store_path else None
        self._trusted: dict[int, LightBlock] = {}
        self._witnessed: set[int] = set()  # trusted heights whose header the witness has confirmed
        self.last_trace: list[int] = []  # heights verified by the last call, in order
        if self.store_path and self.store_path.exists():
            self._load_store()

    @classmethod
    def from_genesis_file(
        cls, path: str | Path, rpc: RpcClient | str, **kwargs: Any
    ) -> LightClient:
        return cls(Genesis.from_file(path), rpc, **kwargs)

    @property
    def chain_id(self) -> str:
        return self.genesis.chain_id

    # public API

    def latest_trusted(self) -> LightBlock | None:
        return self._trusted[max(self._trusted)] if self._trusted else None

    def trusted_heights(self) -> list[int]:
        return sorted(self._trusted)

    def verified_light_block(self, height: int | None = None) -> LightBlock:
        """The light block at `height` (None: the endpoint's latest, which must be fresh), verified
        from genesis and, with a witness, confirmed by it. Whatever an answer holds, what goes wrong is
        a VerificationError: a field no encoder takes (a height of 2^63, an app version of -1) raised
        a ValueError from the header's hash that ended the callers' refresh loops."""
        try:
            return self._verified_light_block(height)
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
            raise VerificationError(f"malformed answer from {_url(self.rpc) or 'the endpoint'}: "
                                    f"{exc!r:.200}") from exc

    def _verified_light_block(self, height: int | None) -> LightBlock:
        self.last_trace = []
        latest = height is None
        if height is None:
            height = self._latest_height()
        if height < self.genesis.initial_height:
            raise VerificationError(
                f"height {height} is below the initial height {self.genesis.initial_height}"
            )
        if not self._trusted:
            self._bootstrap()
            self._save_store()
        if height in self._trusted:
            block = self._trusted[height]
        else:
            anchor = self._trusted[max(h for h in self._trusted if h < height)]
            block = self._fetch(height)
            if self.sequential:
                self._verify_sequential(anchor, block)
            else:
                self._verify_skipping(anchor, block)
        if latest:
            self.check_fresh(block.header)
        if self.witness is not None and height not in self._witnessed:
            try:
                self._check_witness(block)
            except WitnessMismatch:
                for h in {height, *self.last_trace}:  # a disputed header and those verified on the
                    if h != self.genesis.initial_height:  # way to it anchor nothing
                        self._trusted.pop(h, None)
                raise
            self._witnessed.add(height)
        if self.last_trace:
            self._save_store()
        return block

    def check_fresh(self, header: Header) -> None:
        """FreshnessError unless `header` is within `max_age` and `max_clock_drift` of the local clock
        now: for the latest header when it is read, and for a view read from it while it is kept."""
        check_header_time(header, self.clock(), self.max_age, self.max_clock_drift, _url(self.rpc))

    def verified_header(self, height: int | None = None) -> Header:
        return self.verified_light_block(height).header

    def verified_header_after(self, height: int, wait: float = 10.0) -> Header:
        """Header `height`+1, which carries the app hash of the state after block `height`, verified,
        waiting up to `wait` seconds for that block to be committed."""
        deadline = time.monotonic() + wait
        while (height + 1) not in self._trusted and self._latest_height() < height + 1:
            if time.monotonic() >= deadline:
                raise ProviderError(f"block {height + 1} not committed within {wait:g}s")
            time.sleep(0.1)
        return self.verified_header(height + 1)

    def verified_app_hash(self, height: int, wait: float = 10.0) -> bytes:
        """The app hash of the state after block `height`: from verified header `height`+1,
        waiting up to `wait` seconds for that block to be committed."""
        return self.verified_header_after(height, wait).app_hash

    # the witness

    def _check_witness(self, block: LightBlock) -> None:
        """WitnessMismatch unless the witness's header at the block's height hashes as the block's."""
        assert self.witness is not None
        h, primary, witness = block.height, _url(self.rpc), _url(self.witness)
        deadline = time.monotonic() + self.witness_wait
        try:
            while self.witness.latest_height() < h:
                if time.monotonic() >= deadline:
                    raise ProviderError(
                        f"witness {witness} has not committed height {h} within "
                        f"{self.witness_wait:g} s: it cannot confirm the header from {primary}"
                    )
                time.sleep(0.1)
            theirs = Header.from_json(self.witness.commit(h)["header"]).hash
        except RpcError as exc:
            raise ProviderError(f"witness {witness} gave no usable header {h}: {exc}") from exc
        except VerificationError as exc:
            if isinstance(exc, ProviderError):
                raise
            raise ProviderError(f"witness {witness} gave no usable header {h}: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
            raise ProviderError(f"witness {witness} gave no usable header {h}: {exc!r:.200}") from exc
        ours = block.header.hash
        if theirs != ours:
            raise WitnessMismatch(
                f"witness {witness} disagrees with primary {primary} at height {h}: the header "
                f"verified from the primary hashes to {ours.hex().upper()}, the witness's to "
                f"{theirs.hex().upper()} (a fork of the chain, or one of the two endpoints is lying)"
            )

    # verification strategies

    def _bootstrap(self) -> None:
        """Trust the block at the initial height: signed by more than 2/3 of the genesis set."""
        g = self.genesis
        lb = self._fetch(g.initial_height, validators=g.validators)
        h = lb.header
        check_signed_header(h, lb.commit, g.chain_id)
        if h.height != g.initial_height:
            raise VerificationError(f"served height {h.height}, asked for {g.initial_height}")
        if h.validators_hash != g.validators.hash:
            raise VerificationError(
                f"validators hash mismatch at the initial height {h.height}: header has "
                f"{h.validators_hash.hex().upper()}, genesis set hashes to "
                f"{g.validators.hash.hex().upper()}"
            )
        if h.time != g.genesis_time:
            raise VerificationError(f"initial header time {h.time} is not the genesis time")
        if not h.last_block_id.is_zero:
            raise VerificationError("initial header has a previous block id")
        if h.proposer_address not in g.validators.by_address:
            raise VerificationError("initial header's proposer is not a genesis validator")
        verify_commit(g.chain_id, g.validators, h, lb.commit)
        self._trust(lb)

    def _verify(self, trusted: LightBlock, untrusted: LightBlock) -> None:
        kw = {
            "max_clock_drift": self.max_clock_drift,
            "trusting_period": self.trusting_period,
            "now": self.clock(),
        }
        if untrusted.height == trusted.height + 1:
            verify_adjacent(trusted, untrusted, self.chain_id, **kw)
        else:
            verify_non_adjacent(
                trusted, untrusted, self.chain_id, trust_level=self.trust_level, **kw
            )

    def _verify_sequential(self, trusted: LightBlock, target: LightBlock) -> None:
        for h in range(trusted.height + 1, target.height + 1):
            block = target if h == target.height else self._fetch(h)
            verify_adjacent(
                trusted,
                block,
                self.chain_id,
                now=self.clock(),
                max_clock_drift=self.max_clock_drift,
                trusting_period=self.trusting_period,
            )
            self._trust(block)
            trusted = block

    def _verify_skipping(self, trusted: LightBlock, target: LightBlock) -> None:
        cache = [target]  # cache[0] is the target, deeper entries are ever-closer pivots
        depth = 0
        while True:
            block = cache[depth]
            try:
                self._verify(trusted, block)
            except NotEnoughTrust:
                if depth == len(cache) - 1:
                    pivot = trusted.height + (block.height - trusted.height) // 2
                    cache.append(self._fetch(pivot))
                depth += 1
                continue
            self._trust(block)
            if depth == 0:
                return
            trusted = block
            cache = cache[:depth]
            depth = 0

    # trusted store

    def _trust(self, block: LightBlock) -> None:
        self._trusted[block.height] = block
        self.last_trace.append(block.height)
        if len(self._trusted) > self.max_stored:
            keep = self.genesis.initial_height
            for h in sorted(self._trusted):
                if len(self._trusted) <= self.max_stored:
                    break
                if h != keep:
                    del self._trusted[h]
            self._witnessed &= self._trusted.keys()

    def _save_store(self) -> None:
        if not self.store_path:
            return
        body = {
            "version": STORE_VERSION,
            "chain_id": self.chain_id,
            "genesis_hash": self.genesis.doc_hash.hex(),
            "blocks": [self._trusted[h].to_json() for h in sorted(self._trusted)],
        }
        self.store_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.store_path.with_name(self.store_path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(body) + "\n")
        tmp.replace(self.store_path)

    def _load_store(self) -> None:
        assert self.store_path is not None
        try:
            body = json.loads(self.store_path.read_text())
        except (OSError, ValueError) as exc:
            raise VerificationError(f"trusted store {self.store_path} unreadable: {exc}") from exc
        if body.get("version") != STORE_VERSION:
            raise VerificationError("trusted store has an unknown version")
        if (
            body.get("chain_id") != self.chain_id
            or body.get("genesis_hash") != self.genesis.doc_hash.hex()
        ):
            raise VerificationError("trusted store belongs to another genesis")
        for raw in body.get("blocks", []):
            lb = LightBlock.from_json(raw)
            check_signed_header(lb.header, lb.commit, self.chain_id)
            if lb.header.validators_hash != lb.validators.hash:
                raise VerificationError(f"trusted store corrupt at height {lb.height}")
            self._trusted[lb.height] = lb
        if self._trusted and self.genesis.initial_height not in self._trusted:
            raise VerificationError("trusted store lacks the initial height")

    # fetching (nothing fetched is trusted until verified)

    def _latest_height(self) -> int:
        try:
            return self.rpc.latest_height()
        except RpcError as exc:
            raise ProviderError(f"cannot read the latest height: {exc}") from exc

    def _fetch(self, height: int, validators: ValidatorSet | None = None) -> LightBlock:
        try:
            sh = self.rpc.commit(height)
            if validators is None:
                at, raw_vals = self.rpc.validators(height)
                if at != height:
                    raise ProviderError(f"validators served for height {at}, asked for {height}")
                validators = ValidatorSet.from_json(raw_vals)
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
            raise VerificationError(f"malformed validator set {height}: {exc!r:.200}") from exc
        except RpcError as exc:
            raise ProviderError(f"cannot fetch light block {height}: {exc}") from exc
        try:
            header = Header.from_json(sh["header"])
            commit = Commit.from_json(sh["commit"])
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
            raise VerificationError(f"malformed light block {height}: {exc!r:.200}") from exc
        if header.height != height:
            raise VerificationError(f"served header {header.height}, asked for {height}")
        return LightBlock(header, commit, validators)


def _url(rpc: Any) -> str:
    """How an endpoint is named in errors: its URL ("" for a stand-in without one)."""
    url = getattr(rpc, "url", "")
    return url if isinstance(url, str) else ""
