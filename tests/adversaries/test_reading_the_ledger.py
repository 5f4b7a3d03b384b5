"""A model node that reads the ledger to learn when and with what it will be challenged: the plan's
sealed entries and the members' re-challenge commitments are public state. It learns neither which node
a re-challenge is for before the answer is revealed, nor the length, temperature or form of a planned
prompt beyond its size bucket (docs/threat-model.md, "Recognising challenges")."""

from __future__ import annotations

import pytest
from committee import EPOCH_PARAMS, HONEST, TEMPERATURE, Script
from harness import AppHarness, sqlite_url

from planetserve.chain.abci.state import members
from planetserve.chain.challenge import SEALED_BUCKET_BYTES, Challenge, open_plan_entry
from planetserve.chain.errors import Code
from planetserve.chain.messages.epochs import SEALED_KEY_BYTES
from planetserve.registry import epochs
from planetserve.registry.epochs import PlanEntry


@pytest.fixture
def s(tmp_path) -> Script:
    return Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))


def skipped_by_the_leader(s: Script) -> tuple[bytes, bytes, list]:
    """Epoch 1 with node0 left out of the leader's results, so the other members re-challenge it."""
    s.run_election_and_plan(1)
    node0, node1 = list(s.nodes)
    assert s.block(s.tx(s.leader(1), "submit-results", s.leader_results(1, HONEST, [node1]))) == [(0, "ok")]
    leader = s.epoch(1).leader
    return node0, node1, [m for k, m in s.members.items() if k != leader]


def mentions(data: bytes, node: bytes) -> bool:
    return node in data or node.hex().encode() in data


def test_a_re_challenge_names_no_node_until_its_answer_is_revealed(s):
    node0, _, others = skipped_by_the_leader(s)
    own = {m.public: Challenge.new(f"Member {i} asks: how do tides work?", TEMPERATURE) for i, m in enumerate(others)}
    before = s.h.registry_state()
    commits = [s.tx(m, "commit-rechallenge", {"epoch": 1, "tags": [own[m.public].tag(node0)]}) for m in others]
    assert all(c == 0 for c, _ in s.block(*commits))
    written = {k: v for k, v in s.h.registry_state().items() if before.get(k) != v}
    assert written, "the commitments wrote nothing"
    assert not any(mentions(k, node0) or mentions(v, node0) for k, v in written.items())
    events = s.h.responses[-1].tx_results
    assert not any(mentions(a.key.encode() + a.value.encode(), node0)
                   for r in events for e in r.events for a in e.attributes)
    # revealed, the answer names its node, as it must for the result to count
    reveals = [s.tx(m, "submit-results", {"epoch": 1, "kind": "rechallenge", "results": [
        own[m.public].reveal(s.answer(node0, own[m.public]))]}) for m in others]
    assert all(c == 0 for c, _ in s.block(*reveals))
    assert all(s.state.result(1, node0, m.public).status == epochs.VALID for m in others)


def test_a_re_challenge_opens_only_for_its_node_once_and_within_the_plan(s):
    node0, node1, others = skipped_by_the_leader(s)
    member = others[0]
    challenge = Challenge.new("How do tides work?", TEMPERATURE)
    assert s.block(s.tx(member, "commit-rechallenge", {"epoch": 1, "tags": [challenge.tag(node0)]}))[0][0] == 0
    # the tag binds the node: the same challenge revealed as node1's does not open it
    as_node1 = challenge.reveal(s.answer(node1, challenge))
    assert s.block(s.tx(member, "submit-results", {"epoch": 1, "kind": "rechallenge", "results": [as_node1]})) == [
        (Code.UNKNOWN_ENTITY, f"unknown entity: signer committed no re-challenge of node {node1.hex()} with this "
                              "challenge")]
    # a claim of no answer must name the challenge it opens
    unnamed = {"node": node0, "invalid": "no answer"}
    assert s.block(s.tx(member, "submit-results", {"epoch": 1, "kind": "rechallenge", "results": [unnamed]})) == [
        (Code.INVALID_FIELD, "invalid field: field 'commitment': a re-challenge claimed unanswered names its "
                             "challenge's commitment")]
    named = {**unnamed, "commitment": challenge.commitment}
    assert s.block(s.tx(member, "submit-results", {"epoch": 1, "kind": "rechallenge", "results": [named]})) == [
        (0, "ok")]
    assert member.public in s.state.reports(1, node0)
    # no more re-challenges than the plan has nodes (two), and no tag twice
    again = s.tx(member, "commit-rechallenge", {"epoch": 1, "tags": [challenge.tag(node0)]})
    assert s.block(again)[0][0] == Code.ALREADY_EXISTS
    second, third = (Challenge.new(f"Why is the sea salty, {i}?", TEMPERATURE).tag(node1) for i in (2, 3))
    (code, log), done = s.block(s.tx(member, "commit-rechallenge", {"epoch": 1, "tags": [second, third]}),
                                s.tx(member, "commit-rechallenge", {"epoch": 1, "tags": [second]}))
    assert code == Code.UNAUTHORIZED and "more re-challenges than epoch 1 plans nodes (2)" in log
    assert done == (0, "ok")  # the two were refused whole: the first of them still fits
    code, log = s.block(s.tx(member, "commit-rechallenge", {"epoch": 1, "tags": [third]}))[0]
    assert code == Code.UNAUTHORIZED and "more re-challenges than epoch 1 plans nodes (2)" in log
    # a planned prompt cannot come back as a re-challenge: its commitment is the plan's
    other = others[1]
    planned = s.planned(1, node0, other)
    assert s.block(s.tx(other, "commit-rechallenge", {"epoch": 1, "tags": [planned.tag(node0)]}))[0][0] == 0
    replay = planned.reveal(s.answer(node0, planned))
    code, log = s.block(s.tx(other, "submit-results", {"epoch": 1, "kind": "rechallenge", "results": [replay]}))[0]
    assert code == Code.ALREADY_EXISTS and "repeats one of this epoch's" in log


def test_a_planned_entry_shows_only_its_size_bucket(s):
    """Greedy or sampled, chat or completion, short or three times as long: the encrypted challenges have
    one length, and so have the keys sealed to each member, so a node reading its plan entry learns
    nothing of the prompt it is about to get."""
    committee = list(members(s.h.store.batch()).values())
    node = next(iter(s.nodes))
    variants = [Challenge.new("Why?", 0), Challenge.new("Why is the sky blue? " * 3, 700, max_tokens=5),
                Challenge.new("<|im_start|>user\nWhy?<|im_end|>\n", 1_000, "Why?", max_tokens=500)]
    lengths = set()
    for challenge in variants:
        entry = PlanEntry.from_record(challenge.plan_entry(node, committee).body())
        assert {len(sealed) for _, sealed in entry.sealed} == {SEALED_KEY_BYTES}
        lengths.add(len(entry.ciphertext))
        opened = open_plan_entry(entry, s.h.members[0].public, s.h.members[0].x25519)
        assert opened == challenge  # whole, max_tokens included
    assert len(lengths) == 1
    long = Challenge.new("word " * SEALED_BUCKET_BYTES, 0).plan_entry(node, committee)
    assert len(long.ciphertext) not in lengths  # a longer bucket, not an unbounded one
    assert epochs.commitment(variants[0].prompt, 0, variants[0].salt, variants[0].top_p) == variants[0].commitment


def test_a_node_outside_the_committee_opens_no_sealed_copy_of_its_challenge(s):
    """A planned node reads its committed plan entry from the state and tries every copy with the
    X25519 key it has, under its own name and under each member's: none opens, and the committed state
    holds the prompt nowhere in the clear (every member opens its own copy)."""
    from nacl.public import PrivateKey

    from planetserve.chain.challenge import SealedPromptError

    s.run_election_and_plan(1)
    node = next(iter(s.nodes))
    entry = s.state.plan_entry(1, node)
    assert entry is not None and len(entry.sealed) == len(s.members)
    challenge = s.planned(1, node, next(iter(s.members.values())))
    assert all(s.planned(1, node, m) == challenge for m in s.members.values())
    own = PrivateKey.generate()
    for operator in [node, *(member for member, _ in entry.sealed)]:
        with pytest.raises(SealedPromptError, match="holds no prompt sealed to this member|does not open"):
            open_plan_entry(entry, operator, own)
    state = s.h.registry_state()
    assert not any(challenge.prompt.encode() in k or challenge.prompt.encode() in v for k, v in state.items())


def test_the_next_epochs_re_challenges_are_committed_once_its_plan_is_and_revealed_once_it_starts(s):
    """Members re-challenge the next epoch's nodes through this epoch's closing windows: its tags are
    taken once its plan is committed (not before, and never a later epoch's), counted against its plan,
    and opened once it starts, by an answer the node signed before it did."""
    s.run_election_and_plan(1)
    node0, node1 = list(s.nodes)
    member = next(m for m in s.members.values())
    challenge = Challenge.new("How do tides work?", TEMPERATURE)
    s.run_to(s.schedule.setup_height(1))
    early, later = s.block(s.tx(member, "commit-rechallenge", {"epoch": 2, "tags": [challenge.tag(node0)]}),
                           s.tx(member, "commit-rechallenge", {"epoch": 3, "tags": [challenge.tag(node0)]}))
    assert early == (Code.UNKNOWN_ENTITY, "unknown entity: epoch 2 has no committed plan")
    assert later == (Code.EXPIRED, "expired: re-challenges are committed for epoch 1, or for epoch 2 once its "
                                   "plan is committed; not for epoch 3")
    plan_txs, _ = s.plan_txs(2)
    assert all(code == 0 for code, _ in s.block(*plan_txs, *s.vrf_txs(2)))
    assert s.h.height < s.schedule.end(1)  # still epoch 1, its closing windows
    extra = [Challenge.new(f"Why is the sea salty, {i}?", TEMPERATURE).tag(node1) for i in (2, 3)]
    too_many, taken = s.block(
        s.tx(member, "commit-rechallenge", {"epoch": 2, "tags": [challenge.tag(node0), *extra]}),
        s.tx(member, "commit-rechallenge", {"epoch": 2, "tags": [challenge.tag(node0)]}))
    assert too_many[0] == Code.UNAUTHORIZED and "more re-challenges than epoch 2 plans nodes (2)" in too_many[1]
    assert taken == (0, "ok")
    answer = s.answer(node0, challenge)  # signed now, in epoch 1
    assert s.h.height == s.schedule.end(1)
    assert s.block(s.tx(member, "submit-results", {"epoch": 2, "kind": "rechallenge",
                                                   "results": [challenge.reveal(answer)]})) == [(0, "ok")]
    assert s.state.result(2, node0, member.public).status == epochs.VALID
    assert answer.time < s.epoch(2).start_time
