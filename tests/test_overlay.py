"""The anonymous overlay end to end on loopback: 12 user relays and 4 model nodes (built-in engine over
the quick gt), every link real TLS. A program talks to the client relay's OpenAI endpoint; its prompts
reach model nodes as cloves over onion-built paths and the answers come back the same way, through
relay deaths, too many dead paths, and relays that corrupt or drop what they carry. A request may name its model node, trusted or only
registered, as the committee's challenges do."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import replace

import httpx
import pytest
from crosssite import allowed, apost, attacks, check_refusal
from modelnodes import signed
from openai import AsyncOpenAI
from overlaynet import FAST, chat, faulty, make_user, record, relays_on_one_path, start_overlay
from waiting import run, until

from planetserve.chain.challenge import ANSWERED_BY
from planetserve.node.api.openai import ApiError
from planetserve.node.home import HomeError, UserConfig
from planetserve.node.overlay import onion, sida
from planetserve.node.overlay.directory import DirectoryView
from planetserve.node.overlay.messages import MAX_MESSAGE, Part, Prompt, sent_now
from planetserve.node.user import MAX_ANSWER_BYTES, MAX_PARTS_AHEAD, Exchange, path_settings

RELAYS = 12
MODEL_NODES = 4


async def overlay(data, relays: int = RELAYS, model_nodes: int = MODEL_NODES, untrusted: int = 0):
    return await start_overlay(data, [faulty(make_user()) for _ in range(relays)], model_nodes, untrusted)


def events(text: str) -> list[dict]:
    lines = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", f"stream did not end with [DONE]: {text[-300:]}"
    return [json.loads(line) for line in lines[:-1]]


async def stream_until_first_chunk(client: httpx.AsyncClient, url: str, body: dict):
    """Open a streamed request and return it once its first event has arrived."""
    request = client.build_request("POST", url, json=body)
    response = await client.send(request, stream=True)
    chunks = response.aiter_text()
    first = ""
    while "data: " not in first:
        first += await anext(chunks)
    return response, chunks, first


def test_relays_learn_only_their_neighbours(quick_family):
    async def main():
        net = await overlay(quick_family, model_nodes=1)
        try:
            client = net.client
            links, keys = set(), set()
            for path in client.paths.live():
                first, middle, proxy = (net.user(k).relay for k in path.route)
                (hop1,) = [h for h in first.hops if h.pred == client.keys.public and h.in_id == path.link]
                assert hop1.succ == path.route[1] and hop1.key == path.hop_keys[0]
                (hop2,) = [h for h in middle.hops if h.pred == path.route[0] and h.in_id == hop1.out_id]
                assert hop2.succ == path.route[2] and hop2.key == path.hop_keys[1]
                (hop3,) = [h for h in proxy.hops if h.pred == path.route[1] and h.in_id == hop2.out_id]
                assert hop3.succ is None and hop3.key == path.key and not hop3.replies
                links |= {path.link, hop1.out_id, hop2.out_id}
                keys |= {hop1.key, hop2.key, hop3.key}
            assert len(links) == 3 * len(client.paths.live()), "link ids must differ on every link"
            assert len(keys) == 3 * len(client.paths.live()), "keys must differ on every hop"
            # only first hops ever see the client's key; nobody stores anything else about it
            for user in net.users[1:]:
                for hop in user.relay.hops:
                    assert client.keys.public not in (hop.succ,)
                    if hop.pred == client.keys.public:
                        assert any(p.first == user.keys.public and p.link == hop.in_id
                                   for p in client.paths.live())
        finally:
            await net.close()

    run(main())


def test_a_prompt_arrives_and_the_answer_streams_back(quick_family):
    async def main():
        net = await overlay(quick_family)
        try:
            answer = await chat(net.client, "What does the json module do?")
            assert answer.status_code == 200, answer.text
            assert answer.headers[ANSWERED_BY] == "node"  # whose words: the relay's own are "relay"
            body = answer.json()
            response = signed(body)  # signed by a listed model node, over exactly this text
            server = next(n for n in net.nodes if n.keys.public == response.node)
            async with httpx.AsyncClient(timeout=60) as http:
                direct = (await http.post(f"{server.http_url}/v1/chat/completions", json={
                    "model": "gt", "messages": [{"role": "user", "content": "What does the json module do?"}],
                    "max_tokens": 8, "temperature": 0, "planetserve": {"no_forward": True}})).json()
            assert body["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
            streamed = await chat(net.client, "What does the json module do?", stream=True)
            parts = events(streamed.text)
            assert parts[-1]["choices"][0]["finish_reason"] is not None
            assert "".join(p["choices"][0]["delta"].get("content", "") for p in parts) == \
                body["choices"][0]["message"]["content"]
            assert parts[-1]["planetserve"]["node"] in {n.keys.public.hex() for n in net.nodes}
            # follow-ups of one conversation go to the node that holds its cache
            first = await chat(net.client, "Name a module for dates.")
            history = [{"role": "user", "content": "Name a module for dates."},
                       {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                       {"role": "user", "content": "And for times?"}]
            async with httpx.AsyncClient(timeout=60) as http:
                follow = await http.post(f"{net.client.http_url}/v1/chat/completions", json={
                    "model": "gt", "messages": history, "max_tokens": 4})
            assert follow.json()["planetserve"]["node"] == first.json()["planetserve"]["node"]
            assert sum(n.gateway.counters["prompts"] for n in net.nodes) == 4
            # the relays carried it all without a single public-key operation after setup (once the
            # paths that replace the used ones, built as each answer began, are up)
            assert await net.client.paths.wait_live(net.client.paths.settings.target, 10)
            assert sum(u.relay.counters["setups"] for u in net.users) == 3 * net.client.paths.counters["built"]
        finally:
            await net.close()

    run(main())


def test_the_endpoint_answers_bad_requests_with_specific_errors(quick_family):
    async def main():
        net = await overlay(quick_family, relays=6, model_nodes=1)
        try:
            url = net.client.http_url
            async with httpx.AsyncClient(timeout=60) as http:
                models = (await http.get(f"{url}/v1/models")).json()
                assert [m["id"] for m in models["data"]] == ["gt"]
                assert (await http.get(f"{url}/health")).json()["ok"] is True
                unknown = await http.post(f"{url}/v1/chat/completions", json={
                    "model": "llama-70b", "messages": [{"role": "user", "content": "hi"}]})
                assert unknown.status_code == 404
                assert unknown.json()["error"]["code"] == "model_not_found"
                assert "served models: gt" in unknown.json()["error"]["message"]
                garbled = await http.post(f"{url}/v1/completions", content=b"{not json",
                                          headers={"content-type": "application/json"})
                assert garbled.status_code == 400 and garbled.json()["error"]["code"] == "invalid_json"
                huge = await http.post(f"{url}/v1/completions", content=b"x" * (5 << 20),
                                       headers={"content-type": "application/json"})
                assert huge.status_code == 413
                too_long = await http.post(f"{url}/v1/completions", json={
                    "model": "gt", "prompt": "word " * 2000, "max_tokens": 4})
                assert too_long.status_code == 413  # refused by the model node, relayed as it answered
                assert too_long.json()["error"]["code"] == "prompt_too_long"
            assert (await chat(net.client, "Still there?")).status_code == 200
        finally:
            await net.close()

    run(main())


def test_the_endpoint_refuses_other_sites_pages_and_sends_them_nowhere(quick_family):
    """What a web page can make the user's browser send to the relay's endpoint (another site's fetch or
    form, a page re-pointing its DNS name at 127.0.0.1, a simple-request body) is refused in OpenAI's shape,
    and no prompt leaves the relay; the openai client, programs and the endpoint's own origin are answered
    through the overlay as before."""

    async def main():
        net = await overlay(quick_family, relays=5, model_nodes=1)
        node, url = net.nodes[0], net.client.http_url
        body = {"model": "gt", "messages": [{"role": "user", "content": "What does the os module do?"}],
                "max_tokens": 2, "temperature": 0}
        error = {"message", "type", "param", "code"}
        try:
            async with httpx.AsyncClient(timeout=60) as http:
                before = (dict(net.client.counters), node.gateway.counters["prompts"])
                for attack in attacks(url):
                    for path in ("/v1/chat/completions", "/v1/completions"):
                        check_refusal(await apost(http, f"{url}{path}", body, attack), attack, error)
                    if attack.reads:
                        for path in ("/v1/planetserve/status", "/v1/models", "/health"):
                            check_refusal(await http.get(f"{url}{path}", headers=attack.headers), attack, error)
                assert (dict(net.client.counters), node.gateway.counters["prompts"]) == before  # nothing sent
                for name, headers in allowed(url):
                    answer = await http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
                    assert answer.status_code == 200, (name, answer.text)
                    signed(answer.json())
                    assert (await http.get(f"{url}/v1/planetserve/status", headers=headers)).status_code == 200
            program = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            answer = await program.chat.completions.create(model="gt", messages=body["messages"], max_tokens=2)
            assert answer.choices[0].finish_reason is not None
            await program.close()
            assert node.gateway.counters["prompts"] == before[1] + len(allowed(url)) + 1
        finally:
            await net.close()

    run(main())


def test_a_user_without_enough_relays_gets_a_clear_error(quick_family):
    async def main():
        net = await overlay(quick_family, relays=5, model_nodes=1)
        lonely = make_user()
        try:
            await lonely.start()
            net.users.append(lonely)
            net.publish(users=[lonely, net.users[1], net.users[2]])
            answer = await chat(lonely, "hello?")
            assert answer.status_code == 503 and answer.headers[ANSWERED_BY] == "relay"
            error = answer.json()["error"]
            assert error["code"] == "too_few_paths" and "2 usable relays" in error["message"]
        finally:
            await net.close()

    run(main())


@pytest.mark.faults
def test_an_answer_survives_a_relay_killed_mid_request(quick_family):
    async def main():
        net = await overlay(quick_family)
        try:
            victim_key, path = next(iter(relays_on_one_path(net.client).items()))
            async with httpx.AsyncClient(timeout=60) as http:
                response, chunks, text = await stream_until_first_chunk(
                    http, f"{net.client.http_url}/v1/completions",
                    {"model": "gt", "prompt": "The os module", "max_tokens": 120, "ignore_eos": True,
                     "temperature": 0, "stream": True})
                await net.user(victim_key).close()
                async for more in chunks:
                    text += more
                await response.aclose()
            parts = events(text)
            assert parts[-1]["choices"][0]["finish_reason"] == "length"
            assert sum(len(p["choices"][0]["text"]) > 0 for p in parts) > 1
            assert not path.live
            await until(lambda: len(net.client.paths.live()) >= 4)
            assert (await chat(net.client, "And now?")).status_code == 200
        finally:
            await net.close()

    run(main())


@pytest.mark.faults
def test_too_many_dead_paths_give_a_clear_error_and_a_retry_succeeds_after_rebuild(quick_family):
    async def main():
        net = await overlay(quick_family)
        try:
            one, two = net.client.paths.live()[:2]
            first_key = next(r for r in one.route if r not in two.route)
            second_key = next(r for r in two.route if r not in one.route)
            async with httpx.AsyncClient(timeout=60) as http:
                response, chunks, text = await stream_until_first_chunk(
                    http, f"{net.client.http_url}/v1/completions",
                    {"model": "gt", "prompt": "The sys module", "max_tokens": 400, "ignore_eos": True,
                     "temperature": 0, "stream": True})
                await asyncio.gather(net.user(first_key).close(), net.user(second_key).close())
                async for more in chunks:
                    text += more
                await response.aclose()
            error = events(text)[-1]["error"]
            assert error["code"] == "too_few_paths"
            assert re.match(r"Only [0-2] anonymous path\(s\) survive of the 4 this request used", error["message"])
            await until(lambda: len(net.client.paths.live()) >= 4, timeout=30)
            retry = await chat(net.client, "Try again?")
            assert retry.status_code == 200, retry.text
        finally:
            await net.close()

    run(main())


@pytest.mark.faults
@pytest.mark.parametrize("mode", ["flip", "drop", "flip-at-proxy"])
def test_a_relay_that_corrupts_or_drops_is_detected_and_avoided(quick_family, mode):
    async def main():
        net = await overlay(quick_family, relays=16)  # disjoint paths: the bad relay is on exactly one
        try:
            bad_key, bad_path = next((relay, path) for relay, path in relays_on_one_path(net.client).items()
                                     if mode != "flip-at-proxy" or relay == path.proxy)
            net.user(bad_key).relay.mode = mode
            for i in range(3):  # answers still arrive: 3 of 4 cloves are intact
                answer = await chat(net.client, f"Question {i}: what does re do?", stream=True,
                                    max_tokens=12)
                assert events(answer.text)[-1]["choices"][0]["finish_reason"] is not None
                if not bad_path.live:
                    break
            await until(lambda: not bad_path.live)  # used up, or torn down for what it did
            await until(lambda: bad_key in net.client.paths.avoided)  # drops show once the answer is in
            if mode == "drop":
                assert net.client.counters["dropping_paths"] >= 1
            else:  # the path key (relays) or the node's reply key (the proxy) catches it before S-IDA
                assert net.client.paths.counters["altered"] >= 1
            await until(lambda: len(net.client.paths.live()) >= 4)
            assert all(bad_key not in p.route for p in net.client.paths.live())
            assert (await chat(net.client, "All good?")).status_code == 200
        finally:
            await net.close()

    run(main())


def test_answers_are_split_with_the_users_own_threshold(quick_family):
    """A user who asks with k = 2 of n = 4 gets its answer back from any two paths: the model node splits
    every answer part as the prompt was split, so two relays dropping everything they carry back cost
    nothing (under the default k = 3 the same two would lose every answer)."""
    async def main():
        users = [faulty(make_user(k=2))] + [faulty(make_user()) for _ in range(15)]
        net = await start_overlay(quick_family, users, MODEL_NODES)
        try:
            assert (net.client.config.n, net.client.config.k) == (4, 2)
            single = relays_on_one_path(net.client)
            bad = {}
            for relay, path in single.items():
                if path not in bad.values():
                    bad[relay] = path
                if len(bad) == 2:
                    break
            for relay in bad:
                net.user(relay).relay.mode = "drop"
            for stream in (False, True):
                answer = await chat(net.client, "What does the re module do?", stream=stream, max_tokens=12)
                assert answer.status_code == 200, answer.text
                if stream:
                    assert events(answer.text)[-1]["choices"][0]["finish_reason"] is not None
                else:
                    assert signed(answer.json()).node in {n.keys.public for n in net.nodes}
            assert sum(n.gateway.counters["parts_sent"] for n in net.nodes) >= 2
        finally:
            await net.close()

    run(main())


@pytest.mark.faults
def test_a_relay_that_delays_costs_the_user_nothing(quick_family):
    """A relay holding back every clove it carries toward the user: the other paths' k cloves already
    make the answer, which comes back whole, streamed or not, again and again."""
    async def main():
        net = await overlay(quick_family, relays=16)
        try:
            slow_key, _ = next(iter(relays_on_one_path(net.client).items()))
            net.user(slow_key).relay.mode = "delay"
            for i in range(3):
                answer = await chat(net.client, f"Question {i}: what does os do?", max_tokens=12)
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["finish_reason"] is not None
            streamed = await chat(net.client, "And sys?", stream=True, max_tokens=12)
            assert events(streamed.text)[-1]["choices"][0]["finish_reason"] is not None
            assert net.client.counters["answered"] == 4 and net.client.counters["failed"] == 0
        finally:
            await net.close()

    run(main())


@pytest.mark.faults
def test_a_third_of_the_relays_leave_and_users_keep_chatting(quick_family):
    """Churn: a third of the relays go at once, before the next list says so. Each request either
    gets its answer or, while fewer than k paths survive, the documented 503; paths are rebuilt over
    the relays that stayed, and answers follow."""
    async def main():
        net = await overlay(quick_family, relays=15)
        try:
            others = net.users[1:]
            leaving = others[::3]
            gone = {u.keys.public for u in leaving}
            for user in leaving:
                await user.close()
            net.users = [u for u in net.users if u not in leaving]
            outcomes = []
            for i in range(6):
                answer = await chat(net.client, f"Question {i}: what does json do?")
                outcomes.append(200 if answer.status_code == 200 else
                                (answer.status_code, answer.json()["error"]["code"]))
            assert set(outcomes) <= {200, (503, "too_few_paths")}, outcomes
            net.publish()  # the next verified list no longer holds them
            await until(lambda: len(net.client.paths.live()) >= 4
                             and not any(gone & set(p.route) for p in net.client.paths.live()), timeout=30)
            for i in range(3):
                assert (await chat(net.client, f"After churn {i}?")).status_code == 200
        finally:
            await net.close()

    run(main())


@pytest.mark.faults
def test_a_model_node_refuses_garbage_cloves_and_keeps_serving(quick_family):
    async def main():
        net = await overlay(quick_family, relays=6, model_nodes=1)
        try:
            node = net.nodes[0]
            proxy = net.users[1]
            me = node.keys.public
            garbage = [b"", b"\x01" * 50, onion.seal_to(me, b"\x07" * 500),
                       onion.seal_to(proxy.keys.public, b"\x07" * 500)]  # sealed for someone else
            stray = sida.split(Prompt(b"r" * 16, b"n" * 32, "chat", b"{}",
                                      ((b"p" * 32, b"i" * 16, b"k" * 32),), 1, sent_now()).seal())
            garbage += [onion.seal_to(me, sida.encode(c)) for c in stray]  # a prompt for another node
            for data in garbage:
                await proxy._send(node.keys.public, "clove", data)
            await until(lambda: node.gateway.counters["cloves"] == len(garbage))
            assert node.gateway.counters["bad_cloves"] == 4
            assert node.gateway.counters["bad_messages"] == 1 and node.gateway.counters["prompts"] == 0
            assert (await chat(net.client, "Are you there?")).status_code == 200
        finally:
            await net.close()

    run(main())


def test_an_unreachable_model_node_fails_fast_and_is_avoided(quick_family):
    async def main():
        net = await overlay(quick_family, relays=8, model_nodes=2)
        try:
            dead, alive = net.nodes
            await dead.close()
            body = json.dumps({"model": "gt", "messages": [{"role": "user", "content": "Hello?"}],
                               "max_tokens": 4}).encode()
            with pytest.raises(ApiError) as failure:
                await net.client.ask(dead.keys.public, "chat", body)
            # refused at once, not left to the response timeout (whose code is "timeout")
            assert failure.value.status == 502 and failure.value.code == "node_unreachable"
            for _ in range(4):  # the dead node is avoided: every retry goes to the live one
                answer = await chat(net.client, "Hello again?")
                assert answer.status_code == 200
                assert answer.json()["planetserve"]["node"] == alive.keys.public.hex()
        finally:
            await net.close()

    run(main())


def test_a_path_whose_first_relay_left_the_list_is_dropped_and_replaced(quick_family):
    async def main():
        net = await overlay(quick_family, relays=16, model_nodes=1)
        try:
            client = net.client
            path = client.paths.live()[0]
            gone = path.first
            view = client.view
            client.apply_view(replace(view, height=view.height + 1,
                                      users={k: u for k, u in view.users.items() if k != gone}))
            for _ in range(3):  # a request may or may not pick that path; each still gets its answer
                assert (await chat(client, "Is anyone there?")).status_code == 200
                if not path.live:
                    break
            assert not path.live
            await until(lambda: len(client.paths.live()) >= 4)
            assert all(gone not in p.route for p in client.paths.live())
        finally:
            await net.close()

    run(main())


async def status(user) -> dict:
    async with httpx.AsyncClient(timeout=30) as http:
        return (await http.get(f"{user.http_url}/v1/planetserve/status")).json()


def test_live_paths_end_at_distinct_proxies_whenever_the_list_allows(quick_family):
    async def main():
        five = replace(FAST, target=5)  # 5 paths over 5 other relays: every relay ends one path
        net = await start_overlay(quick_family, [make_user(settings=five) for _ in range(6)], 1)
        try:
            client = net.client
            for _ in range(3):  # built together, and rebuilt one by one next to the others
                assert len({p.proxy for p in client.paths.live()}) == 5
                for path in client.paths.live()[:2]:
                    await client.paths.drop(path, "test")
                await until(lambda: len(client.paths.live()) == 5)
            assert len({p.proxy for p in client.paths.live()}) == 5
            document = await status(client)
            assert document["distinct_proxies"] == 5 and len(document["paths"]) == 5
            assert (await chat(client, "Which proxy?")).status_code == 200
        finally:
            await net.close()

    run(main())


def test_paths_rotate_after_their_lifetime_without_a_gap(quick_family):
    async def main():
        # paths used once are replaced by each request (the default): rotation by lifetime is what
        # replaces paths that go unused, and those that carry many requests when a user allows it
        short = replace(FAST, lifetime=1.5, lifetime_jitter=0.25, retire_grace=5.0, uses=0)
        net = await start_overlay(quick_family, [make_user(settings=short) for _ in range(9)], 1)
        client, fewest = net.client, [short.target]
        first = set(client.paths.live())

        async def watch():
            while True:
                fewest[0] = min(fewest[0], len(client.paths.live()))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        try:
            answers, deadline = [], time.monotonic() + 60  # a hang guard: 8 rotations take a few seconds
            while not (client.paths.counters["rotated"] >= 8 and first.isdisjoint(client.paths.paths.values())):
                answers.append(await chat(client, f"Question {len(answers)}?", stream=len(answers) % 2 == 1))
                assert time.monotonic() < deadline, (client.paths.counters, [p.state for p in first])
            assert [a.status_code for a in answers] == [200] * len(answers), [a.text for a in answers]
            assert fewest[0] >= short.target, "live paths dropped below the target during rotation"
            assert client.paths.counters["rotation_failures"] == 0 and client.counters["failed"] == 0

            # replaced paths are torn down at their relays, not left to expire there: rotation goes on, so
            # wait for a moment between two rotations, when the relays hold exactly the client's paths
            def between_rotations() -> bool:
                held = sum(1 for u in net.users[1:] for h in u.relay.hops if h.pred == client.keys.public)
                settled = all(p.state == "live" for p in client.paths.paths.values())
                return settled and held == len(client.paths.paths) == short.target
            deadline = time.monotonic() + 30
            while True:
                await until(between_rotations, timeout=30)
                document = await status(client)
                if between_rotations():  # no rotation began while the status was read
                    break
                assert time.monotonic() < deadline, "never between two rotations"
            assert document["rotations"] >= 8 and document["distinct_proxies"] == short.target
            assert all(0 <= p["replaced_in"] <= 1.5 * 1.25 for p in document["paths"])
        finally:
            watcher.cancel()
            await net.close()

    run(main())


def test_paths_built_from_a_short_list_are_rebuilt_when_it_grows(quick_family):
    async def main():
        users = [make_user() for _ in range(12)]
        net = await start_overlay(quick_family, users[:4], 1)  # 3 relays for 4 paths: proxies repeat
        client = net.client
        try:
            assert len({p.proxy for p in client.paths.live()}) == 3
            for user in users[4:]:
                await user.start(serve_http=False)
            net.users = users
            net.publish()
            await until(lambda: len(client.paths.live()) == 4 and len({p.proxy for p in client.paths.live()}) == 4
                        and client.paths.counters.get("rotated") == 4, timeout=15)
            assert all(p.listed == 12 for p in client.paths.live())  # each rebuilt once, from the long list
            assert client.paths.counters["died"] == 0
            assert (await chat(client, "More of us now?")).status_code == 200
        finally:
            await net.close()

    run(main())


def test_a_request_that_names_a_node_reaches_it_trusted_or_not(quick_family):
    async def main():
        net = await overlay(quick_family, relays=8, model_nodes=2, untrusted=1)
        try:
            (outsider,) = net.untrusted
            assert sorted(net.client.view.models()) == ["gt"]
            assert outsider.keys.public not in net.client.view.nodes
            for _ in range(4):  # ordinary requests go to trusted nodes only
                answer = await chat(net.client, "Which module parses JSON?")
                assert signed(answer.json()).node in {n.keys.public for n in net.nodes}
            assert outsider.gateway.counters["prompts"] == 0
            for node in [*net.nodes, outsider]:
                answer = await chat(net.client, "Which module parses JSON?", stream=node is outsider,
                                    planetserve={"node": node.keys.public.hex()})
                assert answer.status_code == 200, answer.text
                body = events(answer.text)[-1] if node is outsider else answer.json()
                assert body["planetserve"]["node"] == node.node_id
            assert outsider.gateway.counters["prompts"] == 1
            # the outsider answered by itself: its trusted peers refuse its connections
            assert outsider.counters["served"] == 1 and outsider.counters["forwarded"] == 0
        finally:
            await net.close()

    run(main())


def test_a_named_node_overrides_session_affinity(quick_family):
    async def main():
        net = await overlay(quick_family, relays=8, model_nodes=2)
        try:
            first = (await chat(net.client, "Name a module for dates.")).json()
            entry = first["planetserve"]["node"]
            other = next(n for n in net.nodes if n.node_id != entry)
            history = [{"role": "user", "content": "Name a module for dates."},
                       {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                       {"role": "user", "content": "And for times?"}]
            async with httpx.AsyncClient(timeout=60) as http:
                follow = await http.post(f"{net.client.http_url}/v1/chat/completions", json={
                    "model": "gt", "messages": history, "max_tokens": 4,
                    "planetserve": {"node": other.node_id, "session_id": "mine"}})
            assert follow.status_code == 200, follow.text
            assert signed(follow.json()).node == other.keys.public
        finally:
            await net.close()

    run(main())


def test_naming_an_unknown_node_or_one_of_another_model_is_refused(quick_family):
    async def main():
        net = await overlay(quick_family, relays=6, model_nodes=1)
        try:
            node = net.nodes[0].node_id
            cases = [
                ({"node": "ab" * 32}, "gt", 404, "node_not_found"),
                ({"node": node}, "llama-70b", 400, "node_model_mismatch"),
                ({"node": "not hex"}, "gt", 400, "invalid_value"),
                ({"node": node[:-2]}, "gt", 400, "invalid_value"),
                ({"node": 7}, "gt", 400, "invalid_value"),
            ]
            for extension, model, status, code in cases:
                answer = await chat(net.client, "Hello?", model=model, planetserve=extension)
                assert answer.status_code == status, (extension, answer.text)
                assert answer.json()["error"]["code"] == code
            assert net.nodes[0].gateway.counters["prompts"] == 0
            # a node is only reachable while active
            inactive = DirectoryView.of(1, [], [], [record(net.nodes[0], status="inactive")])
            assert inactive.node(net.nodes[0].keys.public) is None and not inactive.registered
        finally:
            await net.close()

    run(main())


def _part(seq: int, data: bytes = b"x", last: bool = False) -> Part:
    return Part(b"r" * 16, seq, 200, "application/json", data, last)


def test_an_answer_is_reassembled_in_order_and_parts_far_ahead_are_dropped():
    async def main():
        exchange = Exchange(b"r" * 16, b"n" * 32, (), 1)
        exchange.add(_part(MAX_PARTS_AHEAD))  # beyond the window: a node flooding us is ignored
        exchange.add(_part(2, b"c", last=True))
        exchange.add(_part(1, b"b"))
        exchange.add(_part(0, b"a"))
        first = await exchange.next_part(1.0)
        assert b"".join([d async for d in exchange.data(first, 1.0)]) == b"abc"
        assert exchange.parts == {}

    run(main())


def test_parts_held_ahead_are_bounded_by_the_answers_bytes():
    """What is read and what is kept ahead together stay within MAX_ANSWER_BYTES: a part that would pass
    it fails the answer (502 `answer_too_large`) rather than being kept."""
    async def main():
        exchange = Exchange(b"r" * 16, b"n" * 32, (), 1)
        quarter = b"x" * (MAX_ANSWER_BYTES // 4)
        for seq in range(1, 5):
            exchange.add(_part(seq, quarter))
        assert exchange.held == MAX_ANSWER_BYTES and exchange.failure is None
        exchange.add(_part(3, quarter))  # the same part again holds no more
        exchange.add(_part(0, b"a"))
        with pytest.raises(ApiError) as caught:
            await exchange.next_part(1.0)
        assert caught.value.code == "answer_too_large" and exchange.held == MAX_ANSWER_BYTES

    run(main())


def test_a_node_sending_parts_ahead_of_one_it_never_sends_gets_answer_too_large(quick_family):
    """A real model node answers with parts 1 to 8, each of 4 MiB, and never part 0: the user's relay
    kept every one (64 parts ahead were allowed, counted but not weighed) until the request timed out.
    Now the answer fails once the parts kept pass 16 MiB."""
    async def main():
        net = await start_overlay(quick_family, [make_user() for _ in range(6)], 1)
        try:
            gateway = net.nodes[0].gateway
            data = b"x" * (MAX_MESSAGE - 200)

            async def ahead(prompt, reply):
                live = set(range(len(prompt.reply_to)))
                for seq in range(1, 9):
                    await gateway._send(prompt, Part(prompt.request_id, seq, 200, "application/json", data,
                                                     False), live)

            gateway._reply = ahead
            answered = await chat(net.client, "Hello?")
            assert answered.status_code == 502 and answered.json()["error"]["code"] == "answer_too_large"
            assert net.client.exchanges == {}
        finally:
            await net.close()

    run(main(), timeout=120)


def test_parts_out_of_order_do_not_extend_the_wait_for_the_next_one():
    async def main():
        exchange = Exchange(b"r" * 16, b"n" * 32, (), 1)

        async def keep_sending_the_wrong_part():
            while True:
                exchange.add(_part(1))
                await asyncio.sleep(0.02)

        sender = asyncio.create_task(keep_sending_the_wrong_part())
        with pytest.raises(ApiError) as caught:
            await asyncio.wait_for(exchange.next_part(0.3), 10)
        sender.cancel()
        assert caught.value.status == 504 and caught.value.code == "timeout"

    run(main())


def test_an_answer_longer_than_the_limit_is_refused():
    async def main():
        exchange = Exchange(b"r" * 16, b"n" * 32, (), 1)
        chunk = b"x" * (1 << 20)
        got = 0
        with pytest.raises(ApiError) as caught:
            first = _part(0, chunk)
            async for data in exchange.data(first, 1.0):
                got += len(data)
                exchange.add(_part(exchange.next_seq, chunk))
        assert caught.value.status == 502 and caught.value.code == "answer_too_large"
        assert got == MAX_ANSWER_BYTES

    run(main())


def test_a_user_home_limits_how_many_requests_a_path_carries(tmp_path):
    config = UserConfig(genesis="g.json")
    assert config.path_uses == 1 and path_settings(config).uses == 1  # every request on paths of its own
    config.save(tmp_path)
    raw = json.loads((tmp_path / "user.json").read_text())
    for bad in (-1, 1.5, True, "1"):
        (tmp_path / "user.json").write_text(json.dumps({**raw, "path_uses": bad}))
        with pytest.raises(HomeError, match="path_uses must be a whole number of requests >= 0"):
            UserConfig.load(tmp_path)
    (tmp_path / "user.json").write_text(json.dumps({**raw, "path_uses": 0}))
    assert path_settings(UserConfig.load(tmp_path)).uses == 0
