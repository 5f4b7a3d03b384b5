"""Work a block does that grew with the square of cheap state, each transaction reading all of it.

One committee member fills a block with register-model-node transactions into an organisation of its
own: members are not rate limited (their epoch work must get through), and node registrations are not
among the block's capped registrations. Each registration read the reputation of every node the
organisation already had (a new key starts at most at the organisation's least reputation), so the block
cost the square of its size in every validator's FinalizeBlock and again in CheckTx: 4,000 took 34 s. The
organisation's least reputation is now one entry, kept as a node registers and as the epoch's end
rescores its nodes: a registration reads that entry, whatever the organisation's size.

Registered nodes, cheap to make (about 50 organisations' proof of work registers 10,000), must all be
in each epoch's plan, committed in parts of about 9 entries: each part read every node the plan must
cover, and the final part every plan entry (13 s of FinalizeBlock for a plan of 10,000, and as much again
in CheckTx). A part now reads each of its own nodes' entries, and the final part compares counts."""

from __future__ import annotations

from committee import EPOCH_PARAMS, PLAN_PART, Script
from harness import AppHarness, count_prefix_reads, node_body, sqlite_url

from planetserve.chain import layout
from planetserve.chain.keys import KeySet
from planetserve.registry import epochs

ORG_NODES = layout.key("orgnode", "")


def test_a_members_block_of_registrations_reads_no_organisations_node_list(tmp_path, monkeypatch):
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))
    prefixes_read = count_prefix_reads(monkeypatch)
    member = s.h.members[0]
    assert s.block(s.tx(member, "register-org", {"org_id": "m-org", "name": "a member's own"})) == [(0, "ok")]
    for _ in range(3):  # the organisation grows block by block; no registration reads what it has
        prefixes_read.clear()
        txs = [s.tx(member, "register-model-node", node_body(KeySet.generate(), "m-org", address="10.9.0.1:7000"))
               for _ in range(100)]
        assert all(code == 0 for code, _ in s.block(*txs))
        assert prefixes_read[ORG_NODES] == 0
    state = s.state
    assert state.org_reputation("m-org") == state.params().initial_reputation_ppm
    assert len(state.org_reputations("m-org")) == 300


def test_a_plan_in_parts_reads_the_nodes_it_must_cover_one_by_one(tmp_path, monkeypatch):
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS), nodes=3 * PLAN_PART + 1)
    s.run_to(s.schedule.setup_height(0))
    s.h.block()  # the nodes the plan of epoch 1 must cover are fixed here
    parts, _ = s.plan_txs(1)
    assert len(parts) == 4
    prefixes_read = count_prefix_reads(monkeypatch)
    assert s.block(*parts[:-1]) == [(0, "ok")] * 3
    assert s.block(parts[-1]) == [(0, "ok")]
    assert prefixes_read[layout.key("preq", "")] == 0 and prefixes_read[layout.key("plan", "")] == 0
    assert s.epoch(1).plan_status == epochs.PLAN_COMMITTED and len(s.planned_nodes(1)) == len(s.nodes)
