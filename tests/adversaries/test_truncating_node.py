"""A model node that stops generating early: it returns the first tokens of the honest answer, each the
honest choice, and saves the work of the rest. Token by token such an answer checks, so the asker looks
at its end: an answer with fewer tokens than the cap it asked for must end with a stop token of the
model. The member's daemon claims a cut answer invalid (members' re-challenges meet it too, and their
reports cut the node's C(T), as for a framing node), while an honest node's answers, which stop only at
a stop token or at the cap, are revealed."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from modelnodes import complete, make_node, signed, view
from relaystandin import relay  # noqa: F401 - the fixture
from waiting import run

from planetserve.chain.challenge import Challenge, response_extension, sign_response
from planetserve.chain.keys import KeySet
from planetserve.chain.messages.epochs import Unanswered
from planetserve.models import load
from planetserve.node.model_node import ModelNode
from planetserve.registry.entities import ModelNode as NodeRecord
from planetserve.registry.epochs import SignedResponse
from planetserve.verifier import ReferenceModel
from planetserve.verifier import daemon as daemon_module
from planetserve.verifier.daemon import Daemon
from planetserve.verifier.overlay import OverlayChannel

PROMPT = "Write a long story about a dragon who paints the sky, in many sentences."
CUT = 3


class TruncatingNode(ModelNode):
    """Generates at most CUT tokens of every answer it serves itself, whatever the request's cap."""

    def _local(self, job, prompt_ids, generation, route_reason):
        return super()._local(job, prompt_ids, replace(generation, max_tokens=min(CUT, generation.max_tokens)),
                              route_reason)


@pytest.fixture(scope="module")
def gt(quick_family):
    return load("gt", quick_family)


CAPS = (2, 24)


@pytest.fixture(scope="module")
def served(quick_family) -> dict[str, list[SignedResponse]]:
    """An honest and a truncating model node's signed answers to PROMPT, one per output cap in CAPS."""
    async def main() -> dict[str, list[SignedResponse]]:
        nodes = {"honest": make_node(quick_family), "cut": make_node(quick_family, TruncatingNode)}
        for node in nodes.values():
            await node.start()
            node.apply_view(view([node]))
        try:
            return {name: [signed((await complete(node, PROMPT, max_tokens=cap, temperature=0.7, seed=5)).json())
                           for cap in CAPS] for name, node in nodes.items()}
        finally:
            for node in nodes.values():
                await node.close()
                await node.engine.close()
    return run(main())


def test_an_answer_cut_before_its_cap_without_a_stop_token_is_told_from_a_whole_one(served, gt):
    stops = gt.stop_token_ids
    reference = ReferenceModel.from_loaded(gt)
    for cap, response in zip(CAPS, served["honest"], strict=True):
        # honest: the cap reached, or a stop token last
        assert len(response.token_ids) == cap or response.token_ids[-1] in stops
        assert reference.ending(Challenge.new(PROMPT, 700, max_tokens=cap), response) == ""
    short, cut = served["cut"]
    assert len(short.token_ids) == 2 and len(cut.token_ids) == CUT and cut.token_ids[-1] not in stops
    assert reference.ending(Challenge.new(PROMPT, 700, max_tokens=2), short) == ""
    assert reference.ending(Challenge.new(PROMPT, 700, max_tokens=24), cut) == (
        f"the answer stops after {CUT} of the 24 tokens asked, without a stop token")


def test_the_members_daemon_claims_a_cut_answer_invalid_and_reveals_a_whole_one(relay, tmp_path, monkeypatch,  # noqa: F811
                                                                               served, gt):
    monkeypatch.setattr(daemon_module, "RETRY_DELAY_S", 0.0)
    reference = ReferenceModel.from_loaded(gt)
    assert reference.stop_ids == gt.stop_token_ids and reference.stop_ids
    cut, whole = served["cut"][1], served["honest"][1]
    for response, invalid in ((cut, "stops after 3 of the 24 tokens asked"), (whole, "")):
        node = KeySet.generate()
        challenge = Challenge.new(PROMPT, 700, max_tokens=24)
        # the node's answer, re-signed by this node for the challenge's prompt, seed and time
        signed_now = sign_response(node, PROMPT, list(response.token_ids), response.text, "gt", int(time.time()),
                                   "h:1", 700, challenge.seed)
        relay.body = {"choices": [{"text": response.text}], "planetserve": response_extension(signed_now)}
        registered = NodeRecord(node.public, "org", "gt", "h:1", "cpu", 1, "eu", "active", 0)
        daemon = Daemon(KeySet.generate(), None, {"gt": reference}, OverlayChannel(relay.url), None,
                        tmp_path / node.public.hex(), attempts=2)
        daemon._ask((1, node.public, "leader"), challenge, registered)
        done = daemon.pending[1, node.public, "leader"].result(timeout=30)
        if invalid:
            entry = daemon._entry(1, done, "leader")
            assert done.reply is None and isinstance(entry, Unanswered) and invalid in entry.invalid
        else:
            assert done.reply is not None and done.failure == ""
