"""A model node that signs what it was not asked (another temperature, seed, nucleus or time), so that its
answer, revealed, makes the honest member who submits it faulty (docs/threat-model.md, "Framing the
challenger"): the member's daemon checks what the node signed before it reveals, and claims no valid
response instead; the node's answer is never revealed against the member. The members who then
re-challenge it meet the same answer, and their claims make the node's score 0: the node is scored,
and untrusted, and no member is faulted."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import pytest
from committee import EPOCH_PARAMS, HONEST, TEMPERATURE, Script, expected, finish, listed
from harness import AppHarness, sqlite_url
from inprocess import LiveCommittee, live_committee
from modelnodes import make_node

from planetserve.chain.challenge import (
    MAX_CHALLENGE_TOKENS,
    Challenge,
    response_extension,
    response_from_extension,
    served_extension,
    sign_response,
)
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.chain.messages.epochs import (
    MAX_PROMPT_CHARS,
    MAX_RESPONSE_CHARS,
    MAX_RESPONSE_TOKENS,
    Unanswered,
)
from planetserve.node.api.openai import overloaded
from planetserve.node.model_node import ModelNode as LiveNode
from planetserve.registry.entities import ModelNode
from planetserve.registry.epochs import INVALID, VALID, SignedResponse
from planetserve.registry.params import Params
from planetserve.verifier import daemon as daemon_module
from planetserve.verifier.daemon import SIGNED_TIME_TOLERANCE_S, TX_MARGIN_BYTES, Asked, Daemon, _revealable
from planetserve.verifier.overlay import OverlayChannel

ASKED = 700


def asked(relay, tmp_path, node: KeySet, signed_temperature: int, signed_time: int, seed_offset: int = 0,
          signed_top_p: int = 900):
    """What the member's daemon makes of the node's answer to its challenge at temperature 0.7 and top_p
    0.9, signed with the challenge's seed plus `seed_offset`."""
    challenge = Challenge.new("Why?", ASKED, top_p=900)
    response = sign_response(node, "Why?", [5, 6], "Light.", "gt", signed_time, "h:1", signed_temperature,
                             challenge.seed + seed_offset, signed_top_p)
    return ask_answered(relay, tmp_path, challenge, response)


def ask_answered(relay, tmp_path, challenge: Challenge, response: SignedResponse) -> tuple[Daemon, Asked]:
    """A member's daemon asking `challenge` of the node that signed `response`, which the relay carries."""
    relay.body = {"choices": [{"text": response.text}], "planetserve": response_extension(response)}
    registered = ModelNode(response.node, "org", "gt", "h:1", "cpu", 1, "eu", "active", 0)
    daemon = Daemon(KeySet.generate(), None, {}, OverlayChannel(relay.url), None, tmp_path, attempts=2)
    daemon._ask((1, response.node, "leader"), challenge, registered)
    return daemon, daemon.pending[1, response.node, "leader"].result(timeout=30)


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


def spoiled(relay, tmp_path, **fields: object) -> Asked:
    """What the member's daemon makes of an answer signed as asked but with `fields` changed (and signed)."""
    node = KeySet.generate()
    challenge = Challenge.new("Why?", ASKED, top_p=900)
    response = replace(sign_response(node, "Why?", [5, 6], "Light.", "gt", int(time.time()), "h:1", ASKED,
                                     challenge.seed, 900), **fields)
    return ask_answered(relay, tmp_path, challenge, replace(response, signature=node.sign(response.sign_bytes())))[1]


@pytest.mark.parametrize(("fields", "refused"), [
    ({"address": "nowhere"}, "field 'address'"),
    ({"model_id": "g t"}, "field 'model_id'"),
    ({"token_ids": (2**32,)}, "field 'token_ids'"),
    ({"token_ids": (5,) * (MAX_RESPONSE_TOKENS + 1)}, "field 'token_ids'"),
    ({"text": "L" * (MAX_RESPONSE_CHARS + 1)}, "field 'text'"),
], ids=["address", "model id", "token id", "tokens", "text"])
def test_an_answer_the_ledger_would_not_read_is_claimed_invalid_not_revealed(relay, tmp_path, monkeypatch, fields,
                                                                             refused):
    """Revealed, it would have the member's whole transaction refused, and every result batched with it."""
    monkeypatch.setattr(daemon_module, "RETRY_DELAY_S", 0.0)
    done = spoiled(relay, tmp_path, **fields)
    assert done.reply is None and "an answer the ledger would refuse" in done.failure and refused in done.failure
    assert done.failure.startswith("2 attempts")


@pytest.mark.parametrize("served", [{"address": "nowhere"}, {"time": -1}], ids=["address", "time"])
def test_a_serving_peer_the_ledger_would_not_read_is_left_out(relay, tmp_path, served):
    """The answer is revealed without it: the node that answered answers for it."""
    node, peer = KeySet.generate(), KeySet.generate()
    challenge = Challenge.new("Why?", ASKED, top_p=900)
    response = sign_response(node, "Why?", [5, 6], "Light.", "gt", int(time.time()), "h:1", ASKED,
                             challenge.seed, 900)
    computed = replace(response, node=peer.public, **served)
    computed = replace(computed, signature=peer.sign(computed.sign_bytes()))
    relay.body = {"choices": [{"text": "Light."}], "planetserve": {**response_extension(response),
                                                                     "served": served_extension(computed)}}
    reply = OverlayChannel(relay.url).ask(node.public, "gt", challenge)
    assert reply.response == response and reply.served is None


def test_an_answer_too_large_for_a_transaction_is_claimed_as_none():
    """A node that pads its answer beyond what a challenge asked for would have the transaction carrying
    it refused for its size: the daemon claims no valid response instead, naming the re-challenge's
    commitment. The largest answer a challenge may ask for, to the longest prompt the ledger takes,
    is revealed."""
    node = KeySet.generate()
    limit = Params().max_tx_bytes - TX_MARGIN_BYTES
    challenge = Challenge.new("Why?", ASKED, top_p=900)
    padded = challenge.reveal(sign_response(node, "Why?", [5, 6], "Light. " * 2_500, "gt", int(time.time()),
                                            "h:1", ASKED, challenge.seed, 900))
    claim = _revealable(padded, "rechallenge", limit)
    assert isinstance(claim, Unanswered) and claim.commitment == challenge.commitment
    assert claim.invalid.startswith("an answer whose result takes") and "more than a transaction" in claim.invalid
    leader_claim = _revealable(padded, "leader", limit)
    assert isinstance(leader_claim, Unanswered) and leader_claim.commitment is None
    longest = Challenge.new("Why? " * (MAX_PROMPT_CHARS // 5), ASKED, top_p=900)
    largest = longest.reveal(sign_response(node, longest.prompt, [2**31 - 1] * MAX_CHALLENGE_TOKENS,
                                           "words " * MAX_CHALLENGE_TOKENS, "gt", int(time.time()), "h:1", ASKED,
                                           longest.seed, 900))
    assert _revealable(largest, "rechallenge", limit) is largest


class SpoilingNode(LiveNode):
    """A real model node that answers with the model it registered but signs each answer as `spoil` has it."""

    spoil: Callable[[KeySet, SignedResponse, dict], dict]

    def _sign(self, job, state, route_reason, served_by):  # type: ignore[no-untyped-def]
        extension = super()._sign(job, state, route_reason, served_by)
        return self.spoil(self.keys, response_from_extension(extension, state.text), extension)


def unreadable_address(keys: KeySet, signed: SignedResponse, extension: dict) -> dict:
    """Its own signature over an address that is no host:port."""
    spoilt = replace(signed, address="nowhere")
    return {**extension, **response_extension(replace(spoilt, signature=keys.sign(spoilt.sign_bytes())))}


def served_by_a_stranger(keys: KeySet, signed: SignedResponse, extension: dict) -> dict:
    """The same answer signed by a fresh key, named as the peer that computed it."""
    stranger = KeySet.generate()
    peer = replace(signed, node=stranger.public)
    return {**extension, "served": served_extension(replace(peer, signature=stranger.sign(peer.sign_bytes())))}


class CursingNode(LiveNode):
    """A real model node that refuses every request with an error whose message holds control characters,
    which a member's claim of no valid response quotes."""

    async def produce(self, job, prompt_ids, generation, options, *, whole=False):  # type: ignore[no-untyped-def]
        raise overloaded("busy\x00\x07\x1b[2J now")


LIVE = replace(EPOCH_PARAMS, epoch_blocks=40, results_blocks=16, vrf_window_blocks=10, plan_window_blocks=14,
               response_slack_seconds=3_600)
"""The localnet's epochs; the in-process chain's clock runs ahead of the nodes' own, within the slack."""


@pytest.mark.parametrize("spoil", [unreadable_address, served_by_a_stranger, None],
                         ids=["address", "stranger", "error"])
def test_a_node_signing_what_the_ledger_would_not_take_frames_no_member(quick_family, tmp_path, monkeypatch,
                                                                         spoil):
    """Four members' real daemons challenge a real node whose every answer carries what the ledger would
    not take from a member: an address it cannot read, or an error message with control characters
    (the whole transaction of results refused, the leader's with the honest node's result in it, and the
    leader faulted for withholding them), or a serving peer that is no node of the model (the
    submitter's `altered-response` fault, before). Each member claims no valid response to the first
    two, which cuts the node; the third is revealed without the peer, and the node answers for its own
    answer. No transaction is refused and no member faulted."""
    monkeypatch.setattr(daemon_module, "RETRY_DELAY_S", 0.0)

    def play(c: LiveCommittee) -> tuple[list, bytes, int]:
        s, key = c.s, c.node.keys.public
        number = 0
        while number == 0:
            number = c.epoch()
        refused = [entry for d in c.daemons.values() for entry in d.submissions.read() if entry["code"]
                   and not (entry["type"] == "attest" and entry["code"] == Code.EXPIRED)]
        assert not refused, refused
        assert all(s.faults(m) == [] for m in s.members), {m.hex()[:8]: s.faults(m) for m in s.members}
        honest = s.state.reputation(c.honest.keys.public)
        assert honest.last_epoch == number and honest.trusted and honest.window[-1] == HONEST, honest
        rep = s.state.reputation(key)
        assert rep is not None and rep.last_epoch == number
        return [r for r in s.results(number) if r.node == key], s.epoch(number).leader, rep.window[-1]

    if spoil is None:
        node = make_node(quick_family, CursingNode)
    else:
        node = make_node(quick_family, SpoilingNode)
        node.spoil = spoil
    results, leader, credibility = live_committee(quick_family, tmp_path, LIVE, node, play)
    assert any(r.submitter == leader and r.kind == "leader" for r in results)
    if spoil is not served_by_a_stranger:
        assert {r.status for r in results} == {INVALID} and len(results) == 4 and credibility == 0
        said = "an answer the ledger would refuse" if spoil else "HTTP 503 overloaded: busy [2J now"
        assert all(said in r.reason for r in results), [r.reason for r in results]
    else:
        assert results and all(r.status == VALID and r.served_by == b"" for r in results)
        assert all("not a registered node of the challenged node's model" in r.reason for r in results)
