"""A committee member that keeps misbehaving, or whose validator stays away (docs/threat-model.md,
"Faults without consequence"): faults are counted over a window of epochs, and past the genesis limit
the chain itself takes the member's power, as an approved removal would. Honest members are never
touched."""

from __future__ import annotations

from dataclasses import replace

from committee import EPOCH_PARAMS, HONEST, Script, finish
from harness import AppHarness, sqlite_url

from planetserve.chain.abci.state import members

PARAMS = replace(EPOCH_PARAMS, member_fault_window=4, member_fault_limit=3)


def epoch(s: Script, number: int, cheat: bytes = b"") -> None:
    """Epoch `number`: the leader's honest results, every member attesting them honestly but `cheat`,
    which attests 0 for one node (a deviating attestation: one fault an epoch); then on through the
    next election."""
    leader = s.epoch(number).leader
    assert s.block(s.tx(s.leader(number), "submit-results", s.leader_results(number, HONEST))) == [(0, "ok")]
    scores = dict.fromkeys(s.nodes, HONEST)
    txs = [tx for k, m in s.members.items() if k in members(s.h.store.batch())
           for tx in s.attest_txs(number, leader, {**scores, min(s.nodes): 0} if k == cheat else scores, [m])]
    assert all(c == 0 for c, _ in s.block(*txs))
    finish(s, number)


def run_until_removed(s: Script, operator: bytes, cheat: bytes = b"") -> int:
    """Epochs from 1 until `operator` is no longer a member; returns how many ran."""
    s.run_election_and_plan(1)
    number = 1
    while operator in members(s.h.store.batch()):
        assert number <= PARAMS.member_fault_limit, "the faulty member kept its power"
        epoch(s, number, cheat)
        number += 1
    return number - 1


def consensus_key(s: Script, operator: bytes) -> bytes:
    return s.h.consensus[s.h.members.index(s.members[operator])].public


def removals(s: Script) -> list:
    return [r for r in s.h.responses if any(e.type == "member_removed" for e in r.events)]


def test_a_member_that_keeps_attesting_falsely_loses_its_power(tmp_path):
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=PARAMS))
    cheat = sorted(s.members)[0]
    assert run_until_removed(s, cheat, cheat=cheat) == PARAMS.member_fault_limit
    assert s.faults(cheat) == ["deviating-attestation"] * PARAMS.member_fault_limit
    assert [s.epoch(n).faults for n in range(1, PARAMS.member_fault_limit + 1)] == [1] * PARAMS.member_fault_limit
    [removal] = removals(s)  # one block took the power: the last of its third faulty epoch
    assert {u.pub_key.ed25519: u.power for u in removal.validator_updates} == {consensus_key(s, cheat): 0}
    assert [{a.key: a.value for a in e.attributes} for e in removal.events] == [
        {"faults": str(PARAMS.member_fault_limit), "operator": cheat.hex(), "reason": "faults"}]
    assert set(members(s.h.store.batch())) == set(s.members) - {cheat}
    assert all(s.faults(m) == [] for m in s.members if m != cheat)


def test_a_validator_that_stays_away_is_faulty_each_epoch_and_then_loses_its_power(tmp_path):
    """Its member's daemon still takes part; its validator signs none of the commits."""
    h = AppHarness(sqlite_url(tmp_path), members=4, params=PARAMS)
    away = min(m.public for m in h.members)
    h.absent = {h.consensus[[m.public for m in h.members].index(away)].public}  # from the first block on
    s = Script(h)
    assert run_until_removed(s, away) == PARAMS.member_fault_limit - 1  # away in epochs 0, 1 and 2
    assert s.faults(away) == ["missed-blocks"] * PARAMS.member_fault_limit
    assert [s.epoch(n).faults for n in range(PARAMS.member_fault_limit)] == [1] * PARAMS.member_fault_limit
    [removal] = removals(s)
    assert {u.pub_key.ed25519: u.power for u in removal.validator_updates} == {consensus_key(s, away): 0}
    assert all(s.faults(m) == [] for m in s.members if m != away)


def test_a_validator_that_misses_a_few_commits_is_not_faulty(tmp_path):
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=PARAMS))
    late = sorted(s.members)[2]
    s.run_election_and_plan(1)
    s.h.absent = {consensus_key(s, late)}
    s.h.block()  # one missed commit, and another: far below half of the epoch's ten
    s.h.block()
    s.h.absent = set()
    epoch(s, 1)
    assert all(s.faults(m) == [] for m in s.members)
    assert removals(s) == []


def test_faults_older_than_the_window_do_not_count(tmp_path):
    """Faulty in epochs 1, 6 and 7: three faults, the limit, but only two within the last four epochs."""
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=PARAMS))
    cheat = sorted(s.members)[3]
    s.run_election_and_plan(1)
    for number in range(1, 8):
        epoch(s, number, cheat if number in (1, 6, 7) else b"")
    assert s.faults(cheat) == ["deviating-attestation"] * PARAMS.member_fault_limit
    assert cheat in members(s.h.store.batch()) and removals(s) == []
