"""A model node whose organisation rotates its key every epoch to escape the members' re-challenges: a
rotation takes effect at the next epoch's first block and moves the node's plan entry to its new key,
while every member's re-challenge tags of that epoch were committed in the closing windows before, over
the old key (one per planned node, which is also how many the chain takes), and some of the challenges
were sent to the old key then. Each reveal, claim or fresh tag was refused, so only the leader's
challenge reached the node, and a leader's lone "no answer" claim is under a third of the power: a
node silent to everyone else stayed uncut for one rotate-node-key an epoch. The plan entry now keeps the
key the node was planned under (`PlanEntry.moved_from`): a member's tag over it opens under the new key,
and an answer signed with it before the rotation counts as the node's.

Harness: four members and two nodes of one organisation on the in-process chain; the members act as
their daemons do (tags for every planned node once the plan is committed, some challenges sent before
the epoch, the others after the rotation)."""

from __future__ import annotations

import pytest
from committee import EPOCH_PARAMS, HONEST, TEMPERATURE, Script, expected
from harness import CHAIN_ID, AppHarness, events, sqlite_url

from planetserve.chain.challenge import Challenge
from planetserve.chain.keys import KeySet
from planetserve.chain.messages.epochs import Unanswered
from planetserve.chain.messages.registry import RotateNodeKey
from planetserve.registry.epochs import INVALID, VALID, SignedResponse

EPOCHS = 3


@pytest.fixture
def s(tmp_path) -> Script:
    return Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))


def _rotate(s: Script, node: bytes) -> KeySet:
    """The organisation rotates `node` to a fresh key, from the next epoch's first block on."""
    new = KeySet.generate()
    body = RotateNodeKey.signed(CHAIN_ID, "org1", s.nodes[node], new).body()
    assert s.block(s.tx(s.owner, "rotate-node-key", body)) == [(0, "ok")]
    return new


def _plan_and_tag(s: Script, number: int, nodes: list[bytes]
                  ) -> tuple[KeySet, dict[tuple[bytes, bytes], Challenge], dict[tuple[bytes, bytes], SignedResponse]]:
    """Epoch `number-1`'s closing windows: the plan of `number` and the proofs electing its leader; each
    other member tags both planned nodes, as its daemon does once the plan is committed, and the first two
    ask both nodes already (their answers are revealed once `number` starts). Returns the leader, every
    member's challenges and the early answers."""
    s.run_to(s.schedule.setup_height(number - 1))
    s.h.block()
    plan_txs, _ = s.plan_txs(number)
    assert all(c == 0 for c, _ in s.block(*plan_txs, *s.vrf_txs(number)))
    assert s.planned_nodes(number) == sorted(nodes)  # planned under the keys they have now
    leader = s.leader(number)
    others = [m for m in s.members.values() if m.public != leader.public]
    own = {(m.public, n): Challenge.new(f"Member {i} asks node {j} in epoch {number}: why do tides turn?",
                                        TEMPERATURE)
           for i, m in enumerate(others) for j, n in enumerate(nodes)}
    assert s.block(*(s.tx(m, "commit-rechallenge", {"epoch": number, "tags": [own[m.public, n].tag(n) for n in nodes]})
                     for m in others)) == [(0, "ok")] * len(others)
    early = {(m.public, n): s.answer(n, own[m.public, n]) for m in others[:2] for n in nodes}
    return leader, own, early


def _play(s: Script, silent: bool) -> list[tuple[bytes, int | None]]:
    """EPOCHS epochs in which `rotating` (the Script's first node) moves to a new key at each epoch's start:
    the leader's challenge is answered under the new key; the members reveal what their challenges brought
    back (under the old key before the rotation, the new one after it) under the key the chain plans, or,
    where the node was `silent` to them, claim no answer; everyone attests. Returns the node's key and
    reputation after each epoch."""
    rotating, control = list(s.nodes)
    new = _rotate(s, rotating)
    leader, own, early = _plan_and_tag(s, 1, [rotating, control])
    history = []
    for number in range(1, EPOCHS + 1):
        s.run_to(s.schedule.start(number))
        rotated = s.h.block()
        assert events(rotated, "node_key_rotated") == [
            {"node": rotating.hex(), "new": new.public.hex(), "org_id": "org1"}]
        assert s.state.plan_entry(number, new.public).moved_from == rotating
        s.nodes[new.public] = new
        retired = s.nodes.pop(rotating)
        others = [m for m in s.members.values() if m.public != leader.public]
        # the leader's challenge reaches the node under its new key
        assert s.block(s.tx(leader, "submit-results", s.leader_results(
            number, HONEST, sorted([new.public, control])))) == [(0, "ok")]
        # the next epoch's key is prepared at once
        following = _rotate(s, new.public)
        # every member's re-challenge reaches it too, under the key the chain plans now
        reveals = []
        for m in others:
            entries = []
            for n, planned in ((rotating, new.public), (control, control)):
                challenge = own[m.public, n]
                if silent and n == rotating:
                    entries.append(Unanswered(planned, "no answer", challenge.commitment).body())
                    continue
                response = early.get((m.public, n)) or s.answer(planned, challenge)
                entries.append({**challenge.reveal(response).body(), "node": planned})
            reveals.append(s.tx(m, "submit-results", {"epoch": number, "kind": "rechallenge", "results": entries}))
        assert s.block(*reveals) == [(0, "ok")] * len(reveals)
        mine = {r.submitter: r for r in s.results(number) if r.node == new.public}
        assert {k: r.status for k, r in mine.items()} == {
            leader.public: VALID, **{m.public: INVALID if silent else VALID for m in others}}
        if not silent:  # two of the answers were signed before the rotation, with the key it had then
            assert sorted(SignedResponse.from_record(mine[m.public].response).node == retired.public
                          for m in others) == [False, True, True]
        valid = [r for r in s.results(number) if r.status == VALID]
        assert all(c == 0 for c, _ in s.block(*(s.tx(m, "attest", {"epoch": number, "scores": [
            [r.node, r.submitter, HONEST, 0] for r in valid]}) for m in s.members.values())))
        rotating, new = new.public, following
        leader, own, early = _plan_and_tag(s, number + 1, [rotating, control])
        s.run_to(s.schedule.start(number + 1))
        assert s.epoch(number).finalized
        assert all(s.faults(m) == [] for m in s.members)  # nobody is faulted for the node's rotation
        history.append((rotating, s.reputation(rotating)))
    return history


def test_a_node_rotating_every_epoch_is_still_re_challenged_by_members_and_scored(s, tmp_path):
    """Each epoch every member's re-challenge, tagged under the key the node was planned under, is
    revealed under its new key (answers signed before the rotation with the old key, after it with the
    new) and attested; the node is scored every epoch, as one that never rotated, with no member
    faulted. Before, each reveal was refused (code 8) and only the leader's challenge scored it."""
    history = _play(s, silent=False)
    assert [value for _, value in history] == [expected(*[HONEST] * n) for n in range(1, EPOCHS + 1)]
    assert len({key for key, _ in history}) == EPOCHS
    assert all(a == b for a, b in s.h.replay(sqlite_url(tmp_path, "replay.db")))


@pytest.mark.postgres
def test_the_rotating_nodes_epochs_give_the_same_app_hashes_on_postgresql(s, pg_url):
    _play(s, silent=False)
    pairs = s.h.replay(pg_url)
    assert len(pairs) == s.h.height and all(here == there for here, there in pairs)


def test_a_node_rotating_every_epoch_and_silent_to_members_is_cut(s):
    """A node that rotates every epoch and answers the leader alone: the members' claims of no answer,
    naming the commitments their tags under its old key hold, land under its new key, more than a third of
    the power, and cut its C(T) to 0 each epoch although the leader's answer is attested. Before, every
    claim was refused and the node kept its reputation."""
    history = _play(s, silent=True)
    assert [value for _, value in history] == [expected(*[0] * n) for n in range(1, EPOCHS + 1)]
