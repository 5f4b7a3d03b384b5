"""A proxy that keeps the cloves of a prompt it delivered and sends them again, so that the model node
computes the same answer again and again (docs/threat-model.md, "Replays the cloves of a prompt"). The
reassembler forgets a finished message after 30 s; the gateway remembers the request ids it answered
for the prompt window around their `sent` time and refuses the replay as a replay inside it and as
stale after it, on a real model node over the real transport. A prompt from a clock a little ahead is
refused and remembered, so its replay once inside the window is refused too."""

from __future__ import annotations

import json
import secrets
import time

from overlaynet import make_user, start_overlay
from waiting import run, until

from planetserve.node.overlay import onion, sida
from planetserve.node.overlay.gateway import PROMPT_MAX_AGE
from planetserve.node.overlay.messages import SENT_STEP, Prompt, sent_now


def test_a_replayed_prompt_is_answered_once(quick_family):
    async def main():
        net = await start_overlay(quick_family, [make_user() for _ in range(6)], 1)
        try:
            node = net.nodes[0].keys.public
            gateway = net.nodes[0].gateway
            proxy = net.users[1]

            def cloves(sent: int) -> list[bytes]:
                body = json.dumps({"model": "gt", "messages": [{"role": "user", "content": "Once?"}],
                                   "max_tokens": 4}).encode()
                prompt = Prompt(secrets.token_bytes(16), node, "chat", body,
                                tuple((proxy.keys.public, secrets.token_bytes(16), secrets.token_bytes(32))
                                      for _ in range(4)), 3, sent)
                return [onion.seal_to(node, c) for c in sida.split_encoded(prompt.seal())]

            async def deliver(data: list[bytes]) -> None:
                for clove in data[:3]:
                    await proxy._send(node, "clove", clove)

            kept = cloves(sent_now())
            before = dict(gateway.counters)
            await deliver(kept)
            await until(lambda: gateway.counters["prompts"] == before["prompts"] + 1)
            await until(lambda: gateway.counters["parts_sent"] > before["parts_sent"])

            # the reassembler has forgotten the finished message: the replay is reassembled again
            ttl = gateway.reassembler.ttl
            gateway.reassembler.clock = lambda: time.monotonic() + ttl + 1
            await deliver(kept)
            await until(lambda: gateway.counters["replays"] == before["replays"] + 1)

            # past the prompt window the id is forgotten, and the replay is stale
            gateway.answered.clock = lambda: time.time() + PROMPT_MAX_AGE + SENT_STEP + 1
            gateway.reassembler.clock = lambda: time.monotonic() + 2 * (ttl + 1)
            await deliver(kept)
            await until(lambda: gateway.counters["stale"] == before["stale"] + 1)
            assert len(gateway.answered) == 0
            assert gateway.counters["prompts"] == before["prompts"] + 1  # answered once in all

            # a prompt sent now (by the node's clock) is answered; one sent further ahead than the window is stale
            await deliver(cloves(sent_now(gateway.answered.clock)))
            await until(lambda: gateway.counters["prompts"] == before["prompts"] + 2)
            held = len(gateway.answered)
            await deliver(cloves(sent_now(gateway.answered.clock) + 600))
            await until(lambda: gateway.counters["stale"] == before["stale"] + 2)
            assert gateway.counters["prompts"] == before["prompts"] + 2 and len(gateway.answered) == held

            # one from a user's clock 60 s ahead is stale too, but remembered: a proxy that kept its cloves
            # and replays them once they are inside the window is refused
            early = cloves(sent_now(gateway.answered.clock) + 60)
            await deliver(early)
            await until(lambda: gateway.counters["stale"] == before["stale"] + 3)
            assert len(gateway.answered) == held + 1
            clock = gateway.answered.clock
            gateway.answered.clock = lambda: clock() + 50
            gateway.reassembler.clock = lambda: time.monotonic() + 3 * (ttl + 1)
            await deliver(early)
            await until(lambda: gateway.counters["replays"] == before["replays"] + 2)
            assert gateway.counters["prompts"] == before["prompts"] + 2
            assert gateway.counters["failed"] == before["failed"]
        finally:
            await net.close()

    run(main(), timeout=120)
