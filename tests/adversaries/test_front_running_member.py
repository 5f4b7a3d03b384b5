"""A member colluding with a cheating node, as a block's proposer: it sees an honest member's reveal of a
re-challenge in the mempool, commits that challenge's tag itself and opens it first in the same block (a
claim of no answer naming the commitment); commitments are unique in an epoch, so the honest reveal was
refused, with every result batched beside it, and the node's deviating answer never landed. A tag now
opens only from the block after the one that committed it."""

from __future__ import annotations

import pytest
from committee import EPOCH_PARAMS, HONEST, TEMPERATURE, Script
from harness import AppHarness, sqlite_url

from planetserve.chain.challenge import Challenge
from planetserve.chain.errors import Code
from planetserve.chain.messages.epochs import Unanswered


@pytest.fixture
def s(tmp_path) -> Script:
    return Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))


def test_a_proposer_cannot_open_anothers_revealed_challenge_before_it(s):
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, node1 = list(s.nodes)
    assert s.block(s.tx(leader, "submit-results", s.leader_results(1, HONEST))) == [(0, "ok")]
    honest, colluder = [m for m in s.members.values() if m.public != leader.public][:2]
    own = Challenge.new("How do tides work?", TEMPERATURE)
    assert s.block(s.tx(honest, "commit-rechallenge", {"epoch": 1, "tags": [own.tag(node0)]})) == [(0, "ok")]
    reveal = s.tx(honest, "submit-results", {"epoch": 1, "kind": "rechallenge",
                                             "results": [own.reveal(s.answer(node0, own))]})
    assert s.h.check(reveal).code == 0  # sent once its commit's block is in, it enters the mempool
    stolen = s.tx(colluder, "commit-rechallenge", {"epoch": 1, "tags": [own.tag(node0)]})
    claim = s.tx(colluder, "submit-results", {"epoch": 1, "kind": "rechallenge", "results": [
        Unanswered(node0, "no answer", own.commitment)]})
    committed, opened, revealed = s.block(stolen, claim, reveal)
    assert committed == (0, "ok")
    assert opened[0] == Code.INVALID_FIELD and "opens a tag committed in this block" in opened[1]
    assert revealed == (0, "ok")
    assert s.state.result(1, node0, honest.public) is not None
    assert s.state.result(1, node0, colluder.public) is None
