"""Verification epochs: the block schedule and the records the committee's work leaves in state.

Epoch e covers heights [e*L + 1, (e+1)*L] for L = epoch_blocks. Offsets count from 0 at its first
block. In epoch e:

    offsets [0, results_blocks)            the leader of e submits the results of e's plan
    offsets [0, L)                         members attest, report invalid responses, re-challenge
    the last vrf_window_blocks blocks      members submit VRF proofs electing the leader of e+1
    the last plan_window_blocks blocks     the leader of e commits the challenge plan of e+1; in the
                                           last half of them, the backup planner may complete it; once
                                           it is committed, members commit re-challenges of e+1 too
    the last block, after its txs          e is finalized; e+1's leader is fixed

The record of e+1 is created when the first of the two windows opens: its seed is then fixed, from
the app hash the committee signed for the block before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, Self

from planetserve.registry import codec, rules
from planetserve.registry.entities import ModelNode, Record
from planetserve.registry.params import Params

SEED_DOMAIN = "planetserve/epoch-seed/v1"
NEXT_SEED_DOMAIN = "planetserve/epoch-seed/v2"
COMMIT_DOMAIN = "planetserve/challenge/v3"
RESPONSE_DOMAIN = "planetserve/response/v4"
CHALLENGE_SEED_DOMAIN = b"planetserve/challenge-seed/v1"
BACKUP_DOMAIN = b"planetserve/backup-planner/v1"
SEED_BITS = 63
"""Seeds a requester draws: non-negative signed 64-bit integers, which every OpenAI client accepts."""
SEED_LIMIT = 1 << 64
"""The protocol's seeds are unsigned 64-bit integers (planetserve/sampling.py)."""
RECHALLENGE_DOMAIN = "planetserve/rechallenge/v1"
MILLI = 1_000
"""Temperatures are signed and committed in thousandths, so that no float enters state."""
MAX_CHALLENGE_TEMPERATURE = MILLI
"""Above temperature 1 an honest answer looks like a weaker model's (verifier/credibility.py), so a
challenge sent hotter could only frame its node."""

PLAN_NONE, PLAN_PARTIAL, PLAN_COMMITTED = "none", "partial", "committed"
NO_PLAN = "no-plan"
"""The fault of a plan leader whose epoch's plan it left uncommitted: recorded at the epoch's end when
nobody committed it, and when its backup planner did."""
RESULT_KINDS = ("leader", "rechallenge")
ATTEST_BLOCKS = 8
"""Blocks every member has, at least, to attest a result revealed before them: the epoch's last ones,
within which a revealed result need not be attested (`Schedule.attest_before`). Twice the three blocks a
transaction was seen to take to land on two loaded cores: members that all attest late would each be
faulted, and lose their power after `member_fault_limit` such epochs."""
VALID, INVALID, FAULTY = "valid", "invalid", "faulty"
UNOPENED = "the planned challenge does not open for the leader"
"""A leader's claim that names no fault of the node: its copy of the planned challenge did not open
(the planner sealed it garbage or another's key, or in a layout this leader's daemon does not read).
It counts as no report, so a planner cannot have an honest leader report a node; members re-challenge
the node, as for any leader result that is not valid."""


@dataclass(frozen=True)
class Schedule:
    epoch_blocks: int
    results_blocks: int
    vrf_window_blocks: int
    plan_window_blocks: int

    @classmethod
    def from_params(cls, params: Params) -> Schedule:
        return cls(params.epoch_blocks, params.results_blocks, params.vrf_window_blocks,
                   params.plan_window_blocks)

    def epoch_of(self, height: int) -> int:
        return (height - 1) // self.epoch_blocks

    def start(self, epoch: int) -> int:
        return epoch * self.epoch_blocks + 1

    def end(self, epoch: int) -> int:
        return (epoch + 1) * self.epoch_blocks

    def offset(self, height: int) -> int:
        return (height - 1) % self.epoch_blocks

    def in_results(self, height: int) -> bool:
        return self.offset(height) < self.results_blocks

    def in_vrf_window(self, height: int) -> bool:
        return self.offset(height) >= self.epoch_blocks - self.vrf_window_blocks

    def in_plan_window(self, height: int) -> bool:
        return self.offset(height) >= self.epoch_blocks - self.plan_window_blocks

    def in_backup_plan_window(self, height: int) -> bool:
        """The plan window's last half (its last block at least), when the backup planner may commit."""
        return self.offset(height) >= self.epoch_blocks - max(1, self.plan_window_blocks // 2)

    def setup_height(self, epoch: int) -> int:
        """The block of epoch `epoch` at which the record of epoch + 1 is created."""
        return self.end(epoch) - max(self.vrf_window_blocks, self.plan_window_blocks) + 1

    def attest_before(self, epoch: int) -> int:
        """The first block of epoch `epoch` whose revealed results need not be attested: `ATTEST_BLOCKS`
        before its end, and never before the setup height. Every valid result revealed earlier that
        members holding more than 2/3 of the power left unattested is the others' `withheld-attestation`
        (registry/finalization.py), so that members' re-challenges can run into the closing windows, up
        to where the next epoch's take over, with every answer they reveal attested."""
        return max(self.setup_height(epoch), self.end(epoch) - ATTEST_BLOCKS + 1)


def epoch_seed(previous_seed: bytes, drawn: Iterable[tuple[bytes, bytes]], epoch: int) -> bytes:
    """The seed of `epoch`: the seed of the epoch before it and the VRF outputs (by operator) that the
    election of that epoch drew from it. Nothing in it is a value a block proposer picks (an app or
    block hash could be ground by trying transaction sets); a member can only withhold its own output,
    choosing between two seeds at the cost of its chance to lead."""
    return hashlib.sha256(codec.pack([NEXT_SEED_DOMAIN, epoch, previous_seed, sorted(drawn)])).digest()


def genesis_seed(chain_id: str) -> bytes:
    return hashlib.sha256(codec.pack([SEED_DOMAIN, chain_id])).digest()


def backup_planner(seed: bytes, operators: Iterable[bytes], plan_leader: bytes) -> bytes | None:
    """The member that may complete the plan of the epoch of `seed` in the plan window's last half when
    its planner has not: one of the others, at index sha256(domain || seed) mod their number in key
    order, so neither can choose it. None in a committee of one."""
    others = sorted(o for o in operators if o != plan_leader)
    if not others:
        return None
    index = int.from_bytes(hashlib.sha256(BACKUP_DOMAIN + seed).digest(), "big") % len(others)
    return others[index]


def fallback_leader(seed: bytes, operators: list[bytes]) -> bytes:
    """Without a valid VRF proof the leader is the operator (in key order) at index
    sha256(seed) mod n: as unpredictable as the seed, and the same on every validator."""
    ordered = sorted(operators)
    index = int.from_bytes(hashlib.sha256(seed).digest(), "big") % len(ordered)
    return ordered[index]


def sample_nodes(seed: bytes, nodes: list[bytes], cap: int) -> list[bytes]:
    """The nodes a plan must cover: all of them, or, above the cap, the `cap` whose
    sha256(seed || key) is lowest, so the leader cannot choose."""
    return rules.hash_sample(seed, nodes, cap)


def plan_nodes(target: Epoch, nodes: Iterable[ModelNode], cap: int,
               followers: Collection[bytes] = frozenset()) -> list[bytes]:
    """The nodes the plan of `target` must cover: active and registered at or before its cutoff, not a
    later stage of a layer pipeline (`followers`; the pipeline's entry answers for it), sampled above
    the cap. The chain enforces it; the planning member computes the same list."""
    eligible = [n.pubkey for n in nodes if n.status == "active" and n.registered_at <= target.plan_cutoff
                and n.pubkey not in followers]
    return sample_nodes(target.seed, eligible, cap)


def commitment(prompt: str, temperature: int, salt: bytes, top_p: int) -> bytes:
    """What a plan records for a challenge: H(prompt || temperature || salt || top_p), unambiguously
    encoded. The temperature and the nucleus (top_p in thousandths) are committed with the prompt because
    they decide how the answer is scored."""
    return hashlib.sha256(codec.pack([COMMIT_DOMAIN, prompt, temperature, salt, top_p])).digest()


def milli(value: float) -> int:
    """A request's sampling temperature or top_p as signed and committed: thousandths, rounded half up.
    Engines sample at exactly milli(value) / MILLI, so what a node signs is what it sampled with."""
    return int(value * MILLI + 0.5)


def to_seed(value: int) -> int:
    """An OpenAI `seed` (a signed 64-bit integer) as the protocol's unsigned one, two's complement."""
    return value % SEED_LIMIT


def challenge_seed(salt: bytes) -> int:
    """The sampling seed a challenge is sent with: derived from its salt, so the commitment binds it
    (the salt is committed) and nothing about the commitment can be learnt from it; uniform like the
    seed a relay draws for a program that sends none."""
    digest = hashlib.sha256(CHALLENGE_SEED_DOMAIN + salt).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)


def rechallenge_tag(node: bytes, commitment: bytes) -> bytes:
    """What a member commits before it re-challenges `node`: H(node || commitment). It binds the node and
    the challenge without naming either (the commitment's salt hides both), so nothing on the ledger says
    which node is about to be asked again until the answer is revealed."""
    return hashlib.sha256(codec.pack([RECHALLENGE_DOMAIN, node, commitment])).digest()


def prompt_hash(prompt: str) -> bytes:
    return hashlib.sha256(prompt.encode()).digest()


@dataclass(frozen=True)
class Epoch(Record):
    number: int
    start_height: int
    start_time: int
    seed: bytes
    leader: bytes
    leader_output: bytes
    election: str
    plan_leader: bytes
    plan_status: str
    plan_nodes: int
    plan_cutoff: int
    finalized: bool
    scored: int
    faults: int


@dataclass(frozen=True)
class VrfEntry(Record):
    operator: bytes
    proof: bytes
    output: bytes


@dataclass(frozen=True)
class PlanEntry(Record):
    """One challenge of a plan: `ciphertext` is the challenge (`chain/challenge.py` `plan_entry`) encrypted
    under a key of its own, and `sealed` holds [member operator, that key sealed to the member].

    `moved_from`: the key the node was planned under when its key rotation took effect at the epoch's
    first block (`chain/abci/rotations.py`), empty otherwise. Members committed their re-challenge tags
    of the epoch over that key, and sent some of those challenges to it, in the epoch before: such a tag
    still opens, and an answer signed with that key still counts as the node's (`node_keys`), so that a
    rotation never takes a node out of the members' re-challenges."""

    node: bytes
    commitment: bytes
    sealed: tuple[list, ...]
    ciphertext: bytes
    moved_from: bytes = b""

    @property
    def node_keys(self) -> tuple[bytes, ...]:
        """The keys this epoch's challenges of the node may name in their tags and be answered under: its
        key, then the one it was planned under if it rotated at the epoch's start."""
        return (self.node, self.moved_from) if self.moved_from else (self.node,)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Self:
        return super().from_record({"moved_from": b"", **record})


@dataclass(frozen=True)
class SignedResponse(Record):
    """A model node's answer to a prompt, signed with its registered key, with the sampling temperature
    it was asked for (thousandths; 0 is greedy), the seed of its noise and its nucleus (top_p in
    thousandths, MILLI for none; planetserve.sampling), which nobody between the asker and the node can
    change and which make every token checkable."""

    node: bytes
    prompt_hash: bytes
    token_ids: tuple[int, ...]
    text: str
    model_id: str
    temperature: int
    seed: int
    time: int
    address: str
    signature: bytes
    top_p: int = MILLI

    def sign_bytes(self) -> bytes:
        return codec.pack([RESPONSE_DOMAIN, self.node, self.prompt_hash, list(self.token_ids), self.text,
                           self.model_id, self.temperature, self.seed, self.top_p, self.time, self.address])


@dataclass(frozen=True)
class ChallengeResult(Record):
    """A challenge's outcome as submitted by the leader or by a member who re-challenged.
    status: valid (signed and consistent), invalid (no valid response claimed), faulty (the
    submission itself contradicts the plan or the signature; the submitter is recorded faulty).
    served_by: the node that computed the response when the challenged node forwarded it (its own
    signature was checked, and it was listed); the challenged node answers for the response, and the
    serving node is credited with its credibility too. Empty when served directly or when the serving
    node was not listed (then `reason` says so)."""

    node: bytes
    submitter: bytes
    kind: str
    status: str
    reason: str
    prompt: str
    salt: bytes
    response: dict
    credibility: int
    height: int
    served_by: bytes = b""


@dataclass(frozen=True)
class Rechallenge(Record):
    """A member's committed re-challenge: `tag` is rechallenge_tag(node, commitment), opened when the
    member reveals the challenge and the node's answer (or claims it had none)."""

    member: bytes
    tag: bytes
    time: int
    height: int
    """The block that committed it: a tag opens only in a later block."""


@dataclass(frozen=True)
class Fault(Record):
    operator: bytes
    epoch: int
    kind: str
    node: bytes
    detail: str


@dataclass(frozen=True)
class Reputation(Record):
    """A model node's standing, written when it registers: its reputation (ppm) and its window of the
    last W credibilities; `epochs` it was scored in, the last one `last_epoch` (0 while never scored:
    epoch 0 has no plan); `trusted` by the reputation rule; `probation`, the consecutive scored epochs
    it must still end trusted before it is listed (registry/reputation.py); the tokens of its attested
    answers ever `checked`, how many `deviations` were beyond the verifiers' tolerance, and the
    evidence statistic `cusum` over them (registry/evidence.py)."""

    node: bytes
    value: int
    window: tuple[int, ...]
    epochs: int
    last_epoch: int
    trusted: bool
    probation: int
    checked: int = 0
    deviations: int = 0
    cusum: int = 0

    @property
    def listable(self) -> bool:
        """Trusted and past probation: listed while its node is active."""
        return self.trusted and self.probation == 0
