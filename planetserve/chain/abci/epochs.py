"""The epoch timeline as block hooks: epochs open, next epochs get their seed, members' missed
commits are counted, epochs finalize, and members with too many faults lose their power.

Called by the application inside FinalizeBlock: `begin_block` and `record_commit` before the block's
transactions, `end_block` after them. All read and write only the block's batch, in key order.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace

from planetserve.chain import layout
from planetserve.chain.abci.state import State, members
from planetserve.chain.abci.store import Batch
from planetserve.registry import codec, credits, epochs, evidence, finalization, reputation
from planetserve.registry.entities import Member, ModelNode
from planetserve.registry.epochs import (
    NO_PLAN,
    PLAN_COMMITTED,
    PLAN_NONE,
    ChallengeResult,
    Epoch,
    Fault,
    Schedule,
    VrfEntry,
)
from planetserve.registry.params import PPM, Params


def genesis(st: State, chain_id: str, committee: list[Member]) -> None:
    """Epoch 0 has no plan; its leader, chosen by the fallback rule, commits the plan of epoch 1."""
    seed = epochs.genesis_seed(chain_id)
    leader = epochs.fallback_leader(seed, [m.operator for m in committee])
    st.put_epoch(Epoch(0, 1, 0, seed, leader, b"", "genesis", b"", PLAN_NONE, 0, 0, False, 0, 0))


def begin_block(batch: Batch, params: Params, height: int, time: int) -> None:
    schedule = Schedule.from_params(params)
    st = State(batch)
    number = schedule.epoch_of(height)
    if height == schedule.start(number):
        current = st.epoch(number)
        if current is not None:
            st.put_epoch(replace(current, start_time=time))
    if height == schedule.setup_height(number):
        current = st.epoch(number)
        drawn = [(e.operator, e.output) for e in layout.decode_records(
            list(batch.iterate(layout.vrf_prefix(number))), VrfEntry)]
        seed = epochs.epoch_seed(current.seed if current else b"", drawn, number + 1)
        target = Epoch(
            number=number + 1, start_height=schedule.start(number + 1), start_time=0,
            seed=seed, leader=b"", leader_output=b"",
            election="pending", plan_leader=current.leader if current else b"", plan_status=PLAN_NONE,
            plan_nodes=0, plan_cutoff=time, finalized=False, scored=0, faults=0,
        )
        st.put_epoch(target)
        _require_planned(st, params, target)


def _require_planned(st: State, params: Params, target: Epoch) -> None:
    """Fix the nodes the plan of `target` must cover as they stand at its setup block (active, registered,
    not a later pipeline stage): read at each part of the plan, an organisation that switched a node
    between active and inactive every block had every plan, built from state a block old, refused."""
    followers = {node for later in credits.pipelines(st.iterate_deployments()).values() for node in later}
    st.require_planned(target.number, epochs.plan_nodes(target, st.iterate_nodes(), params.max_plan_nodes,
                                                        followers))


def validator_address(consensus_key: bytes) -> bytes:
    """CometBFT's address of an ed25519 validator key: the first 20 bytes of its SHA-256."""
    return hashlib.sha256(consensus_key).digest()[:20]


def record_commit(batch: Batch, params: Params, height: int, absent: Iterable[bytes]) -> None:
    """Count, for the epoch of `height`, each member whose validator (by address) the block's commit
    information reports absent from the previous block's commit: under its consensus key, or under one it
    rotated away that the reported commits still carry (`rotations.UPDATE_DELAY_BLOCKS`)."""
    st = State(batch)
    retired = st.retired_consensus()
    for consensus_key, _, until in retired:
        if height > until:
            st.delete_retired_consensus(consensus_key)
    missing = set(absent)
    if not missing:
        return
    committee = members(batch)
    operators = {validator_address(m.consensus_key): operator for operator, m in committee.items()}
    operators.update((validator_address(key), operator) for key, operator, until in retired
                     if height <= until and operator in committee)
    number = Schedule.from_params(params).epoch_of(height)
    for address in sorted(missing):
        if address in operators:
            st.add_missed(number, operators[address])


@dataclass(frozen=True)
class Removal:
    """A member the chain took the power of, for its faults."""

    operator: bytes
    consensus_key: bytes
    faults: int
    reason: str = "faults"


def end_block(batch: Batch, params: Params, height: int, time: int) -> list[Removal]:
    schedule = Schedule.from_params(params)
    number = schedule.epoch_of(height)
    if height != schedule.end(number):
        return []
    st = State(batch)
    committee = members(batch)
    current = st.epoch(number)
    absent = _absent(st, params, number, committee)
    if current is not None:
        _finalize(batch, st, params, current, committee, absent, time)
    _missed_blocks(st, params, number, absent)
    removed = _remove_faulty(st, params, number, committee)
    for removal in removed:
        del committee[removal.operator]
    lapsed = _remove_lapsed(st, committee, time)
    for removal in lapsed:
        del committee[removal.operator]
    removed += lapsed
    upcoming = st.epoch(number + 1)
    if upcoming is None:
        return removed
    if upcoming.leader not in committee:
        upcoming = replace(upcoming, election="fallback",
                           leader=epochs.fallback_leader(upcoming.seed, sorted(committee)))
    st.put_epoch(upcoming)
    if upcoming.plan_status != PLAN_COMMITTED and upcoming.plan_leader in committee:
        st.add_fault(Fault(upcoming.plan_leader, number, NO_PLAN, b"",
                           f"did not commit the plan of epoch {number + 1}"))
    return removed


def _missed_blocks(st: State, params: Params, number: int, absent: frozenset[bytes]) -> None:
    """A `missed-blocks` fault for each member whose validator missed more than the allowed share of
    the epoch's commits (`_absent`)."""
    for operator in sorted(absent):
        missed = st.missed(number, operator)
        st.add_fault(Fault(operator, number, "missed-blocks", b"",
                           f"missed {missed} of the epoch's {params.epoch_blocks} commits"))


def _absent(st: State, params: Params, number: int, committee: dict[bytes, Member]) -> frozenset[bytes]:
    """The members whose validators missed more than the allowed share of epoch `number`'s commits."""
    return frozenset(operator for operator in committee
                     if st.missed(number, operator) * PPM > params.missed_blocks_ppm * params.epoch_blocks)


def _remove_faulty(st: State, params: Params, number: int, committee: dict[bytes, Member]) -> list[Removal]:
    """Take the power of each member (in key order) with member_fault_limit faults or more in its last
    member_fault_window epochs, as an approved removal would; the last member always stays."""
    window = range(max(0, number - params.member_fault_window + 1), number + 1)
    remaining = len(committee)
    removed = []
    for operator in sorted(committee):
        faults = st.faults_in(operator, window)
        if faults >= params.member_fault_limit and remaining > 1:
            st.delete_member(operator)
            removed.append(Removal(operator, committee[operator].consensus_key, faults))
            remaining -= 1
    return removed


def _remove_lapsed(st: State, committee: dict[bytes, Member], time: int) -> list[Removal]:
    """Take the power of each member (in key order) whose credential lapsed at or before `time`; the
    last member always stays."""
    remaining = len(committee)
    removed = []
    for operator in sorted(committee):
        member = committee[operator]
        if 0 < member.expires_at <= time and remaining > 1:
            st.delete_member(operator)
            removed.append(Removal(operator, member.consensus_key, 0, "credential lapsed"))
            remaining -= 1
    return removed


def _evidence(batch: Batch, epoch: Epoch, committee: dict[bytes, Member], absent: frozenset[bytes],
              params: Params) -> finalization.Evidence:
    n = epoch.number
    plan = [layout.last_key_bytes(k) for k, _ in batch.iterate(layout.plan_prefix(n))]
    results: dict[bytes, list[ChallengeResult]] = defaultdict(list)
    for _, value in batch.iterate(layout.result_prefix(n)):
        result = ChallengeResult.decode(value)
        results[result.node].append(result)
    attestations = {}
    for k, value in batch.iterate(layout.attestation_prefix(n)):
        node_hex, submitter_hex = k.decode().rsplit("/", 2)[1:]
        attestations[(bytes.fromhex(node_hex), bytes.fromhex(submitter_hex))] = [
            (m, c, d) for m, c, d in codec.unpack_stored(value)]
    reports = {layout.last_key_bytes(k): tuple(codec.unpack_stored(v))
               for k, v in batch.iterate(layout.report_prefix(n))}
    return finalization.Evidence(
        leader=epoch.leader, plan_nodes=plan, results=dict(results), attestations=attestations,
        reports=reports, power={m.operator: m.power for m in committee.values()},
        tolerance=params.credibility_tolerance_ppm,
        attest_before=Schedule.from_params(params).attest_before(n),
        absent=absent,
    )


def _listed_throughout(st: State, node: ModelNode, since: int) -> bool:
    """Whether the node is on the list now and has been since `since` (the epoch's start) or before. A
    node off the list for any part of the epoch earns nothing for it: one its organisation set inactive
    once the plan had fixed its challenge served no users and took no deployment, yet was paid for the
    whole epoch, whether it left during the epoch or just before it and came back in its last block;
    nor does a node that came onto the list at this epoch's end (its probation passed) earn for it."""
    joined = st.listed_since(node.pubkey)
    return st.listed(node) and joined is not None and joined <= since


def _scored(rule: reputation.ReputationRule, evidence_rule: evidence.EvidenceRule,
            previous: epochs.Reputation, verdict: finalization.Verdict, number: int) -> epochs.Reputation:
    """A node's reputation record after epoch `number` gave it `verdict`: its evidence first, then C(T),
    which is 0 while the evidence flags it."""
    cusum = evidence.accumulate(evidence_rule, previous.cusum, verdict.checked, verdict.deviations)
    credibility = 0 if evidence.flagged(evidence_rule, cusum) else verdict.credibility
    value, window = reputation.update(rule, previous.value, credibility, previous.window)
    trusted = reputation.is_trusted(rule, value)
    return epochs.Reputation(previous.node, value, window, previous.epochs + 1, number, trusted,
                             reputation.probation_left(rule, previous.probation, trusted),
                             previous.checked + verdict.checked, previous.deviations + verdict.deviations,
                             cusum)


def _finalize(batch: Batch, st: State, params: Params, epoch: Epoch, committee: dict[bytes, Member],
              absent: frozenset[bytes], time: int) -> None:
    """Apply the epoch's verdicts to reputations, credit the organisations of verified, listed
    nodes for their serving time in the epoch, and record the epoch's faults. A node on probation
    earns nothing: it is not listed, so it served no users."""
    verdicts: list[finalization.Verdict] = []
    findings: list[finalization.Finding] = []
    if epoch.plan_status == PLAN_COMMITTED:
        verdicts, findings = finalization.decide(_evidence(batch, epoch, committee, absent, params))
        verdicts = finalization.to_pipelines(verdicts, credits.pipelines(st.iterate_deployments()))
    rule = reputation.ReputationRule.from_params(params)
    evidence_rule = evidence.EvidenceRule.from_params(params)
    batch.prefetch([k for v in verdicts for k in (layout.node_key(v.node), layout.reputation_key(v.node))])
    earnings: dict[str, int] = defaultdict(int)
    rescored: set[str] = set()
    for verdict in verdicts:
        raw = batch.get(layout.node_key(verdict.node))
        previous = st.reputation(verdict.node)
        if raw is None or previous is None:
            continue
        record = _scored(rule, evidence_rule, previous, verdict, epoch.number)
        st.put_reputation(record)
        node = ModelNode.decode(raw)
        rescored.add(node.org_id)
        if record.listable != previous.listable:
            st.put_node(node, at=time, listable=record.listable)
        if record.listable and verdict.scored and record.window[-1] >= rule.abnormal and _listed_throughout(
                st, node, epoch.start_time):
            serving = time - max(epoch.start_time, node.registered_at)
            earnings[node.org_id] += credits.earned(st.price(node.hardware), serving)
    for org_id in sorted(rescored):
        st.put_org_reputation(org_id, reputation.organisation_reputation(st.org_reputations(org_id)))
    for org_id in sorted(earnings):
        if earnings[org_id]:
            account = st.credits(org_id)
            st.put_credits(replace(account, balance=account.balance + earnings[org_id],
                                   earned=account.earned + earnings[org_id]))
    st.put_epoch(replace(epoch, finalized=True, scored=len(verdicts)))
    for finding in findings:
        st.add_fault(Fault(finding.operator, epoch.number, finding.kind, finding.node, finding.detail))
