"""A model node that cheats only on requests that carry stop strings, where no challenge used to go: it
ends such an answer after a few tokens, as if a stop string had come (less work), or signs a stop
string's tokens after a few of its own. Challenges now ask for stop strings as often as users' programs
do (`workloads.STOP_SHARE`, from the same pool), and the member that sends one checks where the answer
ended (`ReferenceModel.ending`): an early end is claimed invalid; forged stop tokens are the node's own
signed tokens, which scoring finds deviating. An honest node's answers, whose text ends before the stop
string and whose ids do not, check and score clean."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest
from modelnodes import complete, make_node, signed, view
from relaystandin import relay  # noqa: F401 - the fixture
from waiting import run

from planetserve import workloads
from planetserve.chain.challenge import Challenge, response_extension, sign_response
from planetserve.chain.keys import KeySet
from planetserve.chain.messages.epochs import Revealed, Unanswered
from planetserve.models import load
from planetserve.node.model_node import ModelNode
from planetserve.registry.entities import ModelNode as NodeRecord
from planetserve.verifier import ReferenceModel
from planetserve.verifier import daemon as daemon_module
from planetserve.verifier.daemon import Daemon
from planetserve.verifier.overlay import OverlayChannel

PROMPT = "Write a long story about a dragon who paints the sky, in many sentences."
STOP = (".",)
CAP = 48
CUT = 2
TEMPERATURE = 700
SALTS = 64
"""Salts tried, in order, for one whose seed's honest answer reaches a stop string: for most seeds quick
gt reaches a stop token first, and which ones reach "." depends on the weights, which differ with the CPU
the family was trained on."""


class EarlyStopNode(ModelNode):
    """Ends every answer to a request with stop strings or stop token ids after CUT tokens, as if one
    had come; answers every other request honestly, since those are the ones challenges used to be."""

    def _local(self, job, prompt_ids, generation, route_reason):
        if job.stop or job.stop_ids:
            generation = replace(generation, max_tokens=min(CUT, generation.max_tokens))
        return super()._local(job, prompt_ids, generation, route_reason)


@pytest.fixture(scope="module")
def reference(quick_family) -> ReferenceModel:
    return ReferenceModel.from_loaded(load("gt", quick_family), model_id="gt")


def salt(i: int) -> bytes:
    return hashlib.sha256(f"stop-{i}".encode()).digest()


@pytest.fixture(scope="module")
def stop_ids(reference) -> tuple[int, ...]:
    """The stop string as a token id, as a quarter of programs send theirs."""
    stop, ids = workloads.stop_fields(STOP, True, reference.encode)
    assert stop == () and len(ids) == 1
    return ids


@pytest.fixture(scope="module")
def served(quick_family, reference, stop_ids) -> dict:
    """The first challenge (by salt) whose honest answer ends at its stop string and, without it, goes on
    past it; the honest and the early-stopping node's signed answers to it, with its stop strings, with
    them as token ids, and without either; and the early node's keys."""
    async def ask(node: ModelNode, challenge: Challenge, stops: dict):
        answer = await complete(node, PROMPT, max_tokens=CAP, temperature=TEMPERATURE / 1000,
                                seed=challenge.seed, **stops)
        assert answer.status_code == 200, answer.text
        return signed(answer.json())

    async def first_stopping(node: ModelNode) -> Challenge:
        for i in range(SALTS):
            challenge = Challenge(PROMPT, salt(i), TEMPERATURE, max_tokens=CAP, stop=STOP)
            stopped = await ask(node, challenge, {"stop": list(STOP)})
            text = reference.tokenizer.decode(list(stopped.token_ids), skip_special_tokens=True)
            if text.endswith(STOP[0]) and len(stopped.token_ids) < CAP \
                    and len((await ask(node, challenge, {})).token_ids) > len(stopped.token_ids):
                return challenge
        pytest.fail(f"none of {SALTS} seeds has quick gt's answer reach {STOP[0]!r} and go on past it "
                    f"within {CAP} tokens")

    async def main() -> dict:
        nodes = {"honest": make_node(quick_family), "early": make_node(quick_family, EarlyStopNode)}
        for node in nodes.values():
            await node.start()
            node.apply_view(view([node]))
        try:
            challenge = await first_stopping(nodes["honest"])
            answers: dict = {"challenge": challenge, "keys": nodes["early"].keys}
            for name, node in nodes.items():
                for asked, stops in ((True, {"stop": list(STOP)}), ("ids", {"stop_token_ids": list(stop_ids)}),
                                     (False, {})):
                    answers[name, asked] = await ask(node, challenge, stops)
            return answers
        finally:
            for node in nodes.values():
                await node.close()
                await node.engine.close()
    return run(main())


@pytest.fixture(scope="module")
def challenge(served) -> Challenge:
    return served["challenge"]


@pytest.fixture(scope="module")
def by_id(challenge, stop_ids) -> Challenge:
    """The challenge with its stop string sent as a token id."""
    return replace(challenge, stop=(), stop_token_ids=stop_ids)


def test_an_honest_answer_ends_at_its_stop_string_and_scores_clean(served, reference, challenge):
    honest = served["honest", True]
    decoded = reference.tokenizer.decode(list(honest.token_ids), skip_special_tokens=True)
    # the ids go through the stop string, the signed text stops before it
    assert decoded.endswith(".") and "." not in honest.text and decoded.startswith(honest.text)
    assert len(honest.token_ids) < CAP and reference.ending(challenge, honest) == ""
    verdict = reference.verify_one(honest, PROMPT)
    assert verdict.ok and verdict.deviations == 0
    # judged as an answer to the same request without its stop string, it ends too early
    assert reference.ending(replace(challenge, stop=()), honest) == (
        f"the answer stops after {len(honest.token_ids)} of the {CAP} tokens asked, without a stop token")
    # and an answer that ignored the stop string goes on past it
    whole = served["honest", False]
    assert whole.token_ids[:len(honest.token_ids)] == honest.token_ids
    assert reference.ending(challenge, whole).startswith(
        f"the answer goes on for {len(whole.token_ids) - len(honest.token_ids)} tokens past its stop string")


def test_an_answer_ended_early_where_a_stop_string_was_asked_is_caught(served, reference, challenge):
    early, unasked = served["early", True], served["early", False]
    assert unasked.token_ids == served["honest", False].token_ids  # honest where no stop string is asked
    assert reference.ending(replace(challenge, stop=()), unasked) == ""
    assert len(early.token_ids) == CUT
    assert reference.ending(challenge, early) == (
        f"the answer stops after {CUT} of the {CAP} tokens asked, without a stop token or stop string")


def test_stop_token_ids_end_an_answer_as_the_models_own_stop_tokens_do(served, reference, by_id):
    honest, early = served["honest", "ids"], served["early", "ids"]
    # the honest answer ends at the stop token id, as the answer to the stop string did
    assert honest.token_ids == served["honest", True].token_ids and honest.token_ids[-1] in by_id.stop_token_ids
    assert reference.ending(by_id, honest) == "" and reference.verify_one(honest, PROMPT).ok
    assert reference.ending(replace(by_id, stop_token_ids=()), honest) == (
        f"the answer stops after {len(honest.token_ids)} of the {CAP} tokens asked, without a stop token")
    assert len(early.token_ids) == CUT and reference.ending(by_id, early) == (
        f"the answer stops after {CUT} of the {CAP} tokens asked, without a stop token")


def test_a_forged_stop_string_is_the_nodes_own_deviating_tokens(served, reference, challenge):
    honest = served["honest", True]
    stop_ids = reference.tokenizer.encode(STOP[0], add_special_tokens=False)
    ids = [*honest.token_ids[:CUT], *stop_ids]
    assert ids != list(honest.token_ids[:len(ids)])  # not where the model would have stopped
    text = reference.tokenizer.decode(ids[:CUT], skip_special_tokens=True)
    forged = sign_response(served["keys"], PROMPT, ids, text, "gt", honest.time, honest.address, TEMPERATURE,
                           challenge.seed)
    assert reference.ending(challenge, forged) == ""  # it does end at its stop string
    verdict = reference.verify_one(forged, PROMPT)
    assert verdict.ok and verdict.deviations >= 1


def test_a_text_cut_short_with_no_stop_string_is_caught_by_the_asker(served, reference, challenge):
    """Scorers, who do not know a challenge's stop strings, accept a text that ends before its tokens'
    text does; the member that sent the challenge does not, where no stop string cut it."""
    whole = served["honest", False]
    short = sign_response(served["keys"], PROMPT, list(whole.token_ids), whole.text[:-3], "gt", whole.time,
                          whole.address, TEMPERATURE, challenge.seed)
    assert reference.verify_one(short, PROMPT).ok
    assert reference.ending(replace(challenge, stop=()), short) == (
        f"the signed text has {len(whole.text) - 3} characters where its tokens' text, whole, has "
        f"{len(whole.text)}")


def test_the_members_daemon_sends_the_stop_strings_and_claims_an_early_end_invalid(
        relay, tmp_path, monkeypatch, served, reference, challenge):  # noqa: F811
    monkeypatch.setattr(daemon_module, "RETRY_DELAY_S", 0.0)
    member = KeySet.generate()
    for response, invalid in ((served["early", True], f"stops after {CUT} of the {CAP} tokens asked"),
                              (served["honest", True], "")):
        relay.body = {"choices": [{"text": response.text}], "planetserve": response_extension(response)}
        registered = NodeRecord(response.node, "org", "gt", response.address, "cpu", 1, "eu", "active", 0)
        daemon = Daemon(member, None, {"gt": reference}, OverlayChannel(relay.url), None,
                        tmp_path / response.node.hex(), attempts=1)
        try:
            daemon._ask((1, response.node, "leader"), challenge, registered)
            done = daemon.pending.pop((1, response.node, "leader")).result(timeout=30)
        finally:
            daemon.pool.shutdown(wait=False)
        assert relay.received[-1]["stop"] == list(STOP)
        if invalid:
            entry = daemon._entry(1, done, "leader")
            assert done.reply is None and isinstance(entry, Unanswered) and invalid in entry.invalid
        else:
            assert done.reply is not None and done.failure == ""
            assert isinstance(challenge.reveal(done.reply.response), Revealed)
