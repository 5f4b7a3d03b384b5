"""A node assigned to another organisation's deployment that serves a cheaper model than the one it
registered (docs/threat-model.md, "An assigned node or stage leaves or is untrusted"): the epoch that
finds it untrusted takes its share of the deployment away in the epoch's last block and gives it to
an honest standby node; the deployer pays nothing more, and no honest node or member is penalised."""

from __future__ import annotations

from committee import HONEST, finish
from deployers import Chain, events

CHEAP = 100_000
"""The credibility a cheaper model's answers score."""


def test_an_assigned_node_serving_a_cheaper_model_loses_its_share_at_the_epochs_end(tmp_path):
    c = Chain(tmp_path)
    s = c.s
    assert c.deploy("gt", nodes=2) == (0, "ok")
    before = c.deployment()
    cheap = next(n for n in before.nodes if n in c.org1)
    standby = set(s.nodes) - set(before.nodes)

    s.run_election_and_plan(1)
    leader = s.leader(1)
    scores = {n: CHEAP if n == cheap else HONEST for n in s.nodes}
    body = s.leader_results(1, HONEST)
    for entry, node in zip(body["results"], s.nodes, strict=True):
        entry["credibility"] = scores[node]
    assert s.block(s.tx(leader, "submit-results", body)) == [(0, "ok")]
    assert all(code == 0 for code, _ in s.block(*s.attest_txs(1, leader.public, scores)))
    finish(s, 1)
    assert not s.state.listable(cheap) and not s.state.reputation(cheap).trusted
    last = s.schedule.end(1)  # the epoch's last block: finalization, then healing
    healing = [height for height, result in enumerate(c.h.responses, 1) if events(result, "deployment_healed")]
    assert healing == [last]
    [healed] = events(c.h.responses[last - 1], "deployment_healed")
    assert (healed["left"], healed["reasons"], healed["refund"]) == (cheap.hex(), "untrusted", "0")
    [replacement] = set(c.deployment().nodes) - set(before.nodes)
    assert healed["joined"] == replacement.hex() and replacement in standby
    assert s.state.deployment_of(cheap) is None and cheap not in c.assigned()
    assert c.deployment().cost == before.cost and s.state.credits("acme").spent == before.cost
    assert all(s.state.listable(n) for n in s.nodes if n != cheap)
    assert all(s.faults(m) == [] for m in s.members)
    assert c.replays(tmp_path)
