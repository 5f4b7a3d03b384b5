"""User relays as their own processes (`planetserve node user`) on a real four-validator network with a
model node process: they register themselves, build onion paths to each other over TLS between
processes, and the OpenAI client library talks to a relay's endpoint as to any OpenAI server."""

from __future__ import annotations

import json

import pytest
from chainnet import SHORT_EPOCHS
from modelnodes import signed
from openai import OpenAI
from roles import RelayProcess, acme_network, init_user, planetserve, relay_retried
from waiting import wait_until

pytestmark = pytest.mark.network

RELAYS = 5


def test_an_openai_client_chats_through_user_relays_on_the_ledger(tmp_path, quick_family):
    with acme_network(tmp_path, quick_family, SHORT_EPOCHS) as (net, client, node, relays):
        homes = [tmp_path / f"user{i}" for i in range(RELAYS)]
        for home in homes:
            init_user(home, net)
        bad = planetserve("node", "init-user", "--home", str(tmp_path / "x"), "--genesis",
                          str(net.spec.genesis_path), "--proxies", "2")
        assert bad.returncode != 0 and "--proxies >= --n >= --k" in bad.stderr
        relays.extend(RelayProcess(home) for home in homes)
        ready = [relay.wait_ready() for relay in relays]
        assert {r["registration"] for r in ready} == {"registered"}
        listing, users = client.users()
        assert listing.verified and {u.pubkey.hex() for u in users} == {r["user"] for r in ready}

        me = relays[0]
        wait_until(lambda: len(me.status()["paths"]) >= 4, timeout=60)
        openai = OpenAI(base_url=f"{me.ready['http']}/v1", api_key="not-needed", max_retries=0)
        assert [m.id for m in openai.models.list().data] == ["gt"]
        answer, attempts = relay_retried(lambda: openai.chat.completions.create(
            model="gt", messages=[{"role": "user", "content": "What does the json module do?"}],
            max_tokens=8, temperature=0), lambda: f"relay {me.status()}; node {node.status()}")
        text = answer.choices[0].message.content
        assert text and answer.usage.completion_tokens > 0
        response = signed(answer.model_dump())
        assert response.node.hex() == node.ready["node"]
        stream = openai.chat.completions.create(
            model="gt", messages=[{"role": "user", "content": "What does the json module do?"}],
            max_tokens=8, temperature=0, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text

        # the paths ran through the other relay processes
        assert sum(r.status()["relay_counters"]["setups"] for r in relays[1:]) >= 3 * 4
        # each call the relay retried may or may not have reached the node before it failed
        assert 2 <= node.status()["overlay"]["prompts"] <= attempts + 1

        # a restarted relay renews its registration and is back in service
        relays[1].stop()
        relays[1] = RelayProcess(homes[1])
        assert relays[1].wait_ready()["registration"] == "renewed"
        wait_until(lambda: len(me.status()["paths"]) >= 4, timeout=60)
        again = openai.completions.create(model="gt", prompt="The os module", max_tokens=4,
                                          extra_body={"ignore_eos": True})
        assert again.choices[0].finish_reason == "length" and again.usage.completion_tokens == 4

        # the organisation rotates the node's key: from the next epoch the relays reach it under the new
        # key, with no step of theirs (tests/test_network_key_rotation.py has the rest of rotation)
        sent = planetserve("node", "rotate-key", "--home", str(tmp_path / "mn"), "--org-keys",
                           str(tmp_path / "acme.json"), "--json")
        assert sent.returncode == 0, sent.stderr
        rotation = json.loads(sent.stdout)
        wait_until(lambda: client.node(bytes.fromhex(rotation["new"])) is not None, timeout=60)
        assert node.wait_ready()["node"] == rotation["new"]
        wait_until(lambda: me.status()["directory_height"] >= rotation["height"], timeout=30)
        rotated, _ = relay_retried(lambda: openai.chat.completions.create(
            model="gt", messages=[{"role": "user", "content": "What does the re module do?"}],
            max_tokens=4, temperature=0), lambda: f"relay {me.status()}; node {node.status()}")
        assert signed(rotated.model_dump()).node.hex() == rotation["new"] != response.node.hex()
