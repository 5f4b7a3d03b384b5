"""A model node that signs what it was not asked (another temperature, seed, nucleus or time), so that its
answer, revealed, makes the honest member who submits it faulty (docs/threat-model.md, "Framing the
challenger"): the member's daemon checks what the node signed before it reveals, and claims no valid
response instead; the node's answer is never revealed against the member. The members who then
re-challenge it meet the same answer, and their claims make the node's score 0: the node is scored,
and untrusted, and no member is faulted."""

from __future__ import annotations

import time

import pytest
from committee import EPOCH_PARAMS, HONEST, TEMPERATURE, Script, expected, finish, listed
from harness import AppHarness, sqlite_url

from planetserve.chain.challenge import Challenge, response_extension, sign_response
from planetserve.chain.keys import KeySet
from planetserve.chain.messages.epochs import Unanswered
from planetserve.registry.entities import ModelNode
from planetserve.verifier import daemon as daemon_module
from planetserve.verifier.daemon import SIGNED_TIME_TOLERANCE_S, Daemon
from planetserve.verifier.overlay import OverlayChannel

ASKED = 700


def asked(relay, tmp_path, node: KeySet, signed_temperature: int, signed_time: int, seed_offset: int = 0,
          signed_top_p: int = 900):
    """What the member's daemon makes of the node's answer to its challenge at temperature 0.7 and top_p
    0.9, signed with the challenge's seed plus `seed_offset`."""
    challenge = Challenge.new("Why?", ASKED, top_p=900)
    response = sign_response(node, "Why?", [5, 6], "Light.", "gt", signed_time, "h:1", signed_temperature,
                             challenge.seed + seed_offset, signed_top_p)
    relay.body = {"choices": [{"text": "Light."}], "planetserve": response_extension(response)}
    registered = ModelNode(node.public, "org", "gt", "h:1", "cpu", 1, "eu", "active", 0)
    daemon = Daemon(KeySet.generate(), None, {}, OverlayChannel(relay.url), None, tmp_path, attempts=2)
    daemon._ask((1, node.public, "leader"), challenge, registered)
    done = daemon.pending[1, node.public, "leader"].result(timeout=30)
    return daemon, done


@pytest.mark.parametrize(("temperature", "skew", "seed_offset", "top_p", "reason"), [
    (1_000, 0, 0, 900, "the node signed temperature 1, it was asked 0.7"),
    (ASKED, 0, 1, 900, "the node signed seed"),
    (ASKED, 0, 0, 1_000, "the node signed top_p 1, it was asked 0.9"),
    (ASKED, -3_600, 0, 900, "the node signed time"),
    (ASKED, SIGNED_TIME_TOLERANCE_S + 30, 0, 900, "s from its answer"),
])
def test_an_answer_signed_otherwise_is_claimed_invalid_not_revealed(relay, tmp_path, monkeypatch, temperature,
                                                                    skew, seed_offset, top_p, reason):
    monkeypatch.setattr(daemon_module, "RETRY_DELAY_S", 0.0)
    node = KeySet.generate()
    daemon, done = asked(relay, tmp_path, node, temperature, int(time.time()) + skew, seed_offset, top_p)
    assert done.reply is None and reason in done.failure and done.failure.startswith("2 attempts")
    entry = daemon._entry(1, done, "leader")
    assert isinstance(entry, Unanswered) and entry.node == node.public and reason in entry.invalid


def test_an_answer_signed_as_asked_is_revealed(relay, tmp_path):
    node = KeySet.generate()
    _, done = asked(relay, tmp_path, node, ASKED, int(time.time()))
    assert done.reply is not None and done.reply.response.temperature == ASKED


def test_a_framing_node_is_scored_and_untrusted_and_no_member_is_faulted(relay, tmp_path, monkeypatch):
    """The leader's daemon and two members' daemons ask the framing node through the relay and each
    claims no valid answer (the re-challengers naming their committed challenges); those claims, from
    three quarters of the power, make the node's C(T) 0."""
    monkeypatch.setattr(daemon_module, "RETRY_DELAY_S", 0.0)
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))
    framing, honest = list(s.nodes)
    s.run_election_and_plan(1)
    leader = s.leader(1)
    # whatever it is asked, it signs temperature 1, not the committed 0.7
    relay.body = {"choices": [{"text": "Light."}], "planetserve": response_extension(
        sign_response(s.nodes[framing], "Why?", [5, 6], "Light.", "gt", int(time.time()), "h:1", 1_000, 7))}
    registered = ModelNode(framing, "org1", "gt", "h:1", "cpu", 1, "eu", "active", 0)

    def claim(member: KeySet, challenge: Challenge, kind: str) -> Unanswered:
        daemon = Daemon(member, None, {}, OverlayChannel(relay.url), None, tmp_path / member.public.hex(), attempts=2)
        daemon._ask((1, framing, kind), challenge, registered)
        entry = daemon._entry(1, daemon.pending[1, framing, kind].result(timeout=30), kind)
        assert isinstance(entry, Unanswered) and "signed temperature 1" in entry.invalid
        return entry

    planned = claim(leader, s.planned(1, framing, leader), "leader")
    body = s.leader_results(1, HONEST, [honest])
    body["results"].append(planned.body())
    assert s.block(s.tx(leader, "submit-results", body)) == [(0, "ok")]
    for member in [m for k, m in s.members.items() if k != leader.public][:2]:
        own = Challenge.new("Why is the sea salty?", TEMPERATURE)
        assert s.block(s.tx(member, "commit-rechallenge", {"epoch": 1, "tags": [own.tag(framing)]}))[0][0] == 0
        entry = claim(member, own, "rechallenge")
        assert s.block(s.tx(member, "submit-results", {"epoch": 1, "kind": "rechallenge",
                                                        "results": [entry]})) == [(0, "ok")]
    assert all(c == 0 for c, _ in s.block(*s.attest_txs(1, leader.public, {honest: HONEST})))
    finish(s, 1)
    assert s.reputation(framing) == expected(0) and not s.state.reputation(framing).trusted
    assert framing not in listed(s) and honest in listed(s)
    assert s.reputation(honest) == expected(HONEST)
    assert all(s.faults(m) == [] for m in s.members)
