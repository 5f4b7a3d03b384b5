"""A model node that signs answers no honest engine gives (token ids outside the vocabulary, a text that is
not the detokenisation of its ids, more tokens than the model's context holds), to be paid for answers it
never computed. Its own signature proves the fault: the member's daemon reveals the answer and stands
behind a credibility of 0 for it, which is what it attests and, as leader, proposes."""

from __future__ import annotations

import time

import pytest
from relaystandin import relay  # noqa: F401 - the fixture

from planetserve.chain.challenge import Challenge, response_extension, sign_response
from planetserve.chain.keys import KeySet
from planetserve.chain.messages.epochs import Revealed
from planetserve.models import load
from planetserve.registry.entities import ModelNode
from planetserve.verifier import ReferenceModel
from planetserve.verifier.daemon import Daemon
from planetserve.verifier.overlay import OverlayChannel

PROMPT = "Why is the sky blue?"


class Registry:
    """The one registered node, read as the daemon reads the ledger's record of the node it scores."""

    def __init__(self, record: ModelNode) -> None:
        self.record = record

    def node(self, key: bytes) -> ModelNode | None:
        return self.record if key == self.record.pubkey else None


@pytest.fixture(scope="module")
def reference(quick_family) -> ReferenceModel:
    return ReferenceModel.from_loaded(load("gt", quick_family), model_id="gt")


def malformed(reference: ReferenceModel, kind: str) -> tuple[list[int], str]:
    """Token ids and text of an answer of `kind`, ending at the challenge's cap so it is not cut short."""
    good = reference.tokenizer.encode(" Because light scatters.", add_special_tokens=False)[:4]
    text = reference.tokenizer.decode(good, skip_special_tokens=True)
    if kind == "invalid_token_id":
        return [*good[:3], reference.vocab_size + 7], text
    if kind == "tokenization_mismatch":
        return good, text + " and a passage the ids do not hold"
    stop = reference.stop_ids[0]
    return [stop] * reference.max_len, reference.tokenizer.decode([stop] * reference.max_len,
                                                                   skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["invalid_token_id", "tokenization_mismatch", "too_long"])
def test_an_answer_no_engine_gives_is_revealed_and_scored_zero(relay, tmp_path, reference, kind):  # noqa: F811
    ids, text = malformed(reference, kind)
    node, member = KeySet.generate(), KeySet.generate()
    challenge = Challenge.new(PROMPT, 700, max_tokens=len(ids))
    response = sign_response(node, PROMPT, ids, text, "gt", int(time.time()), "h:1", 700, challenge.seed)
    relay.body = {"choices": [{"text": text}], "planetserve": response_extension(response)}
    registered = ModelNode(node.public, "org", "gt", "h:1", "cpu", 1, "eu", "active", 0)
    daemon = Daemon(member, Registry(registered), {"gt": reference}, OverlayChannel(relay.url), None, tmp_path,
                    attempts=1)
    try:
        daemon._ask((1, node.public, "leader"), challenge, registered)
        asked = daemon.pending.pop((1, node.public, "leader")).result(timeout=60)
    finally:
        daemon.pool.shutdown(wait=False)
    assert asked.reply is not None, asked.failure
    verdict = reference.verify_one(asked.reply.response, PROMPT)
    assert verdict.rejection is not None and verdict.rejection.value == kind and verdict.rejection.node_fault
    entry = daemon._entry(1, asked, "leader")
    assert isinstance(entry, Revealed) and entry.credibility == 0
    assert daemon.scores[1, node.public, member.public] == (0, 0)
