"""A scripted committee and scripted model nodes driving epochs through the real Application."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from harness import AppHarness, node_body
from nacl.public import PrivateKey, SealedBox

from planetserve.chain import layout, vrf
from planetserve.chain.abci.state import State, members
from planetserve.chain.challenge import Challenge, open_plan_entry, sign_response
from planetserve.chain.keys import KeySet
from planetserve.chain.layout import NEXT_PROPOSAL_KEY
from planetserve.registry import reputation
from planetserve.registry.entities import ModelNode
from planetserve.registry.epochs import ChallengeResult, Epoch, Fault, PlanEntry, Schedule, SignedResponse
from planetserve.registry.params import Params

EPOCH_PARAMS = Params(epoch_blocks=10, results_blocks=4, vrf_window_blocks=3, plan_window_blocks=3,
                      probation_epochs=0)
"""Short epochs. Nodes are listed from registration: these tests are about scoring, forwarding and
faults; probation has its own (tests/adversaries/test_whitewashing_node.py)."""
NODE_ADDRESS = "10.0.0.7:7000"
PLAN_PART = 3
TEMPERATURE = 700
"""Every scripted challenge asks for sampling at 0.7 (thousandths, as signed and committed)."""


class Script:
    """Four members, one organisation and its model nodes on an in-process chain."""

    def __init__(self, h: AppHarness, nodes: int = 2, model_id: str = "gt") -> None:
        self.h = h
        self.schedule = Schedule.from_params(h.app.params)
        self.owner = KeySet.generate()
        self.nodes = {k.public: k for k in sorted((KeySet.generate() for _ in range(nodes)),
                                                  key=lambda k: k.public)}
        self.members = {m.public: m for m in h.members}
        txs = [h.tx(self.owner, "register-org", {"org_id": "org1", "name": "Org One"})]
        for node in self.nodes.values():
            txs.append(h.tx(self.owner, "register-model-node",
                            node_body(node, model_id=model_id, address=NODE_ADDRESS)))
        assert all(r.code == 0 for r in h.block(*txs).tx_results)

    # -- reading ---------------------------------------------------------------------------------

    @property
    def state(self) -> State:
        return State(self.h.store.batch())

    def epoch(self, number: int) -> Epoch:
        record = self.state.epoch(number)
        assert record is not None, f"no record of epoch {number}"
        return record

    def leader(self, number: int) -> KeySet:
        return self.members[self.epoch(number).leader]

    def reputation(self, node: bytes) -> int | None:
        """The node's reputation; None while no epoch has scored it (it stands where it registered)."""
        rep = self.state.reputation(node)
        return None if rep is None or rep.epochs == 0 else rep.value

    def planned_nodes(self, number: int) -> list[bytes]:
        """The nodes the plan of epoch `number` challenges, in key order."""
        return [PlanEntry.decode(v).node for _, v in self.h.store.batch().iterate(layout.plan_prefix(number))]

    def results(self, number: int) -> list[ChallengeResult]:
        """The epoch's submitted challenge results, in (node, submitter) order."""
        return layout.decode_records(list(self.h.store.batch().iterate(layout.result_prefix(number))),
                                     ChallengeResult)

    def faults(self, operator: bytes) -> list[str]:
        batch = self.h.store.batch()
        return [f.kind for f in layout.decode_records(list(batch.iterate(layout.fault_prefix(operator))),
                                                      Fault)]

    # -- blocks ----------------------------------------------------------------------------------

    def block(self, *txs: bytes) -> list[tuple[int, str]]:
        return [(r.code, r.log) for r in self.h.block(*txs).tx_results]

    def register_model(self, **body: Any) -> None:
        """A model registered by the committee's vote in one block: one member proposes it, two more
        approve it (more than 2/3 of the four members' power)."""
        proposer, *others = self.members.values()
        proposal_id = self.state.get_int(NEXT_PROPOSAL_KEY) + 1
        vote = {"proposal_id": proposal_id, "approve": True}
        assert self.block(self.tx(proposer, "register-model", body),
                          *(self.tx(m, "vote-member", vote) for m in others[:2])) == [(0, "ok")] * 3
        assert self.state.model(body["model_id"]) is not None

    def run_to(self, height: int) -> None:
        """Empty blocks until the next block is `height`."""
        while self.h.height < height - 1:
            self.h.block()

    def tx(self, signer: KeySet, tx_type: str, body: dict[str, Any]) -> bytes:
        return self.h.tx(signer, tx_type, body)

    def register_node(self, owner: KeySet, org_id: str, key: KeySet | None = None,
                      address: str = NODE_ADDRESS) -> bytes:
        """`key` (default: a fresh one) registered by `owner` in its organisation `org_id` at `address`: the
        Script can sign its answers, and plans it once the chain requires it."""
        key = key or KeySet.generate()
        registration = self.tx(owner, "register-model-node", node_body(key, org_id, address=address))
        assert self.block(registration) == [(0, "ok")]
        self.nodes[key.public] = key
        return key.public

    # -- committee actions ------------------------------------------------------------------------

    def vrf_txs(self, target: int, members: list[KeySet] | None = None) -> list[bytes]:
        seed = self.epoch(target).seed
        return [self.tx(m, "submit-vrf", {"epoch": target, "proof": vrf.prove(bytes(m.vrf), seed)})
                for m in (members if members is not None else list(self.members.values()))]

    def plan(self, target: int, nodes: list[bytes] | None = None) -> tuple[dict, dict[bytes, Challenge]]:
        """A final commit-plan body for `nodes` (default: those of the Script's nodes that the plan must
        cover, as a planning member computes them), and the challenges it commits."""
        if nodes is None:
            required = set(self.state.plan_required(target))
            nodes = [n for n in self.nodes if n in required]
        committee = list(members(self.h.store.batch()).values())
        challenges = {n: Challenge.new(f"Question {i} for epoch {target}: why is the sky blue?", TEMPERATURE)
                      for i, n in enumerate(nodes)}
        entries = [c.plan_entry(n, committee).body() for n, c in challenges.items()]
        return {"epoch": target, "entries": entries, "final": True}, challenges

    def plan_txs(self, target: int) -> tuple[list[bytes], dict[bytes, Challenge]]:
        """The plan of `target` in parts of at most PLAN_PART entries (sealed copies are padded, so a
        plan of many nodes does not fit one transaction); the last part is final."""
        body, challenges = self.plan(target)
        entries = body["entries"]
        parts = [entries[i:i + PLAN_PART] for i in range(0, len(entries), PLAN_PART)] or [[]]
        planner = self.leader(target - 1)
        return [self.tx(planner, "commit-plan", {**body, "entries": part, "final": i == len(parts) - 1})
                for i, part in enumerate(parts)], challenges

    def planned(self, number: int, node: bytes, member: KeySet) -> Challenge:
        """What a member reads from the plan: its sealed copy of the node's prompt."""
        entry: PlanEntry | None = self.state.plan_entry(number, node)
        assert entry is not None
        return open_plan_entry(entry, member.public, member.x25519)

    def answer(self, node: bytes, challenge: Challenge, model_id: str = "gt", time: int | None = None,
               text: str = "Because of Rayleigh scattering.", temperature: int = TEMPERATURE,
               prompt: str | None = None) -> SignedResponse:
        """The node's signed answer to `challenge` (or to `prompt` instead, an altered one), with the
        challenge's seed and nucleus."""
        return sign_response(self.nodes[node], challenge.prompt if prompt is None else prompt, [11, 12, 13], text,
                             model_id, self.h.time if time is None else time, NODE_ADDRESS, temperature,
                             challenge.seed, challenge.top_p)

    def leader_results(self, number: int, credibility: int | dict[bytes, int], nodes: list[bytes] | None = None,
                       ) -> dict[str, Any]:
        """Honest leader results: each planned prompt answered by its node, the leader proposing
        `credibility` (one for every node, or each node's)."""
        leader = self.leader(number)
        entries = []
        for node in nodes if nodes is not None else list(self.nodes):
            challenge = self.planned(number, node, leader)
            entries.append({**challenge.reveal(self.answer(node, challenge)).body(),
                            "credibility": credibility[node] if isinstance(credibility, dict) else credibility})
        return {"epoch": number, "kind": "leader", "results": entries}

    def attest_txs(self, number: int, submitter: bytes, scores: dict[bytes, int],
                   members: list[KeySet] | None = None, deviations: dict[bytes, int] | None = None) -> list[bytes]:
        """Every member's (or `members`') attestation of `submitter`'s results: each node's credibility and
        its count of deviating tokens (none unless given)."""
        entries = [[n, submitter, c, (deviations or {}).get(n, 0)] for n, c in sorted(scores.items())]
        return [self.tx(m, "attest", {"epoch": number, "scores": entries})
                for m in (members if members is not None else list(self.members.values()))]

    def run_election_and_plan(self, number: int) -> dict[bytes, Challenge]:
        """Through epoch number-1's windows: every member submits its VRF proof and the leader of
        number-1 commits the plan of `number`; returns the planned challenges."""
        assert self.h.height < self.schedule.setup_height(number - 1), "too late to elect and plan"
        self.run_to(self.schedule.setup_height(number - 1))
        self.h.block()  # the setup block creates the record of `number`
        plan_txs, challenges = self.plan_txs(number)
        results = self.block(*plan_txs, *self.vrf_txs(number))
        assert all(code == 0 for code, _ in results), results
        self.run_to(self.schedule.start(number))
        return challenges


RULE = reputation.ReputationRule.from_params(EPOCH_PARAMS)
HONEST = 1_000_000


def expected(*credibilities: int, start: int = RULE.initial) -> int:
    """The reputation a node reaches from `start` (default: the initial one) through these credibilities."""
    value, window = start, ()
    for c in credibilities:
        value, window = reputation.update(RULE, value, c, window)
    return value


def listed(s: Script) -> list[bytes]:
    """The nodes on the signed node list, in list order."""
    return [ModelNode.decode(v).pubkey for _, v in s.h.store.batch().iterate(layout.node_list_prefix())]


def honest_epoch(s: Script, number: int, scores: dict[bytes, int], deviations: dict[bytes, int] | None = None
                 ) -> None:
    """Epoch `number` scored by an honest leader and committee: each node of `scores` (its planned
    nodes) gets that credibility, proposed and attested alike, with its deviating tokens; then on to the
    next epoch."""
    leader = s.epoch(number).leader
    assert s.block(s.tx(s.leader(number), "submit-results",
                        s.leader_results(number, scores, list(scores)))) == [(0, "ok")]
    assert all(c == 0 for c, _ in s.block(*s.attest_txs(number, leader, scores, deviations=deviations)))
    finish(s, number)


def finish(s: Script, number: int) -> None:
    """To the end of the epoch, electing and planning the next one on the way."""
    s.run_election_and_plan(number + 1)
    assert s.epoch(number).finalized


def unopenable_plan(s: Script, node: bytes) -> None:
    """Epoch 1 elected and planned, the planner having sealed `node`'s key to every member as garbage (an
    80-byte sealed box of random bytes to a key no member holds): the chain cannot tell."""
    def garbage(entry: dict) -> None:
        entry["sealed"] = [[member, SealedBox(PrivateKey.generate().public_key).encrypt(secrets.token_bytes(32))]
                           for member, _ in entry["sealed"]]

    framed_plan(s, node, garbage)


def unsound_plan(s: Script, node: bytes, challenge: Challenge) -> None:
    """Epoch 1 elected and planned, the planner having sealed `challenge` for `node`, one an honest node
    cannot answer as sent, or whose reveal the ledger would refuse: the chain sees only its commitment."""
    committee = list(members(s.h.store.batch()).values())

    def unsound(entry: dict) -> None:
        entry.update(challenge.plan_entry(node, committee).body())

    framed_plan(s, node, unsound)


def framed_plan(s: Script, node: bytes, alter: Callable[[dict], None]) -> None:
    """Epoch 1 elected and planned, `alter` having changed `node`'s plan entry before it was committed."""
    s.run_to(s.schedule.setup_height(0))
    s.h.block()
    body, _ = s.plan(1)
    for entry in body["entries"]:
        if entry["node"] == node:
            alter(entry)
    assert all(c == 0 for c, _ in s.block(s.tx(s.leader(0), "commit-plan", body), *s.vrf_txs(1)))
    s.run_to(s.schedule.start(1))
