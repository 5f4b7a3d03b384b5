"""A listed user that wants to take the overlay's tables for itself, as a real peer over TLS: it floods a
relay's path table with setups, flushes a relay's replay cache to replay a setup it captured, and floods
a model node's clove reassembler with junk cloves under fresh message ids. Every table is bounded per
sending peer and refuses (or evicts only that peer's own) before it stores, so another peer's paths are
still built and its message is still reassembled and answered; the setup window means the replay cache
never has to forget a setup that could still be replayed."""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from dataclasses import replace

from nacl.signing import SigningKey
from overlaynet import FAST, chat, directory, make_user, start_overlay
from waiting import run, until

from planetserve.node.overlay import gateway as gateway_module
from planetserve.node.overlay import onion, relay, sida
from planetserve.node.overlay.messages import Prompt, sent_now
from planetserve.node.overlay.relay import MAX_HOPS_PER_PEER, MAX_SETUPS_PER_PEER, Relay
from planetserve.node.user import UserRelay

TABLE = 1_000
"""The victim's global table in the path-table test: small, so that the flood stays quick."""
FLOOD = 1_100
"""Setups the adversary sends: more than the whole table before the change."""
REPLAY_MEMORY = 1_000
"""The victim's replay cache in the replay test: small, so that flushing it stays quick."""
JUNK = 1_200
"""Junk cloves, each under a fresh message id: more than the reassembler's 1,024 messages."""

ONE_HOP = replace(FAST, length=1, target=4)
"""The honest user's paths: one relay each, the victim, so each path's setup reaches it from that user."""


def setup_to(victim: bytes, next_key: bytes | None = None) -> tuple[bytes, list]:
    """A one-hop setup with the victim as proxy, or as a relay passing it on to `next_key`: (link id,
    the setup's body)."""
    if next_key is None:
        layer = onion.proxy_layer(secrets.token_bytes(16), secrets.token_bytes(32))
    else:
        layer = onion.relay_layer(secrets.token_bytes(onion.ID_SIZE), next_key)
    link = secrets.token_bytes(onion.ID_SIZE)
    return link, [link, onion.build([victim], [layer])[0]]


async def users_network(count: int) -> list[UserRelay]:
    users = [make_user(settings=ONE_HOP) for _ in range(count)]
    for user in users:
        await user.start(serve_http=False)
    view = directory(users, [])
    for user in users:
        user.apply_view(view)
    return users


async def close(users: list[UserRelay]) -> None:
    for user in users:
        await user.close()


def test_one_peer_cannot_fill_a_relays_path_table():
    async def main():
        victim, adversary, honest = users = await users_network(3)
        old = victim.relay
        victim.relay = Relay(old.secret, old.send, is_user=old.is_user, is_node=old.is_node, owner=old.owner,
                             max_hops=TABLE)
        target = victim.keys.public
        honest.paths.users = lambda: [target]
        try:
            built = [await honest.paths.build() for _ in range(2)]
            assert all(built), honest.paths.last_error
            started = time.monotonic()
            for _ in range(FLOOD):
                await adversary._send(target, "setup", setup_to(target)[1])
            counters = victim.relay.counters
            await until(lambda: counters["setups"] + counters["refused"] >= FLOOD + 2)
            # the honest user's paths through the victim still carry traffic, and new ones are built
            assert all([await honest.paths.ping(p) for p in built])
            assert await honest.paths.wait_live(ONE_HOP.target, 10), honest.paths.last_error
            held = victim.relay.by_peer
            assert len(held[adversary.keys.public]) == MAX_HOPS_PER_PEER
            assert len(held[honest.keys.public]) == ONE_HOP.target
            assert len(victim.relay.forward) == MAX_HOPS_PER_PEER + ONE_HOP.target <= TABLE
            assert counters["refused_peer_limit"] == FLOOD - MAX_HOPS_PER_PEER
            assert time.monotonic() - started < 15
        finally:
            await close(users)

    run(main(), timeout=60)


def test_a_captured_setup_replayed_after_a_cache_flood_is_refused(monkeypatch):
    monkeypatch.setattr(relay, "REPLAY_MEMORY", REPLAY_MEMORY)

    async def main():
        victim, adversary, honest = users = await users_network(3)
        target = victim.keys.public
        counters = victim.relay.counters
        try:
            # an honest setup, captured on its way (say by a relay before the victim), then torn down
            link, captured = setup_to(target)
            await honest._send(target, "setup", captured)
            await until(lambda: counters["setups"] == 1)
            await honest._send(target, "down", [link])
            await until(lambda: (honest.keys.public, link) not in victim.relay.forward)
            # the adversary's own path, then setups on to a key that is not a listed user: each one is
            # refused after it was remembered, so the replay cache fills without taking a slot of the table
            nobody = bytes(SigningKey.generate().verify_key)
            await adversary._send(target, "setup", setup_to(target)[1])
            await until(lambda: counters["setups"] == 2)
            for _ in range(REPLAY_MEMORY + 100):
                await adversary._send(target, "setup", setup_to(target, nobody)[1])
            await until(lambda: counters["refused"] >= REPLAY_MEMORY + 100)
            setups = counters["setups"]
            replay_link = secrets.token_bytes(onion.ID_SIZE)
            await adversary._send(target, "setup", [replay_link, captured[1]])
            await until(lambda: counters["refused"] >= REPLAY_MEMORY + 101 or counters["setups"] > setups)
            assert counters["setups"] == setups, "the captured setup was accepted again"
            assert (adversary.keys.public, replay_link) not in victim.relay.forward
            assert counters["replays"] == 1
            # the honest setup and the adversary's first 512 (its own path's among them)
            assert len(victim.relay.seen) == 1 + MAX_SETUPS_PER_PEER <= REPLAY_MEMORY
            assert counters["refused_setup_rate"] == REPLAY_MEMORY + 101 - MAX_SETUPS_PER_PEER
            # honest setups still pass
            honest.paths.users = lambda: [target]
            assert await honest.paths.build() is not None, honest.paths.last_error
            # past the window the cache forgets it, and the replay is refused as stale
            now = time.time()
            victim.relay.seen.clock = lambda: now + relay.SETUP_MAX_AGE + 5
            victim.relay.forget_setups()
            assert len(victim.relay.seen) == 0
            await adversary._send(target, "setup", [secrets.token_bytes(onion.ID_SIZE), captured[1]])
            await until(lambda: counters["stale"] == 1)
            assert counters["setups"] == setups + 1
        finally:
            await close(users)

    run(main(), timeout=60)


def test_a_setup_from_a_clock_ahead_is_refused_again_once_it_enters_the_window():
    """A user whose clock runs 40 s ahead of the relay's: its setup is refused as early, and remembered,
    so that an adversary who captured it and replays it once it is inside the window is refused as a
    replay. A setup issued an hour ahead is refused and not kept (the cache stays bounded in time)."""
    async def main():
        victim, adversary, honest = users = await users_network(3)
        target = victim.keys.public
        counters = victim.relay.counters
        try:
            ahead = int(time.time()) + 40
            link = secrets.token_bytes(onion.ID_SIZE)
            layer = onion.proxy_layer(secrets.token_bytes(16), secrets.token_bytes(32), issued=ahead)
            captured = [link, onion.build([target], [layer])[0]]
            await honest._send(target, "setup", captured)
            await until(lambda: counters["stale"] == 1)
            assert len(victim.relay.seen) == 1 and counters["setups"] == 0
            far = onion.proxy_layer(secrets.token_bytes(16), secrets.token_bytes(32), issued=ahead + 3600)
            await honest._send(target, "setup", [secrets.token_bytes(onion.ID_SIZE), onion.build([target], [far])[0]])
            await until(lambda: counters["stale"] == 2)
            assert len(victim.relay.seen) == 1
            # 30 s on, the captured setup is inside the relay's window: its replay is refused all the same
            now = time.time()
            victim.relay.seen.clock = lambda: now + 30
            await adversary._send(target, "setup", [secrets.token_bytes(onion.ID_SIZE), captured[1]])
            await until(lambda: counters["replays"] == 1)
            assert counters["setups"] == 0 and not victim.relay.forward
        finally:
            await close(users)

    run(main(), timeout=60)


def test_junk_cloves_from_one_proxy_do_not_evict_another_proxys_message(quick_family):
    async def main():
        net = await start_overlay(quick_family, [make_user() for _ in range(6)], 1)
        try:
            node = net.nodes[0]
            key = node.keys.public
            gateway = node.gateway
            adversary, honest = net.users[1], net.users[2]
            body = json.dumps({"model": "gt", "messages": [{"role": "user", "content": "Still there?"}],
                               "max_tokens": 4}).encode()
            prompt = Prompt(secrets.token_bytes(16), key, "chat", body,
                            tuple((honest.keys.public, secrets.token_bytes(16), secrets.token_bytes(32))
                                  for _ in range(4)), 3, sent_now())
            cloves = [onion.seal_to(key, sida.encode(c)) for c in sida.split(prompt.seal())]
            before = dict(gateway.counters)
            for data in cloves[:2]:  # the honest proxy's message is pending: two of the k = 3 cloves
                await honest._send(key, "clove", data)
            await until(lambda: gateway.counters["cloves"] == before["cloves"] + 2)
            junk = [onion.seal_to(key, sida.encode(sida.split(secrets.token_bytes(100))[0]))
                    for _ in range(JUNK)]
            started = time.monotonic()
            for data in junk:
                await adversary._send(key, "clove", data)
            await until(lambda: gateway.counters["cloves"] == before["cloves"] + 2 + JUNK)
            reassembler = gateway.reassembler
            assert reassembler.pending_bytes <= reassembler.max_pending_bytes
            await honest._send(key, "clove", cloves[2])  # the third clove completes it
            await until(lambda: gateway.counters["prompts"] == before["prompts"] + 1, timeout=10)
            await until(lambda: gateway.counters["parts_sent"] > before["parts_sent"])
            assert len(reassembler) == reassembler.max_pending_per_peer  # the adversary's junk only
            messages, held = reassembler.held_by(adversary.keys.public)
            assert messages == reassembler.max_pending_per_peer
            assert held <= reassembler.max_pending_bytes_per_peer
            assert reassembler.dropped == JUNK - reassembler.max_pending_per_peer
            assert time.monotonic() - started < 15
            assert (await chat(net.client, "And now?")).status_code == 200
        finally:
            await net.close()

    run(main(), timeout=120)


REPLIES_PER_PEER = 600
"""The victim proxy's reply ids per previous-hop peer in the reply-id test: small, so the flood stays quick."""
REPLY_FLOOD = 900
"""Prompt cloves the adversary sends, each under a fresh reply id, over 3 paths: 300 more than the bound."""


def test_one_user_cannot_fill_a_proxys_reply_ids(quick_family):
    """A listed user builds three paths ending at one proxy and sends prompt cloves over them, each under a
    fresh reply id: the proxy keeps at most 256 per path (a new one replacing that path's oldest) and
    `max_replies_per_peer` over one peer's paths, refusing the rest before storing; another user still
    gets answers through the overlay."""
    async def main():
        net = await start_overlay(quick_family, [make_user() for _ in range(6)], 1)
        try:
            node = net.nodes[0].keys.public
            adversary, victim = net.users[1], net.users[2]
            target = victim.keys.public
            victim.relay.max_replies_per_peer = REPLIES_PER_PEER
            adversary.paths.settings = replace(adversary.paths.settings, length=1)
            adversary.paths.users = lambda: [target]
            paths = [await adversary.paths.build() for _ in range(3)]
            assert all(paths) and {p.proxy for p in paths} == {target}, adversary.paths.last_error
            clove = onion.seal_to(node, sida.encode(sida.split(secrets.token_bytes(100))[0]))
            counters = victim.relay.counters
            before = dict(counters)
            started = time.monotonic()
            for i in range(REPLY_FLOOD):
                path = paths[i % 3]
                sealed = path.seal(node, clove, secrets.token_bytes(onion.ID_SIZE))
                await adversary._send(path.first, "fwd", [path.link, sealed])
            await until(lambda: counters["to_nodes"] + counters["refused_replies"]
                        >= before["to_nodes"] + before["refused_replies"] + REPLY_FLOOD)
            assert time.monotonic() - started < 20
            held = victim.relay.replies_by_peer[adversary.keys.public]
            assert held == REPLIES_PER_PEER
            assert counters["refused_replies"] - before["refused_replies"] == REPLY_FLOOD - REPLIES_PER_PEER
            # the three paths built here, and any the adversary's own path keeping built meanwhile
            hops = [h for h in victim.relay.hops if h.pred == adversary.keys.public]
            assert len(hops) >= 3 and all(len(h.replies) <= relay.MAX_REPLIES_PER_PATH for h in hops)
            assert len(victim.relay.replies) <= held + 64  # the adversary's, and the few of honest requests
            for question in ("Still answering?", "And now?"):
                assert (await chat(net.client, question)).status_code == 200
        finally:
            await net.close()

    run(main(), timeout=120)


def test_cloves_built_to_make_a_node_search_are_refused_or_given_up(quick_family):
    """A listed user sends a model node cloves built so that recovery searches: valid key shares over
    random fragments, in sets of up to 255 cloves on 64 indices (each subset tried cost an erasure decode
    and a decryption of up to 4 MiB, 128 of them a message, on the node's event loop: 8.5 MiB held it
    45 s). A set larger than a prompt's 16 paths is refused before it is stored; a set of 16 is given
    up after 16 subsets; the node keeps answering."""
    async def main():
        net = await start_overlay(quick_family, [make_user() for _ in range(6)], 1)
        try:
            node = net.nodes[0]
            key, gateway = node.keys.public, node.gateway
            adversary = net.users[1]
            before = dict(gateway.counters)
            wide = [dataclasses.replace(c, fragment=secrets.token_bytes(len(c.fragment)))
                    for c in sida.split(secrets.token_bytes(64 << 10), 255, 64)][:80]
            narrow = [dataclasses.replace(c, fragment=secrets.token_bytes(len(c.fragment)))
                      for c in sida.split(secrets.token_bytes(64 << 10), 16, 8)]
            for clove in [*wide, *narrow]:
                await adversary._send(key, "clove", onion.seal_to(key, sida.encode(clove)))
            await until(lambda: gateway.counters["cloves"] == before["cloves"] + len(wide) + len(narrow))
            assert gateway.counters["bad_cloves"] - before["bad_cloves"] == len(wide) + 3  # 8th, 9th, 10th
            assert len(gateway.reassembler) == 0 and gateway.counters["prompts"] == before["prompts"]
            assert (await chat(net.client, "Still answering?")).status_code == 200
        finally:
            await net.close()

    run(main(), timeout=120)


def test_one_proxy_cannot_fill_a_nodes_prompt_window(quick_family, monkeypatch):
    """A listed user delivers prompts with a junk body itself, each answered at once with a 400, but its
    request id held for the prompt window (150 s): one proxy filled the whole window (65,536 ids in
    about 85 s) and the node then refused every other prompt, challenges included. A proxy's ids take at
    most PROMPT_MEMORY_PER_PEER of the window (here 50 of 200); past it its prompts are refused as busy,
    and another user's chat is answered."""
    monkeypatch.setattr(gateway_module, "PROMPT_MEMORY_PER_PEER", 50)

    async def main():
        net = await start_overlay(quick_family, [make_user() for _ in range(6)], 1)
        try:
            node = net.nodes[0]
            key, gateway = node.keys.public, node.gateway
            gateway.answered.capacity = 200
            adversary = net.users[1]
            before = dict(gateway.counters)
            for _ in range(250):
                prompt = Prompt(secrets.token_bytes(16), key, "chat", b"junk",
                                ((adversary.keys.public, secrets.token_bytes(16), secrets.token_bytes(32)),),
                                1, sent_now())
                [clove] = sida.split_encoded(prompt.seal(), 1, 1)
                await adversary._send(key, "clove", onion.seal_to(key, clove))
            await until(lambda: gateway.counters["prompts"] + gateway.counters["busy"]
                        == before["prompts"] + before["busy"] + 250)
            assert gateway.counters["prompts"] - before["prompts"] == 50
            assert gateway.answered.held_by(adversary.keys.public) == 50
            assert (await chat(net.client, "Room for me?")).status_code == 200
        finally:
            await net.close()

    run(main(), timeout=120)


def test_a_busy_node_says_so_at_once_and_a_flood_cannot_make_it_say_so_faster_than_its_rate(
        quick_family, monkeypatch):
    """A prompt the node refuses as busy got no answer: its user waited out the relay's response timeout
    (30 s here), unable to tell busy from lost. Now it is answered 503 `node_busy` at once. A flood of
    prompts naming other users as their proxies, while the node is busy, makes it answer at most
    BUSY_BURST at once and BUSY_ANSWERS_PER_S a second: it cannot be turned into a reflector of parts."""
    monkeypatch.setattr(gateway_module, "MAX_ANSWERS", 0)  # every answer slot taken

    async def main():
        net = await start_overlay(quick_family, [make_user() for _ in range(6)], 1)
        try:
            node = net.nodes[0]
            key, gateway = node.keys.public, node.gateway
            started = time.monotonic()
            answer = await chat(net.client, "Anyone there?")
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "node_busy"
            assert "busy" in answer.json()["error"]["message"]
            assert time.monotonic() - started < 10  # not the relay's 30 s timeout
            adversary, victims = net.users[1], [u.keys.public for u in net.users[2:6]]
            before = dict(gateway.counters)
            flood = time.monotonic()
            for _ in range(200):
                prompt = Prompt(secrets.token_bytes(16), key, "chat", b"junk",
                                tuple((v, secrets.token_bytes(16), secrets.token_bytes(32)) for v in victims),
                                1, sent_now())
                clove = sida.split_encoded(prompt.seal(), len(victims), 1)[0]
                await adversary._send(key, "clove", onion.seal_to(key, clove))
            await until(lambda: gateway.counters["busy"] == before["busy"] + 200)
            elapsed = time.monotonic() - flood
            answered = gateway.counters["busy_answered"] - before["busy_answered"]
            assert 1 <= answered <= gateway_module.BUSY_BURST + gateway_module.BUSY_ANSWERS_PER_S * elapsed + 1
            await until(lambda: not gateway.refusals)
            assert gateway.counters["parts_sent"] - before["parts_sent"] <= 2 * answered  # a body and an end
        finally:
            await net.close()

    run(main(), timeout=120)
