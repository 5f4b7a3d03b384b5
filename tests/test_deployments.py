"""Deployments (chain/abci/deployments.py), on the real application: `deploy-model` assigns only nodes
registered for the deployed model and refuses what it cannot deliver."""

from __future__ import annotations

import pytest
from deployers import ACME, FUNDS, Chain

from planetserve.chain import layout
from planetserve.chain.errors import Code

LAYER_MIB = 1_000


@pytest.fixture
def c(tmp_path) -> Chain:
    return Chain(tmp_path)


def test_a_model_no_node_serves_is_refused_and_nodes_of_other_models_are_never_assigned(c):
    code, log = c.deploy("third", nodes=1)
    assert code == Code.UNAVAILABLE and "no trusted, unassigned A100 node is registered for model 'third'" in log
    others = c.register("other", 2)
    code, log = c.deploy("other", nodes=3)
    assert code == Code.UNAVAILABLE and "asks for 3 A100 node(s) holding model 'other'; 2 trusted" in log
    assert c.s.state.credits(ACME).balance == FUNDS  # refusals cost nothing
    assert c.deploy("other", nodes=2) == (0, "ok")
    assert sorted(c.deployment(c.s.state.get_int(layout.NEXT_DEPLOYMENT_KEY)).nodes) == sorted(others)
    # the five gt nodes serve gt only: every one of them, and nothing else, can be assigned it
    code, log = c.deploy("gt", nodes=6)
    assert code == Code.UNAVAILABLE and "5 trusted, unassigned ones serve it" in log
    assert sorted(c.assigned()) == sorted(others)
