"""An organisation's owner that wants every epoch left unchecked: through the plan window it switches
one of its nodes between active and inactive every block. The nodes a plan must cover were read at each
part of the plan, so a plan built from state a block old (as a planning member's daemon builds it) was
refused, by the planner and its backup alike: every epoch went unplanned, each planner took a `no-plan`
fault, and the committee lost its members one by one. The nodes a plan covers are now fixed at its setup
block; a status changed after it counts from the next epoch."""

from __future__ import annotations

import pytest
from committee import EPOCH_PARAMS, Script
from harness import AppHarness, node_body, sqlite_url

from planetserve.chain.keys import KeySet
from planetserve.registry.epochs import PLAN_COMMITTED


@pytest.fixture
def s(tmp_path) -> Script:
    return Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))


def test_switching_nodes_on_and_off_in_the_plan_window_spoils_no_plan(s):
    on, off = list(s.nodes)[0], KeySet.generate()
    assert s.block(s.tx(s.owner, "register-model-node", node_body(off, address="10.0.0.9:7000")),
                   s.tx(s.owner, "update-model-node", {"node_pubkey": off.public, "status": "inactive"})) \
        == [(0, "ok")] * 2
    s.run_to(s.schedule.setup_height(0))
    s.h.block()  # the setup block of epoch 1 fixes what its plan covers
    assert s.state.plan_required(1) == sorted(s.nodes)
    body, _ = s.plan(1)  # built now, as the planner's daemon builds it, and sent a block later

    def switch(node: bytes, status: str) -> bytes:
        return s.tx(s.owner, "update-model-node", {"node_pubkey": node, "status": status})

    assert s.block(switch(on, "inactive"), switch(off.public, "active")) == [(0, "ok")] * 2
    assert s.block(s.tx(s.leader(0), "commit-plan", body), *s.vrf_txs(1))[0] == (0, "ok")
    assert s.epoch(1).plan_status == PLAN_COMMITTED and s.planned_nodes(1) == sorted(s.nodes)
    s.run_to(s.schedule.setup_height(1))
    s.h.block()  # from the next epoch on, the statuses as they stand now
    assert s.state.plan_required(2) == sorted([*(n for n in s.nodes if n != on), off.public])
