"""A model node that records every request exactly as it arrives (after the overlay) and tries to tell
the committee's challenges from users' requests, so that it can serve challenges honestly and
everything else cheaply (docs/threat-model.md, "Recognising challenges").

Users' programs write their requests as programs do (the openai client with `user` and `metadata`, or
hand-built JSON with its own key order, spacing and number spelling), streamed or not, chat or
completion, continuing sessions; challenges go through the verifier's own channel. The first test runs
both through a real relay to a recording model node and asserts one encoding, one key set per form and
a session id on everything. The second draws thousands of each, puts them through the same relay
code, and trains a classifier on what the node sees: it must do no better than chance."""

from __future__ import annotations

import asyncio
import json
import random
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import replace

import httpx
import numpy as np
import pytest
from modelnodes import make_node
from openai import AsyncOpenAI
from overlaynet import start_apart
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.metrics import roc_auc_score
from waiting import run

from planetserve import workloads
from planetserve.chain.challenge import response_valid
from planetserve.models import load
from planetserve.node.api.openai import (
    ApiError,
    Endpoint,
    canonical_body,
    parse_json_body,
    parse_request,
    parse_request_body,
)
from planetserve.node.model_node import ModelNode
from planetserve.node.sessions import new_session_id
from planetserve.node.user import relayed_body, taken_request
from planetserve.registry.epochs import SEED_BITS
from planetserve.verifier import ReferenceModel
from planetserve.verifier.challenges import RUN, ChallengeSource, to_challenge
from planetserve.verifier.overlay import OverlayChannel, request_body

SCALE = 0.05
MAX_PROMPT = 256
CAP = 64
SEED_KEY = bytes(32)
"""The relay's seed key in the simulated arrivals (any key: the node never learns it)."""
SESSION = re.compile(r"[0-9a-f]{32}")
Encode = Callable[[str], Sequence[int]]
SPELLED: Encode = {"\n": [203], ".": [18], "\n\n": [203, 203], "Question:": [53, 89, 417, 288, 30]}.__getitem__
"""How the simulated arrivals spell the workload's stop strings in a model's tokens (gt's): users' programs and the
channel alike."""


class RecordingNode(ModelNode):
    """A model node that keeps every request exactly as the overlay delivers it, then serves it."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.arrived: list[tuple[Endpoint, bytes]] = []
        respond = self.gateway.respond

        async def recording(endpoint: Endpoint, body: bytes):  # type: ignore[no-untyped-def]
            self.arrived.append((endpoint, body))
            return await respond(endpoint, body)

        self.gateway.respond = recording


def users(count: int, seed: int, fits, per_seed: int = RUN) -> list[workloads.Request]:  # type: ignore[no-untyped-def]
    """What users of this network ask: the workload with its follow-ups, prompts that fit the model.
    Each group of `per_seed` users draws from its own generator, as each challenge draw does (one
    seed fixes the prefixes' lengths, so one seed for everyone would be one user's whole world)."""
    drawn = [replace(r, session=r.session and f"{start}-{r.session}") for start in range(0, count, per_seed)
             for r in workloads.generate("mixed", rate=1.0, count=min(per_seed, count - start), seed=seed + start,
                                         scale=SCALE, followup=workloads.FOLLOWUP_SHARE)]
    return [r for r in drawn if fits(r.text)]


def program_body(request: workloads.Request, style: int, encode: Encode) -> dict:
    """A request as one of two programs writes it: one passes `user`, `metadata` and a fixed seed, the other spells
    temperature 0 as an integer, adds `n: 1` and orders its keys its own way."""
    body: dict = {"model": "gt", "max_tokens": request.max_tokens, "temperature": request.temperature,
                  "stream": request.stream}
    if request.top_p < 1:
        body["top_p"] = request.top_p
    if request.chat:
        body["messages"] = [{"role": "user", "content": request.text}]
    else:
        body["prompt"] = request.text
    if request.logprobs is not None:
        body |= ({"logprobs": True, "top_logprobs": request.logprobs} if request.chat
                 else {"logprobs": request.logprobs})
    stop, stop_ids = workloads.stop_fields(request.stop, request.stop_as_ids, encode)
    if stop:  # one program writes a single stop string as OpenAI's API allows, as a string
        body["stop"] = stop[0] if style == 0 and len(stop) == 1 else list(stop)
    if stop_ids:
        body["stop_token_ids"] = list(stop_ids)
    if request.session is not None:
        body["planetserve"] = {"session_id": f"program-{request.session}"}
    if style == 0:
        body |= {"user": "alice@example.org", "metadata": {"app": "notes-7"}, "seed": 42}
    else:
        body = {"n": 1, **dict(reversed(list(body.items())))}
        if body["temperature"] == 0:
            body["temperature"] = 0
    return body


LOGPROBS_KEYS = {"chat": {"logprobs", "top_logprobs"}, "completions": {"logprobs"}}
"""What a request asking for log-probabilities adds, by form (a tenth of requests, on both sides)."""
OPTIONAL = {"stop", "stop_token_ids"}
"""What a request ending at stop strings adds (a tenth of requests, on both sides)."""


def shape(endpoint: str, raw: bytes) -> tuple:
    """A request's form and key set, less the log-probability keys (each form's own, or none) and the
    stop strings."""
    body = json.loads(raw)
    asked = LOGPROBS_KEYS[endpoint] & body.keys()
    assert asked in (set(), LOGPROBS_KEYS[endpoint]), body.keys()
    return (endpoint, body["stream"], tuple(sorted(body.keys() - asked - OPTIONAL)),
            tuple(sorted(body["planetserve"])))


async def send_as_program(client: AsyncOpenAI, request: workloads.Request, style: int, encode: Encode) -> None:
    body = program_body(request, style, encode)
    if style == 1:  # a program that writes its own JSON
        path = "chat/completions" if request.chat else "completions"
        async with httpx.AsyncClient(timeout=120) as http:
            response = await http.post(f"{client.base_url}{path}", content=json.dumps(body, indent=1).encode(),
                                       headers={"content-type": "application/json"})
        assert response.status_code == 200, response.text
        return
    passed_through = ("planetserve", "stop_token_ids") if request.chat else ("planetserve", "metadata", "stop_token_ids")
    extra = {k: body.pop(k) for k in passed_through if k in body}
    create = client.chat.completions.create if request.chat else client.completions.create
    answer = await create(**body, extra_body=extra or None)
    if request.stream:
        async for _ in answer:
            pass


def test_challenges_arrive_as_users_requests_do(quick_family):
    async def main():
        node = make_node(quick_family, RecordingNode)
        net = await start_apart([node])
        try:
            fits = lambda text: len(node.tokenizer(text)["input_ids"]) <= MAX_PROMPT  # noqa: E731
            encode = lambda text: node.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
            asked = users(90, 11, fits)[:60]
            async with AsyncOpenAI(base_url=f"{net.client.http_url}/v1", api_key="unused", timeout=120) as client:
                for i in range(0, len(asked), 4):
                    await asyncio.gather(*(send_as_program(client, r, j % 2, encode)
                                           for j, r in enumerate(asked[i:i + 4], start=i)))
            from_users = list(node.arrived)
            channel = OverlayChannel(net.client.http_url, timeout=120, max_tokens=CAP)
            source = ChallengeSource("mixed", scale=SCALE, max_prompt_len=MAX_PROMPT,
                                     length=lambda text: len(node.tokenizer(text)["input_ids"]))
            challenges = [to_challenge(d, node.tokenizer.apply_chat_template(
                [{"role": "user", "content": d.text}], tokenize=False, add_generation_prompt=True)
                if d.chat else None, CAP, encode) for d in source.draw(60)]
            for i in range(0, len(challenges), 4):
                await asyncio.gather(*(asyncio.to_thread(channel.ask, node.keys.public, "gt", c)
                                       for c in challenges[i:i + 4]))
            from_challenges = node.arrived[len(from_users):]
            # one asking for log-probabilities, as a tenth do: the node reports them and signs its answer
            for chat in (False, True):
                drawn = next(d for d in source.draw(32) if d.chat == chat and not d.earlier)
                rendered = node.tokenizer.apply_chat_template([{"role": "user", "content": drawn.text}], tokenize=False,
                                                              add_generation_prompt=True) if chat else None
                asking = replace(channel, logprobs_share=1.0)
                reply = await asyncio.to_thread(asking.ask, node.keys.public, "gt", to_challenge(drawn, rendered, CAP))
                assert response_valid(reply.response) and reply.response.token_ids
                assert "logprobs" in json.loads(node.arrived[-1][1])
            # one ending at stop strings, as a tenth do: the answer ends where it must (there, or at a stop token),
            # and checks
            reference = ReferenceModel.from_loaded(load("gt", quick_family), model_id="gt")
            [dot], [newline] = reference.encode("."), reference.encode("\n")  # one token each
            for as_ids, sent in ((False, {"stop": [".", "\n"]}), (True, {"stop_token_ids": [dot, newline]})):
                drawn = next(d for d in source.draw(32) if not d.chat and not d.earlier)
                stopping = to_challenge(replace(drawn, stop=(".", "\n"), stop_as_ids=as_ids, temperature=0.7), None,
                                        CAP, reference.encode)
                reply = await asyncio.to_thread(channel.ask, node.keys.public, "gt", stopping)
                arrived = json.loads(node.arrived[-1][1])
                assert {key: arrived[key] for key in OPTIONAL & arrived.keys()} == sent
                assert reference.ending(stopping, reply.response) == ""
                assert reference.verify_one(reply.response, stopping.prompt).ok
        finally:
            await net.close()

        everything = [*from_users, *from_challenges]
        # one encoding: what arrives is the canonical form of what it asks, whoever wrote it
        assert all(raw == canonical_body(parse_request(endpoint, raw)) for endpoint, raw in everything)
        assert not any(b"alice" in raw or b"notes-7" in raw or b"program-" in raw for _, raw in everything)
        # one key set per form (chat or completion, streamed or not), on both sides
        assert {shape(*a) for a in from_users} == {shape(*a) for a in from_challenges}
        assert len({shape(*a) for a in from_users}) == 4
        # every request carries a session id of the relay's; continued sessions keep theirs
        sessions = [json.loads(raw)["planetserve"]["session_id"] for _, raw in everything]
        assert all(SESSION.fullmatch(s) for s in sessions)
        user_turns = [r for r in asked if r.session is not None]
        assert len({s for s in sessions[:len(from_users)]}) == len(asked) - len(user_turns) + \
            len({r.session for r in user_turns})
        earlier = sum(len(c.earlier) for c in challenges)
        assert earlier > 0 and len(from_challenges) == len(challenges) + earlier
        assert len(set(sessions[len(from_users):])) == len(challenges)

    run(main(), timeout=900)


def arrivals_of_users(count: int, seed: int) -> list[tuple[str, bytes]]:
    """What the node receives for users' requests, through the relay's own encoding (the first test
    shows the overlay delivers exactly that); a continued session keeps the relay's id for it."""
    relay_sessions: dict[str, str] = {}
    out = []
    for i, request in enumerate(users(count, seed, lambda text: pieces(text) <= MAX_PROMPT)):
        endpoint = "chat" if request.chat else "completions"
        body = program_body(request, i % 2, SPELLED)
        _, parsed = taken_request(endpoint, parse_json_body(json.dumps(body).encode()), SEED_KEY)
        key = request.session or new_session_id()
        session = relay_sessions.setdefault(key, new_session_id())
        out.append((endpoint, relayed_body(parsed, "gt", session)))
    return out


def arrivals_of_challenges(count: int) -> list[tuple[str, bytes]]:
    """What the node receives for challenges: the channel's requests (a follow-up's first turn too),
    through the same relay encoding, under the session the channel names."""
    source = ChallengeSource("mixed", scale=SCALE, max_prompt_len=MAX_PROMPT, length=pieces)
    out = []
    for drawn in (d for _ in range(0, count, 8) for d in source.draw(8)):
        challenge = to_challenge(drawn, f"<rendered>{drawn.text}" if drawn.chat else None, CAP, SPELLED)
        chat, stream = bool(challenge.question), random.random() < workloads.STREAM_SHARE  # noqa: S311
        logprobs = random.randrange(workloads.MAX_TOP_LOGPROBS + 1)  # noqa: S311 - as the channel draws
        logprobs = logprobs if random.random() < workloads.LOGPROBS_SHARE else None  # noqa: S311
        session = new_session_id()
        turns = challenge.turns()
        for turn, text in enumerate(turns, start=1):
            seed = None if turn == len(turns) else random.getrandbits(SEED_BITS)
            body = request_body("gt", challenge, text, chat, stream, {"node": "ab" * 32}, seed, logprobs)
            endpoint = "chat" if chat else "completions"
            out.append((endpoint, relayed_body(taken_request(endpoint, body, SEED_KEY)[1], "gt", session)))
    return out


def pieces(text: str) -> int:
    return len(workloads.tokenize(text))


def features(arrivals: list[tuple[str, bytes]]) -> np.ndarray:
    """Everything a node can read off a request: its form, sampling (its nucleus, and its seed's value and size too),
    output cap, the log-probabilities and stop strings it asks for, lengths, key set, and whether its session or
    seed was seen before (and how often)."""
    seen: dict[str, int] = {}
    seeds: dict[int, int] = {}
    rows = []
    for endpoint, raw in arrivals:
        body = json.loads(raw)
        text = body["messages"][0]["content"] if endpoint == "chat" else body["prompt"]
        session = body["planetserve"]["session_id"]
        rows.append([endpoint == "chat", body["stream"], body["temperature"], body.get("top_p", 1.0),
                     body["max_tokens"], len(text), len(raw), len(body), seen.get(session, 0), body["seed"],
                     body["seed"].bit_length(), seeds.get(body["seed"], 0), "logprobs" in body,
                     body.get("top_logprobs", body.get("logprobs", -1)), bool(OPTIONAL & body.keys()),
                     zlib.crc32(json.dumps([body.get(key) for key in sorted(OPTIONAL)]).encode())])
        seeds[body["seed"]] = seeds.get(body["seed"], 0) + 1
        seen[session] = seen.get(session, 0) + 1
    return np.array(rows, dtype=float)


LOGPROBS_COLUMN = 12
"""The features' column that says whether a request asks for log-probabilities."""
STOP_COLUMN = 14
"""The features' column that says whether a request ends at stop strings (or stop token ids)."""


def test_a_classifier_tells_challenges_from_users_no_better_than_chance():
    random.seed(7)
    challenge_rows = features(arrivals_of_challenges(2500))
    user_rows = features(arrivals_of_users(4000, 21))
    x = np.vstack([user_rows, challenge_rows])
    y = np.concatenate([np.zeros(len(user_rows)), np.ones(len(challenge_rows))])
    # a request asking for log-probabilities is a challenge as often as any (none was, once)
    # and so is one ending at stop strings (none was, once)
    for column in (LOGPROBS_COLUMN, STOP_COLUMN):
        asking = x[:, column] == 1
        assert asking.sum() > 400 and abs(y[asking].mean() - y.mean()) < 0.08, (column, asking.sum(), y[asking].mean())
    order = np.random.default_rng(3).permutation(len(y))
    x, y = x[order], y[order]
    half = len(y) // 2
    model = HistGradientBoostingClassifier(max_iter=200, random_state=0).fit(x[:half], y[:half])
    auc = roc_auc_score(y[half:], model.predict_proba(x[half:])[:, 1])
    assert 0.45 <= auc <= 0.55, f"AUC {auc:.3f}: the node tells challenges apart"
    # the classifier is able to: told the cap a challenge used to ask (64), it finds them at once
    marked = x.copy()
    marked[y == 1, 4] = CAP  # the output cap's column
    marked_model = HistGradientBoostingClassifier(max_iter=200, random_state=0).fit(marked[:half], y[:half])
    assert roc_auc_score(y[half:], marked_model.predict_proba(marked[half:])[:, 1]) > 0.9


def test_the_relays_encoding_keeps_what_a_request_asks_and_drops_the_rest():
    """Nothing a request asks is lost in re-encoding (every field the API reads comes back the same),
    and two programs that ask the same thing in different spellings send the same bytes."""
    asks = [
        ("completions", {"model": "gt", "prompt": "Why?", "max_tokens": 7, "temperature": 0.7, "seed": 5,
                         "stop": ["\n", "."], "stop_token_ids": [3], "ignore_eos": True, "return_token_ids": True,
                         "prompt_logprobs": 2, "planetserve": {"session_id": "s1", "no_forward": True}}),
        ("completions", {"model": "gt", "prompt": [5, 6, 7], "stream": True,
                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
        ("chat", {"model": "gt", "messages": [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": [{"type": "text", "text": "Hi"}],
                                               "name": "ann"},
                                              {"role": "assistant", "content": "Hel"}],
                  "max_completion_tokens": 9, "add_generation_prompt": False, "continue_final_message": True}),
        ("chat", {"model": "gt", "messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                  "top_logprobs": 4, "return_tokens_as_token_ids": True}),
        ("chat", {"model": "gt", "messages": [{"role": "user", "content": "Hi"}], "logprobs": True}),
        ("completions", {"model": "gt", "prompt": "Why?", "logprobs": 0, "stream": True}),
    ]
    for endpoint, body in asks:
        request = parse_request_body(endpoint, dict(body))
        assert parse_request(endpoint, canonical_body(request)) == request
    plain = {"model": "gt", "prompt": "Why?", "max_tokens": 7, "temperature": 0.0}
    fancy = {"user": "bob", "metadata": {"k": "v"}, "n": 1, "temperature": 0, "top_p": 1, "max_tokens": 7,
             "prompt": "Why?", "model": "gt", "store": False, "service_tier": "auto",
             "return_tokens_as_token_ids": True}  # without logprobs it changes nothing
    encoded = {canonical_body(parse_request(e, json.dumps(b, indent=2).encode()))
               for e, b in [("completions", plain), ("completions", fancy)]}
    assert len(encoded) == 1 and b"bob" not in next(iter(encoded))
    chat = {"model": "gt", "messages": [{"role": "user", "content": "Hi"}]}
    neutral = {**chat, "logprobs": False, "top_logprobs": 0}
    assert len({canonical_body(parse_request_body("chat", dict(b))) for b in (chat, neutral)}) == 1


def test_the_relay_takes_out_its_own_fields_and_sets_every_seed():
    """`planetserve.node` and `planetserve.seed` are the relay's alone: taken out, never sent on, and
    refused clearly when malformed. A program's seed is keyed with the request, so its rerun reproduces
    while another request under the same seed gets another; a request without one gets a fresh one; a
    member's exact seed passes unchanged."""
    key = bytes(32)

    def taken(body: dict) -> tuple:
        named, request = taken_request("completions", json.loads(json.dumps(body)), key)
        return named, request.seed, json.loads(canonical_body(request))

    ask = {"model": "gt", "prompt": "Why?", "seed": 42}
    named, seed, sent = taken({**ask, "planetserve": {"node": "ab" * 32, "seed": 7, "session_id": "s1"}})
    assert named == bytes.fromhex("ab" * 32) and seed == 7
    assert sent["planetserve"] == {"session_id": "s1"} and sent["seed"] == 7
    keyed = taken(ask)[1]
    assert keyed == taken(ask)[1] != 42 and 0 <= keyed < 1 << SEED_BITS
    assert taken({**ask, "prompt": "How?"})[1] != keyed
    assert taken({**ask, "seed": None})[1] != taken({**ask, "seed": None})[1]
    for options, message in (({"node": "xy"}, "`planetserve.node` must be a model node's key as 64 hex digits."),
                             ({"seed": -1}, f"`planetserve.seed` must be an integer in [0, 2**{SEED_BITS})."),
                             ({"seed": True}, f"`planetserve.seed` must be an integer in [0, 2**{SEED_BITS}).")):
        with pytest.raises(ApiError) as refused:
            taken({**ask, "planetserve": options})
        assert refused.value.message == message and refused.value.param == f"planetserve.{next(iter(options))}"
