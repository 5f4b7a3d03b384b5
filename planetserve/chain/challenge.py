"""Client side of challenges: committing and sealing prompts for the committee, signing and checking
model nodes' responses. Used by committee members, model nodes and tests alike, so the bytes the
chain checks are made in one place."""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, replace

from nacl.exceptions import CryptoError
from nacl.public import PrivateKey, PublicKey, SealedBox
from nacl.secret import SecretBox

from planetserve.chain.keys import KeySet, verify_signature
from planetserve.chain.messages.epochs import MAX_PROMPT_CHARS, PlanItem, Revealed, Served
from planetserve.registry import codec, epochs, fields
from planetserve.registry.entities import Member
from planetserve.registry.epochs import PlanEntry, SignedResponse
from planetserve.registry.errors import InvalidField

DEFAULT_MAX_TOKENS = 64
MAX_CHALLENGE_TOKENS = 512
"""The most tokens a challenge asks for: a revealed answer, with its prompt, must fit one transaction of
results (`max_tx_bytes`, 16 KiB by default), and a planner sealing more for an honest leader to send had
the node refuse it (413), which the leader then reported."""
MAX_CHALLENGE_PROMPT_TOKENS = 768
"""The most tokens a challenge's prompt may have under its model's tokenizer, below the 896 a model node
accepts by default (`max_prompt_tokens`): a leader sends no longer one, which a node could refuse."""
SALT_BYTES = 32
MAX_EARLIER_TURNS = 32
MAX_CHALLENGE_STOPS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 128
TOKEN_ID_LIMIT = 1 << 31
"""A challenge's stop strings and stop token ids are bounded as a model node's API bounds a request's
(`node/api/openai.py` `ApiLimits`, token ids up to `engine/wire.py` `MAX_TOKEN_ID`), so that a planner
cannot seal one the node must refuse; a test holds the two sets of bounds equal."""
SEALED_VERSION = 2
"""The layout of a sealed challenge (its first field): a member whose daemon reads another layout, say
one that left an upgrade behind, is told so by name instead of failing to unpack the fields. Version 2
encrypts the challenge once and seals its key to each member (version 1 sealed a copy to each)."""
SEALED_BUCKET_BYTES = 1024
"""Encrypted challenges are padded to a multiple of this, so an entry's length on the ledger says only
roughly how long its prompt is (about 200 tokens a step), and nothing of its temperature or cap."""


def padded_size(length: int) -> int:
    """The bucket a plaintext of `length` bytes is padded to."""
    return -(-length // SEALED_BUCKET_BYTES) * SEALED_BUCKET_BYTES


class SealedPromptError(Exception):
    """A plan's sealed prompt cannot be opened by this member or does not match its commitment."""


@dataclass(frozen=True)
class Challenge:
    prompt: str
    """The text the model reads, which the node signs and the plan commits."""
    salt: bytes
    temperature: int
    """Thousandths; the node is asked to sample at temperature / 1000 (0: greedy)."""
    question: str = ""
    """When the challenge is sent as a chat: its one user message, which the model's chat template
    renders as `prompt`. Empty for a completion prompt, sent as `prompt` itself."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    """The output cap a user of the drawn workload would ask for; sealed with the prompt so that every
    member who sends it asks for the same."""
    earlier: tuple[int, ...] = ()
    """For a follow-up: the lengths of the session's earlier turns, each a prefix of the text sent (the
    question, or the prompt), sent first under the same session id and not scored."""
    top_p: int = epochs.MILLI
    """Thousandths; the node is asked to sample from the nucleus of top_p / 1000 (MILLI: all tokens)."""
    stop: tuple[str, ...] = ()
    """The stop strings a user of the drawn workload would ask for. Like the cap, sealed but not
    committed: only the member that sends a challenge checks where its answer ended."""
    stop_token_ids: tuple[int, ...] = ()
    """The stop token ids (vLLM's `stop_token_ids`) such a user would send, sealed like `stop`."""

    @classmethod
    def new(cls, prompt: str, temperature: int, question: str = "", max_tokens: int = DEFAULT_MAX_TOKENS,
            earlier: tuple[int, ...] = (), top_p: int = epochs.MILLI, stop: tuple[str, ...] = (),
            stop_token_ids: tuple[int, ...] = ()) -> Challenge:
        return cls(prompt, secrets.token_bytes(SALT_BYTES), temperature, question, max_tokens, tuple(earlier),
                   top_p, tuple(stop), tuple(stop_token_ids))

    def turns(self) -> list[str]:
        """What is sent, in order and under one session id: the earlier turns, then the challenge."""
        text = self.question or self.prompt
        return [text[:length] for length in self.earlier] + [text]

    @property
    def commitment(self) -> bytes:
        return epochs.commitment(self.prompt, self.temperature, self.salt, self.top_p)

    @property
    def seed(self) -> int:
        """The seed the challenge is sent with (epochs.challenge_seed: the salt's, so committed)."""
        return epochs.challenge_seed(self.salt)

    @property
    def sampling_temperature(self) -> float:
        return self.temperature / epochs.MILLI

    @property
    def sampling_top_p(self) -> float:
        return self.top_p / epochs.MILLI

    def signed_otherwise(self, response: SignedResponse, now: int, tolerance: int) -> str:
        """Why `response` does not answer this challenge as it was sent (another temperature, seed or
        top_p, or a signed time more than `tolerance` seconds from `now`); empty when it does. Revealed,
        such a response would be the submitter's fault on the ledger, so a node could frame its
        challenger."""
        if response.temperature != self.temperature:
            return (f"the node signed temperature {response.temperature / epochs.MILLI:g}, "
                    f"it was asked {self.sampling_temperature:g}")
        if response.seed != self.seed:
            return f"the node signed seed {response.seed}, it was asked {self.seed}"
        if response.top_p != self.top_p:
            return (f"the node signed top_p {response.top_p / epochs.MILLI:g}, "
                    f"it was asked {self.sampling_top_p:g}")
        if abs(response.time - now) > tolerance:
            return f"the node signed time {response.time}, {response.time - now:+d} s from its answer"
        return ""

    def tag(self, node: bytes) -> bytes:
        """What a member commits before re-challenging `node` with this challenge."""
        return epochs.rechallenge_tag(node, self.commitment)

    def plan_entry(self, node: bytes, committee: list[Member]) -> PlanItem:
        """A commit-plan entry: the commitment, the challenge padded to its size bucket and encrypted once
        under a fresh key, and that key sealed to every member's X25519 key (whichever member leads sends
        it). An entry grows by about 115 bytes a member: with a sealed copy of the challenge each (1 KiB
        at least), no entry fit a transaction past thirteen members, and such a committee planned
        nothing."""
        packed = codec.pack([SEALED_VERSION, self.prompt, self.salt, self.temperature, self.question,
                             self.max_tokens, list(self.earlier), self.top_p, list(self.stop),
                             list(self.stop_token_ids)])
        framed = len(packed).to_bytes(4, "big") + packed
        plaintext = framed + bytes(padded_size(len(framed)) - len(framed))
        key = secrets.token_bytes(SecretBox.KEY_SIZE)
        ciphertext = bytes(SecretBox(key).encrypt(plaintext))
        sealed = sorted((m.operator, SealedBox(PublicKey(m.x25519_key)).encrypt(key)) for m in committee)
        return PlanItem(node, self.commitment, tuple(sealed), ciphertext)

    def reveal(self, response: SignedResponse, served: SignedResponse | None = None) -> Revealed:
        """A submit-results entry (without the leader's proposed credibility); `served` is the serving
        peer's own signature when the challenged node forwarded the prompt."""
        return Revealed(response.node, self.prompt, self.salt, self.temperature, response,
                        served=Served.of(served) if served is not None else None, top_p=self.top_p)


def _unseal(box: bytes, keys: tuple[PrivateKey, ...]) -> bytes:
    for key in keys[:-1]:
        try:
            return SealedBox(key).decrypt(box)
        except CryptoError:
            continue
    return SealedBox(keys[-1]).decrypt(box)


def open_plan_entry(entry: PlanEntry, operator: bytes, key: PrivateKey, *older: PrivateKey) -> Challenge:
    """Open this member's key to a planned prompt, decrypt the prompt and check it against the
    commitment. A member that rotated its X25519 key passes the key it had too: the plan of the epoch its
    rotation reached was sealed at the end of the one before."""
    box = next((sealed for member, sealed in entry.sealed if member == operator), None)
    if box is None:
        raise SealedPromptError("the plan entry holds no prompt sealed to this member")
    try:
        plaintext = SecretBox(_unseal(box, (key, *older))).decrypt(entry.ciphertext)
        length = int.from_bytes(plaintext[:4], "big")
        unpacked = codec.unpack(plaintext[4:4 + length])
    except (CryptoError, codec.CodecError, ValueError) as exc:
        raise SealedPromptError(f"sealed prompt does not open: {type(exc).__name__}") from exc
    version = unpacked[0] if isinstance(unpacked, list) and unpacked else None
    if type(version) is not int or version != SEALED_VERSION:
        raise SealedPromptError(f"sealed challenge of layout version {version!r}; this member reads version "
                                f"{SEALED_VERSION} (its daemon and the leader's run different releases)")
    try:
        _, prompt, salt, temperature, question, max_tokens, earlier, top_p, stop, stop_token_ids = unpacked
    except ValueError as exc:
        raise SealedPromptError(f"sealed challenge of version {SEALED_VERSION} has {len(unpacked)} fields, "
                                "not 10") from exc
    if type(temperature) is not int or not 0 <= temperature <= epochs.MAX_CHALLENGE_TEMPERATURE:
        raise SealedPromptError(f"sealed temperature {temperature!r} is not an integer in "
                                f"[0, {epochs.MAX_CHALLENGE_TEMPERATURE}]")
    if type(top_p) is not int or not 0 <= top_p <= epochs.MILLI:
        raise SealedPromptError(f"sealed top_p {top_p!r} is not an integer in [0, {epochs.MILLI}]")
    if type(max_tokens) is not int or not 1 <= max_tokens <= MAX_CHALLENGE_TOKENS:
        raise SealedPromptError(f"sealed max_tokens {max_tokens!r} is not an integer in "
                                f"[1, {MAX_CHALLENGE_TOKENS}]")
    if type(salt) is not bytes or len(salt) != SALT_BYTES:
        raise SealedPromptError(f"sealed salt is not {SALT_BYTES} bytes, so its reveal would be refused")
    if not all(isinstance(text, str) for text in (prompt, question)):
        raise SealedPromptError("sealed prompt or question is not text")
    for name, text in (("prompt", prompt), ("question", question)):
        try:
            if text or name == "prompt":
                fields.free_text({name: text}, name, MAX_PROMPT_CHARS)
        except InvalidField as exc:
            raise SealedPromptError(f"sealed {exc}: the challenge could not be revealed or asked") from None
    if not _turn_lengths(earlier, len(question or prompt)):
        raise SealedPromptError(f"sealed earlier turns {earlier!r} are not increasing prefix lengths of "
                                f"the text (at most {MAX_EARLIER_TURNS})")
    if not _stop_strings(stop):
        raise SealedPromptError(f"sealed stop strings {stop!r} are not at most {MAX_CHALLENGE_STOPS} texts "
                                f"of 1 to {MAX_STOP_CHARS} characters")
    if not _stop_token_ids(stop_token_ids):
        raise SealedPromptError(f"sealed stop token ids {stop_token_ids!r} are not at most "
                                f"{MAX_STOP_TOKEN_IDS} integers in [0, 2**31)")
    challenge = Challenge(prompt, salt, temperature, question, max_tokens, tuple(earlier), top_p, tuple(stop),
                          tuple(stop_token_ids))
    if challenge.commitment != entry.commitment:
        raise SealedPromptError("sealed prompt does not match the plan's commitment")
    return challenge


def _turn_lengths(earlier: object, length: int) -> bool:
    if not isinstance(earlier, list) or len(earlier) > MAX_EARLIER_TURNS:
        return False
    bounds = [0, *earlier, length]
    return all(type(n) is int for n in earlier) and all(a < b for a, b in itertools.pairwise(bounds))


def _stop_strings(stop: object) -> bool:
    return (isinstance(stop, list) and len(stop) <= MAX_CHALLENGE_STOPS
            and all(isinstance(text, str) and 0 < len(text) <= MAX_STOP_CHARS for text in stop))


def _stop_token_ids(ids: object) -> bool:
    return (isinstance(ids, list) and len(ids) <= MAX_STOP_TOKEN_IDS
            and all(type(token) is int and 0 <= token < TOKEN_ID_LIMIT for token in ids))


def sign_response(keys: KeySet, prompt: str, token_ids: list[int], text: str, model_id: str, time: int,
                  address: str, temperature: int, seed: int, top_p: int = epochs.MILLI) -> SignedResponse:
    unsigned = SignedResponse(keys.public, epochs.prompt_hash(prompt), tuple(token_ids), text, model_id,
                              temperature, seed, time, address, b"", top_p)
    return replace(unsigned, signature=keys.sign(unsigned.sign_bytes()))


def response_valid(response: SignedResponse) -> bool:
    return verify_signature(response.node, response.sign_bytes(), response.signature)


class ResponseFormatError(ValueError):
    """A response's `planetserve` extension is missing fields or has fields of the wrong type."""


_EXTENSION_FIELDS = {"node": str, "prompt_hash": str, "token_ids": list, "model_id": str,
                     "temperature": int, "seed": int, "top_p": int, "time": int, "address": str,
                     "signature": str}


def response_extension(response: SignedResponse) -> dict:
    """The signed response as the JSON a model node attaches to its answer (the text travels in the
    answer itself)."""
    return {"node": response.node.hex(), "prompt_hash": response.prompt_hash.hex(),
            "token_ids": list(response.token_ids), "model_id": response.model_id,
            "temperature": response.temperature, "seed": response.seed, "top_p": response.top_p,
            "time": response.time,
            "address": response.address, "signature": response.signature.hex()}


def response_from_extension(extension: object, text: str) -> SignedResponse:
    """Rebuild the signed response from an answer's extension and text; check it with response_valid."""
    if not isinstance(extension, dict):
        raise ResponseFormatError("the answer carries no planetserve extension")
    for name, kind in _EXTENSION_FIELDS.items():
        if not isinstance(extension.get(name), kind) or isinstance(extension.get(name), bool):
            raise ResponseFormatError(f"extension field {name!r} is missing or not a {kind.__name__}")
    ids = extension["token_ids"]
    if not all(type(t) is int and 0 <= t < epochs.SEED_LIMIT for t in ids):
        raise ResponseFormatError("extension token_ids must be integers in [0, 2**64)")
    if not all(0 <= extension[name] < epochs.SEED_LIMIT for name in ("temperature", "time")):
        raise ResponseFormatError("extension temperature and time must lie in [0, 2**64)")  # what packs
    try:
        node, digest, signature = (bytes.fromhex(extension[k]) for k in ("node", "prompt_hash", "signature"))
    except ValueError as exc:
        raise ResponseFormatError(f"extension holds malformed hex: {exc}") from exc
    if not 0 <= extension["seed"] < epochs.SEED_LIMIT:
        raise ResponseFormatError("extension seed must lie in [0, 2**64)")
    if not 0 <= extension["top_p"] <= epochs.MILLI:
        raise ResponseFormatError(f"extension top_p must lie in [0, {epochs.MILLI}] thousandths")
    return SignedResponse(node, digest, tuple(ids), text, extension["model_id"], extension["temperature"],
                          extension["seed"], extension["time"], extension["address"], signature,
                          extension["top_p"])


ANSWERED_BY = "Planetserve-Answered-By"
"""The header a user relay sets on each answer it returns over HTTP: `relay` on an answer it made itself
(it cannot send now, no node serves the model), `node` on a model node's. A node's answer reaches the
client as the node wrote it, so only this tells the relay's words from the node's: a node answering
challenges with the relay's "cannot send now" would otherwise be retried, never reported."""


def served_extension(peer: SignedResponse) -> dict:
    """What an entry node that forwarded adds to its own signed answer: the serving peer's signature
    over the same answer, so the credibility of the answer can be credited to the node that computed it."""
    return {"node": peer.node.hex(), "time": peer.time, "address": peer.address,
            "signature": peer.signature.hex()}


def served_from_extension(served: object, answer: SignedResponse) -> SignedResponse | None:
    """The serving peer's signed response for `answer` (same prompt, ids, text and model) when `served`
    is well formed, as the chain reads it, and its signature verifies; None otherwise (the entry node
    alone answers for it)."""
    if not isinstance(served, dict) or type(served.get("time")) is not int:
        return None
    if not all(isinstance(served.get(k), str) for k in ("node", "address", "signature")):
        return None
    try:
        node, signature = bytes.fromhex(served["node"]), bytes.fromhex(served["signature"])
    except ValueError:
        return None
    peer = replace(answer, node=node, time=served["time"], address=served["address"], signature=signature)
    try:
        Served.from_body(Served.of(peer).body())
    except InvalidField:
        return None
    return peer if peer.node != answer.node and response_valid(peer) else None
