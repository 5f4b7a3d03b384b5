"""A model node that signs what it was not asked (another temperature, or another time), so that its
answer, revealed, makes the honest member who submits it faulty (docs/threat-model.md, "Framing the
challenger"): the member's daemon checks what the node signed before it reveals, and claims no valid
response instead; the node's answer is never revealed against the member."""

from __future__ import annotations

import time

import pytest

from planetserve.chain.challenge import Challenge, response_extension, sign_response
from planetserve.chain.keys import KeySet
from planetserve.chain.messages.epochs import Unanswered
from planetserve.registry.entities import ModelNode
from planetserve.verifier import daemon as daemon_module
from planetserve.verifier.daemon import SIGNED_TIME_TOLERANCE_S, Daemon
from planetserve.verifier.overlay import OverlayChannel

ASKED = 700


def asked(relay, tmp_path, node: KeySet, signed_temperature: int, signed_time: int):
    """What the member's daemon makes of the node's answer to its challenge at temperature 0.7."""
    response = sign_response(node, "Why?", [5, 6], "Light.", "gt", signed_time, "h:1", signed_temperature)
    relay.body = {"choices": [{"text": "Light."}], "planetserve": response_extension(response)}
    registered = ModelNode(node.public, "org", "gt", "h:1", "cpu", 1, "eu", "active", 0)
    daemon = Daemon(KeySet.generate(), None, {}, OverlayChannel(relay.url), None, tmp_path, attempts=2)
    daemon._ask((1, node.public, "leader"), Challenge.new("Why?", ASKED), registered)
    done = daemon.pending[1, node.public, "leader"].result(timeout=30)
    return daemon, done


@pytest.mark.parametrize(("temperature", "skew", "reason"), [
    (1_000, 0, "the node signed temperature 1, it was asked 0.7"),
    (ASKED, -3_600, "the node signed time"),
    (ASKED, SIGNED_TIME_TOLERANCE_S + 30, "s from its answer"),
])
def test_an_answer_signed_otherwise_is_claimed_invalid_not_revealed(relay, tmp_path, monkeypatch, temperature,
                                                                    skew, reason):
    monkeypatch.setattr(daemon_module, "RETRY_DELAY_S", 0.0)
    node = KeySet.generate()
    daemon, done = asked(relay, tmp_path, node, temperature, int(time.time()) + skew)
    assert done.reply is None and reason in done.failure and done.failure.startswith("2 attempts")
    entry = daemon._entry(1, done, "leader")
    assert isinstance(entry, Unanswered) and entry.node == node.public and reason in entry.invalid


def test_an_answer_signed_as_asked_is_revealed(relay, tmp_path):
    node = KeySet.generate()
    _, done = asked(relay, tmp_path, node, ASKED, int(time.time()))
    assert done.reply is not None and done.reply.response.temperature == ASKED
