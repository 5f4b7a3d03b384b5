"""A member (under a third of the power) that registers a model no other member holds a reference for,
then has nodes of it registered: every node of a registered model is planned each epoch, and an honest
leader that cannot verify a node skips it (a `skipped-node` fault), so five such nodes took each honest
leader to the member fault limit in its epoch, until the attacker was the committee alone. A model is
now registered only once members with more than 2/3 of the power approve it, and dropped once a third
rejects it; until then no node of it can be registered."""

from __future__ import annotations

import pytest
from committee import EPOCH_PARAMS, Script
from harness import AppHarness, events, node_body, sqlite_url

from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.chain.layout import NEXT_PROPOSAL_KEY

PRIVATE = {"model_id": "private", "name": "Only the proposer holds it"}


@pytest.fixture
def s(tmp_path) -> Script:
    return Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))


def node_of_private(s: Script) -> tuple[int, str]:
    return s.block(s.tx(s.owner, "register-model-node", node_body(KeySet.generate(), model_id="private")))[0]


def test_a_member_alone_cannot_register_a_model(s):
    attacker, second, third, fourth = s.members.values()
    proposal = s.state.get_int(NEXT_PROPOSAL_KEY) + 1
    assert s.block(s.tx(attacker, "register-model", PRIVATE)) == [(0, "ok")]
    assert events(s.h.responses[-1], "propose_model") == [{"proposal_id": str(proposal), "action": "model"}]
    assert s.state.model("private") is None
    code, log = node_of_private(s)
    assert code == Code.UNKNOWN_ENTITY and "model 'private' is not registered" in log
    approve = {"proposal_id": proposal, "approve": True}
    assert s.block(s.tx(second, "vote-member", approve)) == [(0, "ok")]  # 20 of 40: not above 2/3
    assert s.state.model("private") is None and node_of_private(s)[0] == Code.UNKNOWN_ENTITY
    assert s.block(s.tx(third, "vote-member", approve)) == [(0, "ok")]  # 30 of 40
    registered = s.state.model("private")
    assert registered is not None and registered.registered_at == s.h.time
    assert node_of_private(s) == (0, "ok")


def test_a_third_of_the_power_rejecting_a_model_drops_it(s):
    attacker, second, third, _ = s.members.values()
    proposal = s.state.get_int(NEXT_PROPOSAL_KEY) + 1
    assert s.block(s.tx(attacker, "register-model", PRIVATE)) == [(0, "ok")]
    reject = {"proposal_id": proposal, "approve": False}
    assert s.block(s.tx(second, "vote-member", reject), s.tx(third, "vote-member", reject)) == [(0, "ok")] * 2
    assert events(s.h.responses[-1], "proposal_rejected") == [{"proposal_id": str(proposal)}]
    assert s.state.proposal(proposal) is None and s.state.model("private") is None
