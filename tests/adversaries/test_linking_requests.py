"""Adversaries that try to link one user's requests (docs/threat-model.md, "Links one user's requests"):
a real model node that logs every clove and prompt it gets from two users, and every relay of the
overlay logging, as a first relay and as a proxy, the bytes it carries so that a first relay and a proxy
can collude by comparing them. Both users send their requests through their real relays over TLS, as a
program would (`UserRelay.respond`). What they record is scored by bench/linkability.py's rules: a pair
of requests is linked by a field when a value of it occurs in both, and by bytes when 31 bytes handled
at a proxy for each occur in what a first relay exchanged with one user."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field

import pytest
from overlaynet import make_user, start_overlay
from waiting import run

from bench.linkability import MODEL_FIELDS, Observations, pair_shares, record_gateway, record_relay, rows

REQUESTS = 3
"""Requests per user: 3 pairs of one user's requests per user, 9 pairs of two users'."""


@dataclass
class Seen:
    obs: Observations
    links: dict[int, set[bytes]] = field(default_factory=dict)
    """Per request, the link ids of the sender's paths it went out over (the sender's own view)."""


async def observe(data) -> Seen:  # type: ignore[no-untyped-def]
    obs = Observations()
    seen = Seen(obs)
    net = await start_overlay(data, [make_user() for _ in range(7)], 1)
    try:
        record_gateway(net.nodes[0].gateway, obs)
        senders = net.users[:2]
        by_key = {u.keys.public: u for u in senders}
        for user in net.users:
            record_relay(user.relay, user.keys.public, by_key, obs)
        for user in senders:
            def use(paths, original=user.paths.use):  # type: ignore[no-untyped-def]
                seen.links.setdefault(obs.current, set()).update(p.link for p in paths)
                original(paths)
            user.paths.use = use
        assert await senders[1].paths.wait_live(senders[1].paths.settings.target, 20)
        for index in range(2 * REQUESTS):
            user = senders[index % 2]
            obs.current, obs.users[index] = index, user.keys.public
            body = {"model": "gt", "messages": [{"role": "user", "content": "Who wrote this?"}], "max_tokens": 2,
                    "temperature": 0}
            reply = await user.respond("chat", json.dumps(body).encode())
            assert reply.status == 200
            async for _ in reply.parts:
                pass
    finally:
        await net.close()
    return seen


@pytest.fixture(scope="module")
def seen(quick_family) -> Seen:  # type: ignore[no-untyped-def]
    return run(observe(quick_family), timeout=120)


@pytest.fixture(scope="module")
def observed(seen) -> Observations:  # type: ignore[no-untyped-def]
    return seen.obs


def test_a_model_node_cannot_link_two_requests_of_one_user(observed):
    assert len(observed.fields) == 2 * REQUESTS, "every request reached the node's log"
    table = {name: (same, other) for adversary, name, same, other in rows(observed) if adversary == "model node"}
    for name in MODEL_FIELDS:
        (linked, pairs), _ = table[name]
        assert pairs == 2 * 3 and linked == 0, f"{name} links {linked} of {pairs} pairs of one user's requests"
    # what every request shares, whoever sent it
    assert table["n and k"] == ((6, 6), (9, 9))
    # the proxies the prompt names for the answer are the peers that delivered its cloves
    assert all(observed.fields[r]["proxies"] == {p for s in observed.fields[r]["proxy set"] for p in s}
               for r in observed.users)


def test_every_request_goes_out_over_paths_no_earlier_request_used(seen):
    """What keeps a model node from linking a user's requests by their proxies: each request's paths are
    fresh, their proxies drawn as if the last request's paths were gone (bench/linkability.py measures
    that one user's pairs of requests then share proxies as often as two users' do). With reused paths
    every request of a user came through the same proxies."""
    assert sorted(seen.links) == list(range(2 * REQUESTS)) and all(len(v) == 4 for v in seen.links.values())
    for a, b in itertools.combinations(seen.links, 2):
        assert not seen.links[a] & seen.links[b], f"requests {a} and {b} shared a path"


def test_a_colluding_first_relay_and_proxy_cannot_match_a_payload_by_its_bytes(observed):
    assert all(observed.proxy[r] for r in observed.users) and observed.first, "both adversaries saw traffic"
    assert not any(observed.attributed(r) for r in observed.users), "a payload was matched by its bytes"
    same, other = pair_shares(observed.users, lambda a, b: bool(observed.attributed(a) & observed.attributed(b)))
    assert same[0] == other[0] == 0


async def back_to_back(data) -> list[int]:  # type: ignore[no-untyped-def]
    """How many paths each of two requests went out over, the second sent at once after the first: a
    user keeping seven paths has three live left, while the first request's replacements are held in
    setup (slow relays) until the second was sent."""
    import asyncio
    from dataclasses import replace

    net = await start_overlay(data, [make_user() for _ in range(7)], 1)
    try:
        user = net.users[0]
        user.paths.settings = replace(user.paths.settings, target=7)
        assert await user.paths.wait_live(7, 20)
        build, slow = user.paths.build, asyncio.Event()

        async def slow_relays(replacing=None):  # type: ignore[no-untyped-def]
            await slow.wait()
            return await build(replacing)

        user.paths.build = slow_relays
        used: list[int] = []
        use = user.paths.use
        user.paths.use = lambda paths: (used.append(len(paths)), use(paths))  # type: ignore[method-assign]
        body = json.dumps({"model": "gt", "messages": [{"role": "user", "content": "Who wrote this?"}],
                           "max_tokens": 2, "temperature": 0}).encode()

        async def ask() -> None:
            reply = await user.respond("chat", body)
            assert reply.status == 200
            async for _ in reply.parts:
                pass

        await ask()
        assert user.config.k <= len(user.paths.live()) < user.config.n
        second = asyncio.create_task(ask())
        await asyncio.sleep(0.3)
        slow.set()
        await second
        return used
    finally:
        await net.close()


def test_a_request_right_after_another_waits_for_n_paths_rather_than_going_over_fewer(quick_family):
    """A request over fewer paths than n would stand out to the model node by the n of its prompt (the
    "n and k" row above) and lose the slack of a lost path."""
    assert run(back_to_back(quick_family), timeout=120) == [4, 4]


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TOPICS = ["the list type", "dictionaries", "file handling"]


async def chat_turn(user, messages: list[dict], stream: bool) -> str:  # type: ignore[no-untyped-def]
    """The assistant's text of one chat turn through `user`'s relay, streamed or not."""
    body = {"model": "gt", "messages": messages, "max_tokens": 3, "temperature": 0, "stream": stream}
    reply = await user.respond("chat", json.dumps(body).encode())
    raw = b"".join([part async for part in reply.parts]).decode()
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"]
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


@pytest.mark.parametrize("stream", [False, True])
def test_a_model_node_cannot_link_conversations_that_open_alike_by_their_session_id(quick_family, stream):
    """A program opens three conversations alike (a system prompt and "Hi!", answered greedily, so
    identically) and continues each on its own topic. Keyed by their opening, all three went to one
    node under one session id, which linked them to one user (20 of 20 pairs in the review's run, none
    across users). Now each first turn starts a session of its own, and a follow-up keeps the session of
    the conversation whose answer the relay delivered: no two conversations share an id, and each
    conversation's turns do."""

    async def main() -> list[tuple[str, str]]:
        net = await start_overlay(quick_family, [make_user() for _ in range(6)], 2)
        seen: list[str] = []
        for node in net.nodes:
            respond = node.gateway.respond

            async def recorded(endpoint, body, respond=respond):  # type: ignore[no-untyped-def]
                seen.append(json.loads(body)["planetserve"]["session_id"])
                return await respond(endpoint, body)

            node.gateway.respond = recorded
        try:
            turns = []
            for topic in TOPICS:
                opening = [SYSTEM, {"role": "user", "content": "Hi!"}]
                answer = await chat_turn(net.client, opening, stream)
                await chat_turn(net.client, [*opening, {"role": "assistant", "content": answer},
                                             {"role": "user", "content": f"Tell me about {topic}."}], stream)
                turns.append((seen[-2], seen[-1]))
            return turns
        finally:
            await net.close()

    turns = run(main(), timeout=120)
    assert all(first == follow_up for first, follow_up in turns)  # a conversation keeps its node's cache
    assert len({first for first, _ in turns}) == len(TOPICS)  # no two conversations share an id
