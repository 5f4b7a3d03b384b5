"""Verification epochs through the real Application: election, plans, results, attestations,
finalization, and each of the leader's attacks of seed section 4.4, with a scripted committee."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import replace

import pytest
from committee import (
    EPOCH_PARAMS,
    HONEST,
    NODE_ADDRESS,
    RULE,
    TEMPERATURE,
    Script,
    expected,
    finish,
    honest_epoch,
    listed,
    unopenable_plan,
)
from harness import AppHarness, sqlite_url
from nacl.public import PublicKey, SealedBox
from nacl.secret import SecretBox

from planetserve.chain import layout, vrf
from planetserve.chain.abci.state import members
from planetserve.chain.challenge import (
    SEALED_VERSION,
    Challenge,
    SealedPromptError,
    open_plan_entry,
    padded_size,
    sign_response,
)
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.chain.messages.epochs import PlanItem
from planetserve.registry import codec, epochs, finalization, reputation
from planetserve.registry.entities import Member
from planetserve.registry.epochs import UNOPENED, ChallengeResult, PlanEntry
from planetserve.registry.params import Params
from planetserve.verifier.daemon import TX_MARGIN_BYTES


@pytest.fixture
def s(tmp_path) -> Script:
    return Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))


def others(s: Script, number: int) -> list:
    leader = s.epoch(number).leader
    return [m for k, m in s.members.items() if k != leader]


def test_honest_epoch(s):
    s.run_election_and_plan(1)
    epoch = s.epoch(1)
    seed = epoch.seed
    outputs = {m.public: vrf.proof_to_hash(vrf.prove(bytes(m.vrf), seed)) for m in s.members.values()}
    assert epoch.election == "vrf"
    assert epoch.leader == min(outputs, key=lambda k: (outputs[k], k))
    assert epoch.plan_status == epochs.PLAN_COMMITTED and epoch.plan_nodes == 2
    assert s.block(s.tx(s.leader(1), "submit-results", s.leader_results(1, 800_000))) == [(0, "ok")]
    attested = dict(zip(sorted(s.members), (790_000, 800_000, 810_000, 805_000), strict=True))
    txs = [s.tx(m, "attest", {"epoch": 1, "scores": [[n, epoch.leader, attested[m.public]] for n in s.nodes]})
           for m in s.members.values()]
    assert all(c == 0 for c, _ in s.block(*txs))
    finish(s, 1)
    median = reputation.median(list(attested.values()))
    assert median == 802_500
    for node in s.nodes:
        assert s.reputation(node) == expected(median) == 681_500
        assert s.state.reputation(node).window == (median,)
    assert s.epoch(1).scored == 2 and s.epoch(1).faults == 0
    assert all(s.faults(m) == [] for m in s.members)


@pytest.mark.faults
def test_a_member_attesting_garbage_is_outvoted_and_recorded(s):
    """A Byzantine member attests honest nodes as worthless: the median of the supermajority
    decides, the member's deviations are recorded as faults, and nobody else has any."""
    s.run_election_and_plan(1)
    leader = s.epoch(1).leader
    assert s.block(s.tx(s.leader(1), "submit-results", s.leader_results(1, HONEST))) == [(0, "ok")]
    byzantine = next(m for k, m in s.members.items() if k != leader)
    truthful = [m for m in s.members.values() if m is not byzantine]
    txs = s.attest_txs(1, leader, dict.fromkeys(s.nodes, HONEST), truthful)
    txs += s.attest_txs(1, leader, dict.fromkeys(s.nodes, 0), [byzantine])
    assert all(c == 0 for c, _ in s.block(*txs))
    finish(s, 1)
    assert all(s.reputation(node) == expected(HONEST) for node in s.nodes)
    assert s.faults(byzantine.public) == ["deviating-attestation", "deviating-attestation"]
    assert s.faults(leader) == [] and all(s.faults(m.public) == [] for m in truthful)


def test_plain_words_of_the_seed_formula(s):
    """R(T) = 0.4 R(T-1) + 0.6 C(T) from R = 0.5: C = 1.0 gives 0.8."""
    s.run_election_and_plan(1)
    honest_epoch(s, 1, dict.fromkeys(s.nodes, 1_000_000))
    assert [s.reputation(n) for n in s.nodes] == [800_000, 800_000]


@pytest.mark.faults
def test_a_leader_proposing_a_credibility_far_from_the_median_is_faulty_and_outvoted(s):
    """The leader proposes a perfect score for a node the members score at 0.3: its proposal decides
    nothing (the median of the attestations does) and, beyond the tolerance, is its fault; a proposal
    within the tolerance is not."""
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, node1 = list(s.nodes)
    tolerance = s.state.params().credibility_tolerance_ppm
    proposed = {node0: HONEST, node1: 300_000 + tolerance}
    assert s.block(s.tx(leader, "submit-results", s.leader_results(1, proposed))) == [(0, "ok")]
    assert all(c == 0 for c, _ in s.block(*s.attest_txs(1, leader.public, dict.fromkeys(s.nodes, 300_000))))
    finish(s, 1)
    assert s.faults(leader.public) == ["deviating-credibility"]
    [fault] = layout.decode_records(list(s.h.store.batch().iterate(layout.fault_prefix(leader.public))),
                                    epochs.Fault)
    assert (fault.node, fault.detail) == (node0, "proposed 1000000 ppm against the median 300000")
    assert [s.reputation(n) for n in (node0, node1)] == [expected(300_000)] * 2


@pytest.mark.faults
def test_altered_prompt_is_the_leaders_fault(s):
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, node1 = list(s.nodes)
    body = s.leader_results(1, HONEST)
    challenge = s.planned(1, node0, leader)
    altered = s.answer(node0, challenge, prompt=challenge.prompt + " Answer in one word.")
    body["results"][0] = {**challenge.reveal(altered).body(), "credibility": HONEST}
    assert s.block(s.tx(leader, "submit-results", body)) == [(0, "ok")]
    result = s.state.result(1, node0, leader.public)
    assert result.status == epochs.FAULTY and "different prompt" in result.reason
    assert s.faults(leader.public) == ["altered-prompt"]
    # the faulty result cannot be attested; the other one can
    code, log = s.block(*s.attest_txs(1, leader.public, {node0: HONEST}, [leader]))[0]
    assert code == Code.UNKNOWN_ENTITY and "no valid result" in log
    assert all(c == 0 for c, _ in s.block(*s.attest_txs(1, leader.public, {node1: HONEST})))
    finish(s, 1)
    assert s.reputation(node0) is None  # nothing counted against the honest node
    assert s.reputation(node1) == expected(HONEST)


@pytest.mark.faults
def test_altered_response_is_the_leaders_fault(s):
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0 = next(iter(s.nodes))
    body = s.leader_results(1, HONEST, [node0])
    body["results"][0]["response"]["text"] = "I am a very bad model."
    assert s.block(s.tx(leader, "submit-results", body)) == [(0, "ok")]
    assert s.state.result(1, node0, leader.public).status == epochs.FAULTY
    finish(s, 1)
    assert s.faults(leader.public) == ["altered-response", "skipped-node"]
    assert s.reputation(node0) is None


@pytest.mark.faults
def test_a_forged_serving_signature_is_the_submitters_fault(s):
    """A member checks the serving peer's signature before it reveals, so one that does not verify was
    altered by the submitter."""
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, node1 = list(s.nodes)
    challenge = s.planned(1, node0, leader)
    computed = replace(s.answer(node1, challenge), signature=bytes(64))
    entry = {**challenge.reveal(s.answer(node0, challenge), served=computed).body(), "credibility": HONEST}
    itself = {**entry, "served": {**entry["served"], "node": node0}}
    code, log = s.block(s.tx(leader, "submit-results", {"epoch": 1, "kind": "leader", "results": [itself]}))[0]
    assert code == Code.INVALID_FIELD and "names the challenged node itself" in log
    assert s.block(s.tx(leader, "submit-results", {"epoch": 1, "kind": "leader", "results": [entry]})) == [(0, "ok")]
    result = s.state.result(1, node0, leader.public)
    assert result.status == epochs.FAULTY and "serving node's signature" in result.reason
    assert s.faults(leader.public) == ["altered-response"]


@pytest.mark.parametrize("peer", ["a key of no node", "a node of another model"])
def test_a_serving_peer_that_is_no_node_of_the_model_is_not_credited_and_no_fault(s, peer):
    """Whether the key a challenged node names as its serving peer is a registered node of its model, now,
    the member cannot check before it reveals (the node can name a key of its own making, or have its
    peer change model before the reveal): the answer counts against the challenged node, and the
    submitter has no fault."""
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, node1 = list(s.nodes)
    challenge = s.planned(1, node0, leader)
    returned = s.answer(node0, challenge)
    if peer == "a key of no node":
        stranger = KeySet.generate()
        computed = sign_response(stranger, challenge.prompt, list(returned.token_ids), returned.text, "gt",
                                 returned.time, NODE_ADDRESS, returned.temperature, challenge.seed, challenge.top_p)
    else:  # node1 served it, then moved to another model before the reveal
        s.register_model(model_id="other", name="Other")
        computed = s.answer(node1, challenge, time=returned.time - 1)
        changed = s.tx(s.owner, "update-model-node", {"node_pubkey": node1, "model_id": "other"})
        assert s.block(changed) == [(0, "ok")]
    entry = {**challenge.reveal(returned, served=computed).body(), "credibility": 200_000}
    assert s.block(s.tx(leader, "submit-results", {"epoch": 1, "kind": "leader", "results": [entry]})) == [(0, "ok")]
    result = s.state.result(1, node0, leader.public)
    assert result.status == epochs.VALID and result.served_by == b""
    assert result.reason == "the serving node is not a registered node of the challenged node's model: not credited"
    assert s.faults(leader.public) == []


@pytest.mark.faults
def test_skipped_node_is_rechallenged_by_members(s):
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, node1 = list(s.nodes)
    assert s.block(s.tx(leader, "submit-results", s.leader_results(1, HONEST, [node1]))) == [(0, "ok")]
    members = others(s, 1)
    # prompts are written like users' own: paragraph breaks and tabs are part of them
    own = {m.public: Challenge.new(f"Member {i} asks:\n\n\thow do tides work?", TEMPERATURE) for i, m in enumerate(members)}
    commits = [s.tx(m, "commit-rechallenge", {"epoch": 1, "tags": [own[m.public].tag(node0)]})
               for m in members]
    assert all(c == 0 for c, _ in s.block(*commits))
    bell = {**own[members[0].public].reveal(s.answer(node0, own[members[0].public],
                                                               prompt="ring\x07")).body(), "prompt": "ring\x07"}
    refused = s.block(s.tx(members[0], "submit-results", {"epoch": 1, "kind": "rechallenge", "results": [bell]}))
    assert refused == [(Code.INVALID_FIELD, "invalid field: field 'prompt': must not contain control characters "
                                            "other than tab and line breaks")]
    reveals = [s.tx(m, "submit-results", {"epoch": 1, "kind": "rechallenge", "results": [
        own[m.public].reveal(s.answer(node0, own[m.public]))]}) for m in members]
    assert all(c == 0 for c, _ in s.block(*reveals))
    first = min(m.public for m in members)
    assert all(c == 0 for c, _ in s.block(*(tx for m in members for tx in s.attest_txs(
        1, m.public, {node0: 700_000 if m.public == first else HONEST}))))
    assert all(c == 0 for c, _ in s.block(*s.attest_txs(1, leader.public, {node1: HONEST})))
    finish(s, 1)
    assert s.faults(leader.public) == ["skipped-node"]
    assert s.reputation(node0) == expected(700_000)
    assert s.reputation(node1) == expected(HONEST)


@pytest.mark.faults
def test_a_temperature_other_than_the_committed_one_is_the_leaders_fault(s):
    """The temperature decides how an answer is scored, so the node signs the one it was asked for and
    the plan commits it: a leader who asked hotter (to make an honest node look like a weaker model)
    or claims another is caught by the chain."""
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, node1 = list(s.nodes)
    body = s.leader_results(1, HONEST)
    challenge = s.planned(1, node0, leader)
    hotter = s.answer(node0, challenge, temperature=TEMPERATURE + 300)
    body["results"][0] = {**challenge.reveal(hotter).body(), "credibility": HONEST}
    assert s.block(s.tx(leader, "submit-results", body)) == [(0, "ok")]
    result = s.state.result(1, node0, leader.public)
    assert result.status == epochs.FAULTY
    assert result.reason == "the node was asked for temperature 1000, not the committed 700 (thousandths)"
    assert s.faults(leader.public) == ["altered-prompt"]
    assert s.state.result(1, node1, leader.public).status == epochs.VALID


@pytest.mark.parametrize("when", ["before the epoch", "after the block"])
def test_a_response_signed_outside_the_epoch_is_the_submitters_fault(s, when):
    """A leader that reveals an answer the node signed long before the epoch began (asked early, while
    the node served otherwise, or kept from an earlier asking) or one dated after the block it lands
    in is faulted `stale-response`, and the answer counts for nothing; one signed at the window's edge
    is the node's to answer for, and counts."""
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, node1 = list(s.nodes)
    slack = s.h.app.params.response_slack_seconds
    s.block()  # epoch 1's first block, which sets its start time
    body = s.leader_results(1, HONEST)
    start = s.epoch(1).start_time
    block_time = s.h.time + 5  # the next block's (the harness moves 5 s a block)
    outside = start - slack - 1 if when == "before the epoch" else block_time + slack + 1
    for i, (node, time) in enumerate(((node0, outside), (node1, start - slack))):
        challenge = s.planned(1, node, leader)
        body["results"][i] = {**challenge.reveal(s.answer(node, challenge, time=time)).body(),
                              "credibility": HONEST}
    assert s.block(s.tx(leader, "submit-results", body)) == [(0, "ok")]
    stale = s.state.result(1, node0, leader.public)
    assert stale.status == epochs.FAULTY
    assert stale.reason == f"response time {outside} is outside [{start - slack}, {block_time + slack}]"
    assert s.faults(leader.public) == ["stale-response"]
    assert s.state.result(1, node1, leader.public).status == epochs.VALID


def test_a_seed_other_than_the_committed_one_is_the_leaders_fault(s):
    """The seed decides which token is the honest choice at every sampled step, so the node signs the one
    it was asked for and the plan binds it (it is derived from the committed salt): a leader who asked
    with another seed (to make an honest node's answer deviate) is caught by the chain."""
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, node1 = list(s.nodes)
    body = s.leader_results(1, HONEST)
    challenge = s.planned(1, node0, leader)
    other = replace(s.answer(node0, challenge), seed=challenge.seed ^ 1, signature=b"")
    other = replace(other, signature=s.nodes[node0].sign(other.sign_bytes()))
    body["results"][0] = {**challenge.reveal(other).body(), "credibility": HONEST}
    assert s.block(s.tx(leader, "submit-results", body)) == [(0, "ok")]
    result = s.state.result(1, node0, leader.public)
    assert result.status == epochs.FAULTY
    assert result.reason == (f"the node was asked for seed {challenge.seed ^ 1}, not the committed "
                             f"{epochs.challenge_seed(challenge.salt)}")
    assert s.faults(leader.public) == ["altered-prompt"]
    assert s.state.result(1, node1, leader.public).status == epochs.VALID


def test_a_nucleus_other_than_the_committed_one_is_the_leaders_fault(s):
    """top_p decides which tokens may be chosen, so it is committed with the prompt and signed by the
    node: a leader who asked with another nucleus (a narrower one makes an honest answer deviate) is
    caught, and one who reveals another top_p than it committed does not open the commitment."""
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, node1 = list(s.nodes)
    body = s.leader_results(1, HONEST)
    challenge = s.planned(1, node0, leader)
    other = replace(s.answer(node0, challenge), top_p=challenge.top_p - 500, signature=b"")
    other = replace(other, signature=s.nodes[node0].sign(other.sign_bytes()))
    body["results"][0] = {**challenge.reveal(other).body(), "credibility": HONEST}
    assert s.block(s.tx(leader, "submit-results", body)) == [(0, "ok")]
    result = s.state.result(1, node0, leader.public)
    assert result.status == epochs.FAULTY
    assert result.reason == f"the node was asked for top_p {challenge.top_p - 500}, not the committed {challenge.top_p} (thousandths)"
    assert s.faults(leader.public) == ["altered-prompt"]
    assert s.state.result(1, node1, leader.public).status == epochs.VALID


def test_a_revealed_top_p_other_than_the_committed_one_does_not_open_the_commitment(s):
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, _ = list(s.nodes)
    body = s.leader_results(1, HONEST)
    challenge = replace(s.planned(1, node0, leader), top_p=500)
    body["results"][0] = {**challenge.reveal(s.answer(node0, challenge)).body(), "credibility": HONEST}
    assert s.block(s.tx(leader, "submit-results", body)) == [(0, "ok")]
    result = s.state.result(1, node0, leader.public)
    assert result.status == epochs.FAULTY
    assert result.reason == "revealed prompt, temperature, salt and top_p do not match the committed challenge"
    assert s.faults(leader.public) == ["altered-prompt"]


@pytest.mark.faults
def test_a_challenge_hotter_than_one_cannot_be_revealed(s):
    """Above temperature 1 an honest answer scores like a weaker model's: committing to such a
    challenge (here a member's re-challenge) and revealing it makes the member faulty, not the node."""
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, node1 = list(s.nodes)
    assert s.block(s.tx(leader, "submit-results", s.leader_results(1, HONEST, [node1]))) == [(0, "ok")]
    member = others(s, 1)[0]
    hot = Challenge.new("How hot is the sun?", 1_500)
    assert s.block(s.tx(member, "commit-rechallenge", {"epoch": 1, "tags": [hot.tag(node0)]}))[0][0] == 0
    reveal = hot.reveal(s.answer(node0, hot, temperature=1_500))
    assert s.block(s.tx(member, "submit-results", {"epoch": 1, "kind": "rechallenge",
                                                    "results": [reveal]})) == [(0, "ok")]
    result = s.state.result(1, node0, member.public)
    assert result.status == epochs.FAULTY and "above 1000 thousandths" in result.reason
    assert s.faults(member.public) == ["altered-prompt"]
    assert s.state.reports(1, node0) == []


def test_a_sealed_challenge_opens_whole_for_every_member_and_only_in_range(s):
    """Whichever member leads sends the challenge, so each one's sealed copy holds all of it: the text
    to commit, the temperature, the stop strings and stop token ids and, for a chat, the user message; a
    temperature, stop strings or stop token ids no challenge may have are refused on opening."""
    committee = list(members(s.h.store.batch()).values())
    chat = Challenge.new("<|im_start|>user\nWhy?<|im_end|>\n", 0, "Why?", stop=("\n\n", "Question:"),
                         stop_token_ids=(18, 203))
    entry = PlanEntry.from_record(chat.plan_entry(bytes(32), committee).body())
    assert {open_plan_entry(entry, m.public, m.x25519) for m in s.members.values()} == {chat}
    member = next(iter(s.members.values()))
    for bad, refusal in ((Challenge.new("Why?", epochs.MAX_CHALLENGE_TEMPERATURE + 1),
                          "sealed temperature 1001 is not an integer in"),
                         (Challenge.new("Why?", 0, stop=("",)), "sealed stop strings \\[''\\] are not at most 16"),
                         (Challenge.new("Why?", 0, stop=("x" * 257,)), "texts of 1 to 256 characters"),
                         (Challenge.new("Why?", 0, stop=(".",) * 17), "are not at most 16 texts"),
                         (Challenge.new("Why?", 0, stop_token_ids=(2**31,)), "stop token ids \\[2147483648\\] are not"),
                         (Challenge.new("Why?", 0, stop_token_ids=(1,) * 129), "not at most 128 integers")):
        entry = PlanEntry.from_record(bad.plan_entry(bytes(32), committee).body())
        with pytest.raises(SealedPromptError, match=refusal):
            open_plan_entry(entry, member.public, member.x25519)


def test_a_committee_of_twenty_plans_and_every_member_opens_its_challenges(tmp_path):
    """A challenge is encrypted once and only its key sealed to each member: with a copy sealed to each,
    no plan entry fit a transaction past thirteen members, and such a committee planned nothing."""
    s = Script(AppHarness(sqlite_url(tmp_path), members=20, params=EPOCH_PARAMS))
    challenges = s.run_election_and_plan(1)
    assert s.epoch(1).plan_status == epochs.PLAN_COMMITTED and set(challenges) == set(s.nodes)
    for node, challenge in challenges.items():
        assert all(s.planned(1, node, member) == challenge for member in s.members.values())
    committee = [Member(k.public, k.public, bytes(k.vrf.verify_key), bytes(k.x25519.public_key), f"m{i}", 10)
                 for i, k in enumerate(KeySet.generate() for _ in range(100))]
    entry = Challenge.new("Why is the sky blue? " * 40, TEMPERATURE).plan_entry(bytes(32), committee)
    assert len(codec.pack(entry.body())) <= Params().max_tx_bytes - TX_MARGIN_BYTES  # a hundred members


def test_a_challenge_sealed_in_another_layout_is_refused_by_its_version(s):
    """A planner on another release seals fields this member's daemon would misread (a field added,
    moved or dropped): the member refuses the entry naming the layout's version, before reading any
    field, rather than failing on their count or taking one field for another."""
    member = next(iter(s.members.values()))
    committee = list(members(s.h.store.batch()).values())
    good = Challenge.new("Why?", 0)
    fields = [good.prompt, good.salt, good.temperature, good.question, good.max_tokens, [], good.top_p, [], []]

    def sealed(packed_fields: object) -> PlanEntry:
        packed = codec.pack(packed_fields)
        framed = len(packed).to_bytes(4, "big") + packed
        plaintext = framed + bytes(padded_size(len(framed)) - len(framed))
        key = secrets.token_bytes(SecretBox.KEY_SIZE)
        boxes = tuple(sorted((m.operator, SealedBox(PublicKey(m.x25519_key)).encrypt(key)) for m in committee))
        item = PlanItem(bytes(32), good.commitment, boxes, bytes(SecretBox(key).encrypt(plaintext)))
        return PlanEntry.from_record(item.body())

    assert open_plan_entry(sealed([SEALED_VERSION, *fields]), member.public, member.x25519) == good
    refusals = (([SEALED_VERSION + 1, *fields, "new"], "layout version 3; this member reads version 2"),
                ([0, *fields], "layout version 0;"),
                (fields, r"layout version 'Why\?';"),
                ([True, *fields], "layout version True;"),
                ("Why?", "layout version None;"),
                ([SEALED_VERSION, *fields[:-1]], "has 9 fields, not 10"))
    for sealed_fields, refusal in refusals:
        with pytest.raises(SealedPromptError, match=refusal):
            open_plan_entry(sealed(sealed_fields), member.public, member.x25519)


def claiming_no_response(s: Script, number: int, silent: bytes) -> dict:
    """Leader results that answer every node but `silent`, which is claimed to give no response."""
    body = s.leader_results(number, HONEST, [n for n in s.nodes if n != silent])
    body["results"].append({"node": silent, "invalid": "no response within 60 s"})
    return body


@pytest.mark.faults
def test_an_unconfirmed_invalid_report_is_recorded(s):
    """The leader claims no valid response, and members holding more than 2/3 of the power get one: the
    claim is recorded against the leader as an unconfirmed report (the node may have answered it late or
    badly on purpose), which does not count toward the leader's removal."""
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, node1 = list(s.nodes)
    assert s.block(s.tx(leader, "submit-results", claiming_no_response(s, 1, node0))) == [(0, "ok")]
    assert s.state.reports(1, node0) == [leader.public]
    members = others(s, 1)
    own = {m.public: Challenge.new(f"Member {i}: what is a prime number?", TEMPERATURE) for i, m in enumerate(members)}
    assert all(c == 0 for c, _ in s.block(*[
        s.tx(m, "commit-rechallenge", {"epoch": 1, "tags": [own[m.public].tag(node0)]})
        for m in members]))
    assert all(c == 0 for c, _ in s.block(*[
        s.tx(m, "submit-results", {"epoch": 1, "kind": "rechallenge",
                                   "results": [own[m.public].reveal(s.answer(node0, own[m.public]))]})
        for m in members]))
    assert all(c == 0 for c, _ in s.block(*(tx for m in members for tx in s.attest_txs(1, m.public,
                                                                                          {node0: HONEST})),
                                          *s.attest_txs(1, leader.public, {node1: HONEST})))
    finish(s, 1)
    assert s.faults(leader.public) == ["unconfirmed-report"]
    assert s.state.faults_in(leader.public, range(0, 2)) == 0
    assert s.reputation(node0) == expected(HONEST)  # one report (the leader's) is not more than 1/3: not cut


def test_a_leader_whose_planned_challenge_does_not_open_says_so_and_is_not_faulted(s):
    """A planner can seal a node's challenge so that the next leader cannot open it. The leader says so
    (`UNOPENED`) rather than leave the node out (its `skipped-node` fault, for what the planner sealed):
    the claim names no fault of the node and counts as no report, so a planner cannot have an honest
    leader report a node; members re-challenge the node, as for any leader result that is not valid, and
    it is scored on their answers. A claim of no response in other words is a report, as before."""
    node0, node1 = list(s.nodes)
    unopenable_plan(s, node0)
    leader = s.leader(1)
    with pytest.raises(SealedPromptError, match="does not open"):
        s.planned(1, node0, leader)
    body = s.leader_results(1, HONEST, [node1])
    body["results"].append({"node": node0, "invalid": UNOPENED})
    assert s.block(s.tx(leader, "submit-results", body)) == [(0, "ok")]
    assert s.state.reports(1, node0) == []
    members = others(s, 1)
    own = {m.public: Challenge.new(f"Member {i}: what is a prime number?", TEMPERATURE) for i, m in enumerate(members)}
    assert all(c == 0 for c, _ in s.block(*[
        s.tx(m, "commit-rechallenge", {"epoch": 1, "tags": [own[m.public].tag(node0)]}) for m in members]))
    assert all(c == 0 for c, _ in s.block(*[
        s.tx(m, "submit-results", {"epoch": 1, "kind": "rechallenge",
                                   "results": [own[m.public].reveal(s.answer(node0, own[m.public]))]})
        for m in members]))
    assert all(c == 0 for c, _ in s.block(*(tx for m in members for tx in s.attest_txs(1, m.public, {node0: HONEST})),
                                          *s.attest_txs(1, leader.public, {node1: HONEST})))
    finish(s, 1)
    assert s.faults(leader.public) == []  # no skipped-node, no unconfirmed report
    assert s.reputation(node0) == expected(HONEST) and s.reputation(node1) == expected(HONEST)


def test_a_claim_that_the_challenge_did_not_open_counts_as_no_report():
    """The pure rule: with the leader's report, one member's would pass a third of the power and cut the
    node; the leader's `UNOPENED` claim leaves the member's alone, which does not."""
    leader, member, node = b"L" * 32, b"M" * 32, b"N" * 32
    power = {leader: 10, member: 10, b"A" * 32: 10, b"B" * 32: 10}

    def decided(reason: str) -> int | None:
        own = ChallengeResult(node, leader, "leader", epochs.INVALID, reason, "", b"", {}, -1, 5)
        evidence = finalization.Evidence(leader, [node], {node: [own]}, {}, {node: (member,)}, power, 50_000, 10,
                                         frozenset())
        verdicts, _ = finalization.decide(evidence)
        return next((v.credibility for v in verdicts if v.node == node), None)

    assert decided("no response within 60 s") == 0
    assert decided(UNOPENED) is None


@pytest.mark.faults
def test_withheld_results_change_nothing_and_the_next_epoch_proceeds(s):
    s.run_election_and_plan(1)
    leader1 = s.epoch(1).leader
    finish(s, 1)
    assert s.faults(leader1) == ["withheld-results"]
    assert all(s.reputation(n) is None for n in s.nodes)
    assert s.epoch(1).scored == 0
    honest_epoch(s, 2, dict.fromkeys(s.nodes, HONEST))
    assert s.epoch(2).election == "vrf"
    assert [s.reputation(n) for n in s.nodes] == [expected(HONEST)] * 2


@pytest.mark.faults
def test_silent_node_loses_reputation_only_past_a_third_of_the_committee(s):
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, node1 = list(s.nodes)
    assert s.block(s.tx(leader, "submit-results", claiming_no_response(s, 1, node0))) == [(0, "ok")]
    finish(s, 1)
    assert s.reputation(node0) is None  # the leader alone: 1/4 of the power
    leader = s.leader(2)
    reporter = others(s, 2)[0]
    assert all(c == 0 for c, _ in s.block(
        s.tx(leader, "submit-results", claiming_no_response(s, 2, node0)),
        s.tx(reporter, "report-invalid", {"epoch": 2, "node": node0, "reason": "timed out"})))
    code, log = s.block(s.tx(reporter, "report-invalid", {"epoch": 2, "node": node0, "reason": "again"}))[0]
    assert code == Code.ALREADY_EXISTS
    finish(s, 2)
    assert s.reputation(node0) == expected(0)  # 2/4 of the power reported it


@pytest.mark.faults
@pytest.mark.parametrize(("attesting", "finalized"), [(3, True), (2, False)])
def test_offline_members(s, attesting, finalized):
    s.run_election_and_plan(1)
    leader = s.leader(1)
    assert s.block(s.tx(leader, "submit-results", s.leader_results(1, HONEST))) == [(0, "ok")]
    online = [leader, *others(s, 1)][:attesting]
    assert all(c == 0 for c, _ in s.block(*s.attest_txs(1, leader.public, dict.fromkeys(s.nodes, HONEST),
                                                         online)))
    finish(s, 1)
    assert [s.reputation(n) for n in s.nodes] == [expected(HONEST) if finalized else None] * 2


def test_dishonest_node_leaves_the_list_and_honest_node_stays(s):
    node0, node1 = list(s.nodes)
    s.run_election_and_plan(1)
    for number in range(1, 4):
        honest_epoch(s, number, {node0: 100_000, node1: HONEST})
    assert s.reputation(node0) == expected(100_000, 100_000, 100_000) < RULE.untrusted
    assert s.reputation(node1) == expected(HONEST, HONEST, HONEST) >= RULE.untrusted
    assert listed(s) == [node1]
    assert s.state.node(node0).status == "active"  # still registered, still challenged: it may return
    # a fixed node returns once good answers outweigh the abnormal ones in its window
    number = 4
    while not s.state.reputation(node0).trusted:
        honest_epoch(s, number, {node0: 900_000, node1: HONEST})
        number += 1
    assert listed(s) == [node0, node1]
    assert number - 4 == 3


def test_above_max_plan_nodes_the_seed_picks_the_nodes_and_the_leader_cannot(tmp_path):
    """Five nodes, a cap of two: the plan must cover the two whose sha256(seed || key) is lowest, so a
    leader that plans another (one it colludes with, or one it wants left unchecked) is refused."""
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=replace(EPOCH_PARAMS, max_plan_nodes=2)),
               nodes=5)
    s.run_to(s.schedule.setup_height(0))
    s.h.block()  # the record of epoch 1, with its seed
    seed = s.epoch(1).seed
    chosen = sorted(sorted(s.nodes, key=lambda k: hashlib.sha256(seed + k).digest())[:2])
    planner = s.leader(0)
    others = [n for n in s.nodes if n not in chosen]
    refused = s.block(*(s.tx(planner, "commit-plan", s.plan(1, [other, chosen[0]])[0]) for other in others),
                      s.tx(planner, "commit-plan", s.plan(1, chosen[:1])[0]))  # the plan window has 2 blocks left
    assert refused[:-1] == [(Code.INVALID_FIELD, f"invalid field: field 'node': {other.hex()} is not among the "
                                                 f"nodes this plan must cover") for other in others]
    assert refused[-1][0] == Code.INVALID_FIELD and "the plan omits 1 of the 2 node(s) it must cover" in refused[-1][1]
    body, _ = s.plan(1, chosen)
    assert s.block(s.tx(planner, "commit-plan", body)) == [(0, "ok")]
    assert s.epoch(1).plan_status == epochs.PLAN_COMMITTED and s.planned_nodes(1) == chosen


@pytest.mark.faults
def test_a_backup_planner_completes_the_plan_its_leader_left_undone(s):
    """The leader of epoch 0 commits nothing. In the plan window's first half even the backup planner is
    refused; in its last half the backup (one of the others, picked by the epoch's seed) commits the
    plan and any other member is still refused. Epoch 1 is checked as if its leader had planned it, and
    that leader has its `no-plan` fault all the same."""
    s.run_to(s.schedule.setup_height(0))
    s.h.block()  # the record of epoch 1, with its seed
    target = s.epoch(1)
    others = sorted(k for k in s.members if k != target.plan_leader)
    digest = hashlib.sha256(b"planetserve/backup-planner/v1" + target.seed).digest()
    backup = s.members[others[int.from_bytes(digest, "big") % len(others)]]
    bystander = next(s.members[k] for k in others if k != backup.public)
    body, _ = s.plan(1)
    early = s.block(s.tx(backup, "commit-plan", body), s.tx(bystander, "commit-plan", body), *s.vrf_txs(1))
    assert [code for code, _ in early[:2]] == [Code.UNAUTHORIZED] * 2
    assert "its backup planner in the plan window's last half" in early[0][1]
    assert s.schedule.in_backup_plan_window(s.h.height + 1)
    late = s.block(s.tx(bystander, "commit-plan", body), s.tx(backup, "commit-plan", body))
    assert late[0][0] == Code.UNAUTHORIZED and late[1] == (0, "ok")
    assert s.epoch(1).plan_status == epochs.PLAN_COMMITTED and s.planned_nodes(1) == sorted(s.nodes)
    assert s.faults(target.plan_leader) == ["no-plan"]
    honest_epoch(s, 1, dict.fromkeys(s.nodes, HONEST))
    assert [s.reputation(n) for n in s.nodes] == [expected(HONEST)] * 2
    assert s.faults(target.plan_leader) == ["no-plan"]  # once
    assert s.epoch(0).faults == 1  # in the epoch whose leader it was, as its record counts it


def test_without_vrf_the_fallback_leader_is_deterministic(s):
    s.run_to(s.schedule.end(0) + 1)
    epoch = s.epoch(1)
    assert epoch.election == "fallback"
    assert epoch.leader == epochs.fallback_leader(epoch.seed, sorted(s.members))
    assert s.faults(s.epoch(0).leader) == ["no-plan"]
    assert s.epoch(0).faults == 1


def test_refusals(s):
    number = 1
    leader0 = s.leader(0)
    outsider = type(leader0).generate()
    seed_less = s.tx(leader0, "submit-vrf", {"epoch": number, "proof": b"\x00" * 80})
    code, log = s.block(seed_less)[0]
    assert code == Code.EXPIRED and "VRF window" in log
    s.run_to(s.schedule.setup_height(0) + 1)
    member = s.members[sorted(s.members)[1]]
    seed = s.epoch(1).seed
    good = vrf.prove(bytes(member.vrf), seed)
    wrong_alpha = vrf.prove(bytes(member.vrf), seed + b"x")
    body, _ = s.plan(1)
    partial, _ = s.plan(1, list(s.nodes)[:1])
    repeated, _ = s.plan(1)
    repeated["entries"][1]["commitment"] = repeated["entries"][0]["commitment"]
    results = s.block(
        s.tx(member, "submit-vrf", {"epoch": 1, "proof": wrong_alpha}),
        s.tx(member, "submit-vrf", {"epoch": 1, "proof": good}),
        s.tx(member, "submit-vrf", {"epoch": 1, "proof": good}),
        s.tx(outsider, "submit-vrf", {"epoch": 1, "proof": good}),
        s.tx(member if member.public != leader0.public else s.members[sorted(s.members)[2]],
             "commit-plan", body),
        s.tx(leader0, "commit-plan", partial),
        s.tx(leader0, "commit-plan", repeated),
        s.tx(leader0, "commit-plan", {**body, "epoch": 2}),
    )
    codes = [c for c, _ in results]
    assert codes == [Code.INVALID_FIELD, 0, Code.ALREADY_EXISTS, Code.UNAUTHORIZED, Code.UNAUTHORIZED,
                     Code.INVALID_FIELD, Code.ALREADY_EXISTS, Code.EXPIRED], results
    assert "does not verify" in results[0][1]
    assert "omits 1 of the 2 node(s)" in results[5][1]
    assert "repeats" in results[6][1]
    body, challenges = s.plan(1)
    (ok, _), (code, log) = s.block(s.tx(leader0, "commit-plan", body), s.tx(leader0, "commit-plan", body))
    assert ok == 0 and code == Code.ALREADY_EXISTS and "already committed" in log
    s.run_to(s.schedule.start(1))
    leader = s.leader(1)
    node0 = next(iter(s.nodes))
    code, log = s.block(*s.attest_txs(1, leader.public, {node0: HONEST}, [leader]))[0]
    assert code == Code.UNKNOWN_ENTITY
    wrong_model = s.leader_results(1, HONEST, [node0])
    wrong_model["results"][0]["response"] = s.answer(
        node0, challenges[node0], model_id="small").to_record()
    assert s.block(s.tx(leader, "submit-results", wrong_model)) == [(0, "ok")]
    assert s.state.result(1, node0, leader.public).status == epochs.INVALID
    s.run_to(s.schedule.start(1) + EPOCH_PARAMS.results_blocks)
    code, log = s.block(s.tx(leader, "submit-results", s.leader_results(1, HONEST)))[0]
    assert code == Code.EXPIRED and "due before" in log


@pytest.mark.postgres
def test_the_same_epochs_give_the_same_app_hashes_on_postgresql(s, pg_url):
    """Election, plans, an altered prompt, re-challenges, reports, finalizations with trust flips and
    credits, replayed block by block on PostgreSQL."""
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, node1 = list(s.nodes)
    body = s.leader_results(1, 100_000)
    challenge = s.planned(1, node0, leader)
    body["results"][0] = {**challenge.reveal(s.answer(node0, challenge, prompt=challenge.prompt + "!")).body(),
                          "credibility": 1}
    assert s.block(s.tx(leader, "submit-results", body)) == [(0, "ok")]
    members = others(s, 1)
    assert all(c == 0 for c, _ in s.block(*s.attest_txs(1, leader.public, {node1: 100_000}),
                                          s.tx(members[0], "report-invalid",
                                               {"epoch": 1, "node": node0, "reason": "x"})))
    finish(s, 1)
    honest_epoch(s, 2, {node0: HONEST, node1: 200_000})
    assert s.faults(leader.public)[0] == "altered-prompt"
    assert not s.state.reputation(node1).trusted
    pairs = s.h.replay(pg_url)
    assert len(pairs) == s.h.height
    assert all(here == there for here, there in pairs), next(
        i for i, (here, there) in enumerate(pairs, 1) if here != there)


def test_a_new_node_below_the_threshold_is_listed_only_once_it_earns_trust(tmp_path):
    params = replace(EPOCH_PARAMS, initial_reputation_ppm=300_000)
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=params))
    assert listed(s) == []  # registered at 0.3, below the 0.4 threshold
    s.run_election_and_plan(1)
    node0, node1 = list(s.nodes)
    honest_epoch(s, 1, {node0: 1_000_000, node1: 100_000})
    assert listed(s) == [node0]
    assert not s.state.reputation(node1).trusted


def test_a_pipeline_entrys_verdict_is_its_later_stages_too():
    from planetserve.registry.finalization import Verdict, to_pipelines

    entry, middle, last, solo = (bytes([i]) * 32 for i in range(4))
    verdicts = [Verdict(entry, 300_000, "leader:aa"), Verdict(last, 900_000, "leader:aa"),
                Verdict(solo, 0, "invalid-reports")]
    extended = to_pipelines(verdicts, {entry: (middle, last), solo: ()})
    assert extended[:3] == verdicts  # own verdicts stand, first
    assert extended[3:] == [Verdict(middle, 300_000, "leader:aa")]  # last already had its own
    assert to_pipelines(verdicts, {}) == verdicts


def test_an_attestation_cannot_count_more_deviating_tokens_than_the_answer_has(s):
    """The evidence across epochs adds up attested deviations, so a member cannot attest more of them
    than the answer's tokens (3 here); as many as it has are taken."""
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, _ = list(s.nodes)
    assert s.block(s.tx(leader, "submit-results", s.leader_results(1, HONEST))) == [(0, "ok")]
    member = others(s, 1)[0]
    code, log = s.block(*s.attest_txs(1, leader.public, {node0: HONEST}, [member], deviations={node0: 4}))[0]
    assert code == Code.INVALID_FIELD and "4 deviating tokens in an answer of 3" in log
    assert s.block(*s.attest_txs(1, leader.public, {node0: HONEST}, [member], deviations={node0: 3})) == [(0, "ok")]


LONG = replace(EPOCH_PARAMS, epoch_blocks=40, results_blocks=16, vrf_window_blocks=14, plan_window_blocks=14)
"""Epochs of the localnet's length and plan window (the Script proves and plans in one block, so the VRF
window is as long): the setup height at offset 26, the last eight blocks from offset 32."""


def test_results_revealed_before_the_epochs_last_eight_blocks_must_be_attested(tmp_path):
    """Members' re-challenges run into the closing windows (until the next epoch's take over), so every
    result revealed before the epoch's last `ATTEST_BLOCKS` blocks must be attested: one that members
    holding more than 2/3 of the power left unattested is each other present member's
    `withheld-attestation`, revealed after the setup height or not; one revealed in the last eight is not.
    Where the closing windows are shorter than that, the setup height stays the deadline."""
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=LONG), nodes=1)
    (node,) = s.nodes
    s.run_election_and_plan(1)
    leader = s.leader(1)
    assert s.block(s.tx(leader, "submit-results", s.leader_results(1, HONEST))) == [(0, "ok")]
    assert all(c == 0 for c, _ in s.block(*s.attest_txs(1, leader.public, {node: HONEST})))
    early, late, bystander = others(s, 1)
    own = {m.public: Challenge.new(f"{i}: why do leaves fall?", TEMPERATURE) for i, m in enumerate((early, late))}
    assert all(c == 0 for c, _ in s.block(*(s.tx(m, "commit-rechallenge", {"epoch": 1, "tags": [own[m.public].tag(node)]})
                                            for m in (early, late))))
    deadline = s.schedule.attest_before(1)
    assert s.schedule.offset(deadline) == 32 and deadline - s.schedule.setup_height(1) == 6

    def reveal(member, height: int) -> None:
        """`member`'s re-challenge revealed at `height`, attested by itself and the leader only."""
        s.run_to(height)
        challenge = own[member.public]
        assert s.block(s.tx(member, "submit-results", {"epoch": 1, "kind": "rechallenge", "results": [
            challenge.reveal(s.answer(node, challenge)).body()]})) == [(0, "ok")]
        assert all(c == 0 for c, _ in s.block(*s.attest_txs(1, member.public, {node: HONEST}, [member, leader])))

    s.run_to(s.schedule.setup_height(1))
    s.h.block()  # the setup block creates the record of epoch 2, whose plan and leader come next
    plan_txs, _ = s.plan_txs(2)
    assert all(c == 0 for c, _ in s.block(*plan_txs, *s.vrf_txs(2)))
    reveal(early, deadline - 2)  # after the setup height, before the last eight blocks
    reveal(late, deadline)
    s.run_to(s.schedule.start(2) + 1)
    assert s.epoch(1).finalized
    assert s.faults(bystander.public) == ["withheld-attestation"]
    assert s.faults(late.public) == ["withheld-attestation"]  # for the early one, not for its own
    assert s.faults(early.public) == [] and s.faults(leader.public) == []
    defaults, short = epochs.Schedule.from_params(Params()), epochs.Schedule.from_params(EPOCH_PARAMS)
    assert defaults.offset(defaults.attest_before(3)) == 92 and defaults.attest_before(3) == defaults.end(3) - 7
    assert short.attest_before(1) == short.setup_height(1)
