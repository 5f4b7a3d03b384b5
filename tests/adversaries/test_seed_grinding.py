"""A block proposer that grinds the epoch seed (docs/threat-model.md, "Seed grinding"): a seed made
from a block's or the state's hash could be steered by trying transaction sets until the election
or the plan falls its way. The seed of each epoch comes only from the seed before it and the VRF
outputs its election drew, so whatever transactions blocks hold, the seeds are the same."""

from __future__ import annotations

from committee import EPOCH_PARAMS, Script
from harness import AppHarness, sqlite_url

from planetserve.chain import layout
from planetserve.chain.keys import KeySet
from planetserve.registry import epochs
from planetserve.registry.epochs import VrfEntry


def test_no_choice_of_transactions_moves_the_epoch_seeds(tmp_path):
    committee = ([KeySet.generate() for _ in range(4)], [KeySet.generate() for _ in range(4)])
    plain = Script(AppHarness(sqlite_url(tmp_path, "plain.db"), params=EPOCH_PARAMS, keys=committee))
    ground = Script(AppHarness(sqlite_url(tmp_path, "ground.db"), params=EPOCH_PARAMS, keys=committee), nodes=3)
    for i in range(3):  # the grinding proposer's chain: other transactions, block after block
        org = ground.tx(KeySet.generate(), "register-org", {"org_id": f"grind-{i}", "name": "x"})
        assert ground.block(org) == [(0, "ok")]
        assert plain.block() == []
    for number in (1, 2):
        plain.run_election_and_plan(number)
        ground.run_election_and_plan(number)
    assert plain.h.store.app_hash != ground.h.store.app_hash
    assert [plain.epoch(n).seed for n in (1, 2)] == [ground.epoch(n).seed for n in (1, 2)]
    assert [plain.epoch(n).leader for n in (1, 2)] == [ground.epoch(n).leader for n in (1, 2)]


def test_the_seed_is_the_previous_seed_and_the_drawn_vrf_outputs(tmp_path):
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))
    s.run_election_and_plan(1)
    s.run_election_and_plan(2)
    batch = s.h.store.batch()
    drawn = [(e.operator, e.output)
             for e in layout.decode_records(list(batch.iterate(layout.vrf_prefix(1))), VrfEntry)]
    assert len(drawn) == 4
    assert s.epoch(2).seed == epochs.epoch_seed(s.epoch(1).seed, drawn, 2)
    assert s.epoch(2).seed != epochs.epoch_seed(s.epoch(1).seed, drawn[1:], 2)  # withholding: one bit
