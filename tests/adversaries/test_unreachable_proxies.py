"""A listed user that wants a model node to stop answering the overlay: it lists a key whose address
accepts TCP and never speaks TLS, and sends the node prompts whose answers go to that key, sixteen times
over. Each answer part waited on sixteen dials of 10 s, one after the other, so the prompts held every
answer slot for hours and every other prompt, users' and challenges alike, was dropped as busy. Now one
proxy's prompts take at most a quarter of the slots, callers waiting on a dial share its outcome, and an
answer that can no longer reach k proxies is given up: a real node keeps answering other users, and the
adversary's answers end within one dial."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from overlaynet import chat, directory, make_user, start_overlay
from waiting import run, until

from planetserve.chain.keys import KeySet
from planetserve.node.overlay import onion, sida
from planetserve.node.overlay.directory import DirectoryView
from planetserve.node.overlay.gateway import MAX_ANSWERS, MAX_ANSWERS_PER_PEER
from planetserve.node.overlay.messages import MAX_PROXIES, Prompt, sent_now
from planetserve.node.overlay.transport import HANDSHAKE_TIMEOUT
from planetserve.registry.entities import User


def test_prompts_answered_to_an_unreachable_proxy_hold_a_share_of_the_slots_and_end(quick_family):
    async def main():
        accepted: list[asyncio.StreamWriter] = []

        async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(writer)  # accepts, never answers

        hole = await asyncio.start_server(swallow, "127.0.0.1", 0)
        net = await start_overlay(quick_family, [make_user() for _ in range(6)], 1)
        try:
            node = net.nodes[0]
            key, gateway = node.keys.public, node.gateway
            dead = KeySet.generate().public
            listed = directory(net.users, net.nodes)
            node.apply_users(DirectoryView.of(
                2, [*listed.users.values(), User(dead, f"127.0.0.1:{hole.sockets[0].getsockname()[1]}",
                                                 "global", 0, 1 << 40)], list(listed.nodes.values())))
            adversary = net.users[1]
            body = json.dumps({"model": "gt", "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 1}).encode()
            before = dict(gateway.counters)
            for _ in range(MAX_ANSWERS):
                prompt = Prompt(secrets.token_bytes(16), key, "chat", body,
                                tuple((dead, secrets.token_bytes(16), secrets.token_bytes(32))
                                      for _ in range(MAX_PROXIES)), 1, sent_now())
                for clove in sida.split_encoded(prompt.seal())[:3]:
                    await adversary._send(key, "clove", onion.seal_to(key, clove))
            await until(lambda: gateway.counters["prompts"] + gateway.counters["busy"]
                        == before["prompts"] + before["busy"] + MAX_ANSWERS, timeout=30)
            assert gateway.counters["prompts"] - before["prompts"] == MAX_ANSWERS_PER_PEER
            assert gateway.held[adversary.keys.public] == MAX_ANSWERS_PER_PEER
            started = time.monotonic()
            answered = await chat(net.client, "Are you there?")
            assert answered.status_code == 200, answered.text
            assert time.monotonic() - started < HANDSHAKE_TIMEOUT
            busy_answers = gateway.counters["busy_answered"] - before["busy_answered"]  # sent there too
            await until(lambda: gateway.counters["undeliverable"] - before["undeliverable"]
                        == MAX_ANSWERS_PER_PEER + busy_answers, timeout=4 * HANDSHAKE_TIMEOUT)
            await until(lambda: adversary.keys.public not in gateway.held and not gateway.refusals)
            assert len(accepted) <= 4, f"{len(accepted)} dials to the unreachable proxy"
        finally:
            await net.close()
            hole.close()
            for writer in accepted:
                writer.close()

    run(main(), timeout=150)
