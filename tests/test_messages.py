"""Typed transaction messages: every type has a handler, every message survives the wire, and a body
read from the network is checked field by field before any handler sees it."""

from __future__ import annotations

import re

import pytest
from harness import CHAIN_ID

from planetserve.chain.abci.handlers import HANDLERS
from planetserve.chain.keys import KeySet
from planetserve.chain.messages import (
    MESSAGES,
    Attest,
    CommitPlan,
    CommitRechallenge,
    DeployModel,
    Heartbeat,
    ProposeMember,
    ProposeParams,
    ProposeUpgrade,
    RegisterModel,
    RegisterModelNode,
    RegisterOrg,
    RegisterUser,
    ReportInvalid,
    RotateMemberKey,
    RotateNodeKey,
    SubmitResults,
    SubmitVrf,
    UpdateModelNode,
    VoteMember,
    decode,
)
from planetserve.chain.messages.epochs import PlanItem, Revealed, Served, Unanswered
from planetserve.chain.tx import decode as decode_tx
from planetserve.chain.tx import sign
from planetserve.registry import codec
from planetserve.registry.epochs import SignedResponse
from planetserve.registry.errors import InvalidField

KEY = bytes(range(32))
SIG = bytes(64)
RESPONSE = SignedResponse(KEY, bytes(32), (1, 2, 3), "hi", "gt", 700, 2**64 - 1, 1_700_000_000, "10.0.0.1:7000", SIG)
EXAMPLES = [
    RegisterOrg("acme", "ACME"),
    RegisterUser("10.0.0.1:9000", "eu"),
    Heartbeat(),
    Heartbeat(region="us"),
    RegisterModel("gt", "GT"),
    RegisterModel("big", "Big", layers=32, layer_mib=512),
    RegisterModelNode.signed(CHAIN_ID, "acme", KeySet.generate(), model_id="gt", address="10.0.0.1:7000",
                             hardware="cpu", capacity=2, region="eu"),
    UpdateModelNode(KEY, status="inactive", gflops=5),
    ProposeMember("add", KEY, KEY, KEY, KEY, "University X", 10),
    ProposeMember("remove", KEY),
    VoteMember(3, False),
    ProposeParams(500, {"max_signer_txs": 40, "user_ttl_seconds": 900}),
    ProposeUpgrade("v2", 2, 600),
    RotateNodeKey.signed(CHAIN_ID, "acme", KeySet.generate(), KeySet.generate()),
    RotateMemberKey.signed(CHAIN_ID, KEY, KeySet.generate(), KeySet.generate().identity),
    RotateMemberKey.signed(CHAIN_ID, KEY, None, KeySet.generate().identity),
    SubmitVrf(2, bytes(80)),
    CommitPlan(2, (PlanItem(KEY, bytes(32), ((KEY, bytes(80)),), bytes(1_064)),), final=True),
    CommitPlan(2, (), final=True),
    SubmitResults(1, "leader", (Revealed(KEY, "why?", bytes(32), 700, RESPONSE, credibility=5,
                                         served=Served(bytes(32), 5, "10.0.0.2:7000", SIG)),
                                Unanswered(bytes(32), "timed out"))),
    SubmitResults(1, "rechallenge", (Unanswered(KEY, "timed out", bytes(32)),)),
    SubmitResults(1, "rechallenge", (Revealed(KEY, "why?", bytes(32), 0, RESPONSE),)),
    Attest(1, ((KEY, KEY, 1000, 3),)),
    ReportInvalid(1, KEY, "no answer"),
    CommitRechallenge(1, (bytes(32), bytes(range(32)))),
    DeployModel("acme", "gt", "cpu", 2, 3600),
]


def test_every_message_type_has_one_handler_and_every_handler_a_message():
    assert set(HANDLERS) == set(MESSAGES.values())
    assert {type(m) for m in EXAMPLES} == set(MESSAGES.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.TYPE)
def test_a_message_survives_signing_and_decoding(msg):
    keys = KeySet.generate()
    tx = decode_tx(sign(keys, CHAIN_ID, msg, 0), 1 << 20)
    assert (tx.type, tx.signer) == (msg.TYPE, keys.public) and tx.signature_valid()
    assert decode(tx.type, tx.body) == msg
    assert codec.pack(decode(tx.type, tx.body).body()) == codec.pack(msg.body())


def test_optional_fields_are_left_out_of_the_body():
    assert Heartbeat(region="us").body() == {"region": "us"}
    assert ProposeMember("remove", KEY).body() == {"action": "remove", "operator": KEY}
    assert set(SubmitResults(1, "rechallenge", (Revealed(KEY, "p", bytes(32), 0, RESPONSE),)).body()
               ["results"][0]) == {"node", "prompt", "salt", "temperature", "response", "top_p"}


@pytest.mark.parametrize(("tx_type", "body", "error"), [
    ("register-org", {"org_id": "acme"}, "field 'name': missing"),
    ("register-org", {"org_id": "acme", "name": "A", "x": 1}, "field 'x': unknown field"),
    ("heartbeat", {"address": "nowhere"}, "field 'address': must be host:port"),
    ("register-model", {"model_id": "m", "name": "n", "layers": 2}, "needs both layers and layer_mib"),
    ("propose-member", {"action": "remove", "operator": KEY, "power": 1}, "field 'power': unknown field"),
    ("propose-member", {"action": "add", "operator": KEY}, "field 'consensus_key': missing"),
    ("vote-member", {"proposal_id": 1, "approve": 1}, "field 'approve': must be true or false"),
    ("commit-plan", {"epoch": 1, "entries": [], "final": False}, "field 'entries'"),
    ("commit-plan", {"epoch": 1, "entries": [{"node": KEY, "commitment": KEY, "sealed": [[KEY, b"x"]],
                                               "ciphertext": bytes(1_064)}], "final": True},
     "sealed key of 80 B"),
    ("commit-plan", {"epoch": 1, "entries": [{"node": KEY, "commitment": KEY, "sealed": [[KEY, bytes(80)]],
                                               "ciphertext": bytes(40)}], "final": True},
     "encrypted challenge of 41..8232 B"),
    ("commit-plan", {"epoch": 1, "entries": [{"node": KEY, "commitment": KEY, "sealed": [[KEY, bytes(80)]]}],
                     "final": True}, "field 'ciphertext': missing"),
    ("submit-results", {"epoch": 1, "kind": "rechallenge", "results": [
        {**Revealed(KEY, "p", bytes(32), 0, RESPONSE).body(), "credibility": 1}]},
     "field 'credibility': unknown field"),
    ("submit-results", {"epoch": 1, "kind": "leader", "results": [
        Revealed(KEY, "p", bytes(32), 0, RESPONSE).body()]}, "the leader proposes a credibility"),
    ("submit-results", {"epoch": 1, "kind": "leader", "results": [
        Revealed(KEY, "p", bytes(32), 0, RESPONSE, 1, Served.of(RESPONSE)).body()]},
     "names the challenged node itself"),
    ("attest", {"epoch": 1, "scores": [[KEY, KEY]]}, "entries must be [node, submitter, credibility, deviations]"),
    ("commit-rechallenge", {"epoch": 1, "tags": []}, "field 'tags': must be a list of 1..1000 entries"),
    ("commit-rechallenge", {"epoch": 1, "tags": [KEY, b"short"]}, "field 'tags': must be tags of 32 bytes"),
    ("commit-rechallenge", {"epoch": 1, "tags": [KEY, KEY]}, "field 'tags': must not repeat a tag"),
    ("commit-rechallenge", {"epoch": 1, "tag": KEY}, "field 'tags': missing"),
    ("deploy-model", {"org_id": "a", "model_id": "m", "hardware": "cpu", "nodes": 0, "seconds": 60},
     "field 'nodes': must be an integer"),
])
def test_a_malformed_body_is_refused_naming_its_field(tx_type, body, error):
    with pytest.raises(InvalidField, match=re.escape(error)):
        decode(tx_type, body)
