"""Messages of the epoch family: VRF proofs, challenge plans, results, attestations, invalid-response
reports and re-challenges (docs/architecture.md, "Verification epochs")."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Self

from planetserve.chain.messages.base import Body, Message, as_map
from planetserve.registry import epochs, fields
from planetserve.registry.epochs import SignedResponse
from planetserve.registry.errors import InvalidField
from planetserve.registry.reputation import PPM

MAX_EPOCH = 2**62
MAX_SEALED_BYTES = 8_192
"""The most an encrypted challenge may take, its nonce and tag aside."""
SEALED_KEY_BYTES = 32 + 48
"""A challenge's key sealed to one member: 32 bytes, an ephemeral key and a tag."""
BOX_OVERHEAD = 24 + 16
"""An encrypted challenge's nonce and tag."""
MAX_PROMPT_CHARS = 4_096
MAX_TEMPERATURE = 2 * epochs.MILLI
MAX_SEED = (1 << 64) - 1
"""The hottest request a node may sign (the API's limit); challenges are held to 1.0."""
MAX_RESPONSE_TOKENS = 4_096
MAX_RESPONSE_CHARS = 32_768
MAX_ENTRIES = 1_000


def _epoch(body: dict[str, Any]) -> int:
    return fields.integer(body, "epoch", 0, MAX_EPOCH)


def _entries(body: dict[str, Any], name: str) -> list[Any]:
    value = body.get(name)
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_ENTRIES:
        raise InvalidField(name, f"must be a list of 1..{MAX_ENTRIES} entries")
    return value


@dataclass(frozen=True)
class SubmitVrf(Message):
    """A member's VRF proof over the next epoch's seed; the lowest output leads that epoch."""

    TYPE: ClassVar[str] = "submit-vrf"
    epoch: int
    proof: bytes

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        epoch = _epoch(body)
        if not isinstance(proof := body.get("proof"), bytes):
            raise InvalidField("proof", "must be bytes")
        return cls(epoch, proof)


def _sealed(value: Any) -> tuple[tuple[bytes, bytes], ...]:
    if not isinstance(value, list) or len(value) > MAX_ENTRIES:
        raise InvalidField("sealed", "must hold one sealed key per committee member")
    boxes = []
    for item in value:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], bytes)
                or not isinstance(item[1], bytes) or len(item[1]) != SEALED_KEY_BYTES):
            raise InvalidField("sealed", f"entries must be [member, sealed key of {SEALED_KEY_BYTES} B]")
        boxes.append((item[0], item[1]))
    return tuple(boxes)


def _ciphertext(value: Any) -> bytes:
    if not isinstance(value, bytes) or not BOX_OVERHEAD < len(value) <= BOX_OVERHEAD + MAX_SEALED_BYTES:
        raise InvalidField("ciphertext", f"must be an encrypted challenge of {BOX_OVERHEAD + 1}.."
                                         f"{BOX_OVERHEAD + MAX_SEALED_BYTES} B")
    return value


@dataclass(frozen=True)
class PlanItem(Body):
    """One planned challenge: its commitment, the challenge encrypted once, and its key sealed to each
    member, by operator key."""

    node: bytes
    commitment: bytes
    sealed: tuple[tuple[bytes, bytes], ...]
    ciphertext: bytes

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        return cls(fields.key32(body, "node"), fields.key32(body, "commitment"), _sealed(body.get("sealed")),
                   _ciphertext(body.get("ciphertext")))


@dataclass(frozen=True)
class CommitPlan(Message):
    """A part of the next epoch's plan, committed by this epoch's leader; `final` closes the plan."""

    TYPE: ClassVar[str] = "commit-plan"
    epoch: int
    entries: tuple[PlanItem, ...]
    final: bool

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        epoch = _epoch(body)
        final = fields.flag(body, "final")
        raw = body.get("entries")
        if not isinstance(raw, list) or len(raw) > MAX_ENTRIES or not (raw or final):
            raise InvalidField("entries", f"must be a list of at most {MAX_ENTRIES} entries")
        return cls(epoch, tuple(PlanItem.from_body(as_map(item, "entries")) for item in raw), final)


def parse_response(value: Any) -> SignedResponse:
    raw = as_map(value, "response")
    fields.check_keys(raw, {"node", "prompt_hash", "token_ids", "text", "model_id", "temperature", "seed",
                            "top_p", "time", "address", "signature"})
    tokens = raw.get("token_ids")
    if (not isinstance(tokens, list) or len(tokens) > MAX_RESPONSE_TOKENS
            or not all(type(t) is int and 0 <= t < 2**32 for t in tokens)):
        raise InvalidField("token_ids", f"must be a list of at most {MAX_RESPONSE_TOKENS} token ids")
    text = raw.get("text")
    if not isinstance(text, str) or len(text) > MAX_RESPONSE_CHARS:
        raise InvalidField("text", f"must be text of at most {MAX_RESPONSE_CHARS} characters")
    return SignedResponse(
        node=fields.key32(raw, "node"),
        prompt_hash=fields.key32(raw, "prompt_hash"),
        token_ids=tuple(tokens),
        text=text,
        model_id=fields.ident(raw, "model_id"),
        temperature=fields.integer(raw, "temperature", 0, MAX_TEMPERATURE),
        seed=fields.integer(raw, "seed", 0, MAX_SEED),
        time=fields.integer(raw, "time", 0, MAX_EPOCH),
        address=fields.address(raw),
        signature=fields.sig64(raw, "signature"),
        top_p=fields.integer(raw, "top_p", 0, epochs.MILLI),
    )


@dataclass(frozen=True)
class Served(Body):
    """The serving peer's own signature over the response, when the challenged node forwarded it."""

    node: bytes
    time: int
    address: str
    signature: bytes

    @classmethod
    def of(cls, peer: SignedResponse) -> Self:
        return cls(peer.node, peer.time, peer.address, peer.signature)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        return cls(fields.key32(body, "node"), fields.integer(body, "time", 0, MAX_EPOCH),
                   fields.address(body), fields.sig64(body, "signature"))

    def response(self, answer: SignedResponse) -> SignedResponse:
        """The response as the serving peer signed it."""
        return replace(answer, node=self.node, time=self.time, address=self.address, signature=self.signature)


@dataclass(frozen=True)
class Revealed(Body):
    """A challenge revealed with the node's signed response; the leader adds its proposed credibility."""

    node: bytes
    prompt: str
    salt: bytes
    temperature: int
    response: SignedResponse
    credibility: int | None = None
    served: Served | None = None
    top_p: int = epochs.MILLI

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        answer = cls(
            node=fields.key32(body, "node"),
            prompt=fields.free_text(body, "prompt", MAX_PROMPT_CHARS),
            salt=fields.key32(body, "salt"),
            temperature=fields.integer(body, "temperature", 0, MAX_TEMPERATURE),
            response=parse_response(body.get("response")),
            credibility=fields.integer(body, "credibility", 0, PPM) if "credibility" in body else None,
            served=Served.from_body(as_map(body["served"], "served")) if "served" in body else None,
            top_p=fields.integer(body, "top_p", 0, epochs.MILLI),
        )
        if answer.served is not None and answer.served.node == answer.response.node:
            raise InvalidField("served", "names the challenged node itself; omit it for a direct answer")
        return answer


@dataclass(frozen=True)
class Unanswered(Body):
    """A claim that the node gave no valid response, and why; a re-challenger names the commitment of
    the challenge it sent, which opens its committed tag."""

    node: bytes
    invalid: str
    commitment: bytes | None = None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        return cls(fields.key32(body, "node"), fields.text(body, "invalid", 256),
                   fields.key32(body, "commitment") if "commitment" in body else None)


def _result(raw: Any, kind: str) -> Revealed | Unanswered:
    entry = as_map(raw, "results")
    fields.key32(entry, "node")
    if "invalid" in entry:
        return Unanswered.from_body(entry)
    required, optional = Revealed.keys()
    fields.check_keys(entry, required, optional if kind == "leader" else frozenset({"served"}))
    if kind == "leader" and "credibility" not in entry:
        raise InvalidField("credibility", "the leader proposes a credibility per node")
    return Revealed.parse(entry)


@dataclass(frozen=True)
class SubmitResults(Message):
    """The leader's results for the epoch's plan, or a member's results of its own re-challenges."""

    TYPE: ClassVar[str] = "submit-results"
    epoch: int
    kind: str
    results: tuple[Revealed | Unanswered, ...]

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        epoch = _epoch(body)
        kind = fields.choice(body, "kind", epochs.RESULT_KINDS)
        return cls(epoch, kind, tuple(_result(raw, kind) for raw in _entries(body, "results")))


@dataclass(frozen=True)
class Attest(Message):
    """A member's own score of submitted results: (node, submitter, credibility ppm, deviating tokens)
    each; the deviations may be left out of an entry (0: a member scoring by the paper's 1/PPL counts
    none)."""

    TYPE: ClassVar[str] = "attest"
    epoch: int
    scores: tuple[tuple[bytes, bytes, int, int], ...]

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        epoch = _epoch(body)
        scores = []
        for raw in _entries(body, "scores"):
            if not isinstance(raw, list) or len(raw) not in (3, 4):
                raise InvalidField("scores", "entries must be [node, submitter, credibility, deviations]")
            item = {"node": raw[0], "submitter": raw[1], "credibility": raw[2],
                    "deviations": raw[3] if len(raw) == 4 else 0}
            scores.append((fields.key32(item, "node"), fields.key32(item, "submitter"),
                           fields.integer(item, "credibility", 0, PPM),
                           fields.integer(item, "deviations", 0, MAX_RESPONSE_TOKENS)))
        return cls(epoch, tuple(scores))


@dataclass(frozen=True)
class ReportInvalid(Message):
    """A member's report that a planned node gave no valid response."""

    TYPE: ClassVar[str] = "report-invalid"
    epoch: int
    node: bytes
    reason: str

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        return cls(_epoch(body), fields.key32(body, "node"), fields.text(body, "reason", 256))


@dataclass(frozen=True)
class CommitRechallenge(Message):
    """A member commits its own challenges of planned nodes before sending them: for each, the tag
    `epochs.rechallenge_tag(node, commitment)`, which does not name the node. Members commit one for
    every planned node together, early in the epoch, and send only some of them later, so that neither
    when a member commits nor how many tags it commits tells a node that it is about to be asked."""

    TYPE: ClassVar[str] = "commit-rechallenge"
    epoch: int
    tags: tuple[bytes, ...]

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        epoch = _epoch(body)
        tags = tuple(_entries(body, "tags"))
        if not all(isinstance(tag, bytes) and len(tag) == 32 for tag in tags):
            raise InvalidField("tags", "must be tags of 32 bytes")
        if len(set(tags)) != len(tags):
            raise InvalidField("tags", "must not repeat a tag")
        return cls(epoch, tags)
