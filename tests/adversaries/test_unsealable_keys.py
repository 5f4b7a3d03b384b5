"""An adversary that registers a key nothing can be sealed to: an ed25519 key with a small-order part,
under which signatures verify but which libsodium refuses to convert to X25519. Registered as a user it
was listed as a relay, and every honest user that drew it into a route had a path stuck "building" and
its path maintenance ended (10 of 12 chats failed, for good); as a model node, no clove could reach it.
The ledger now refuses such a key as a user, a model node or a node's new key, and a user's relay that
meets one in its list all the same fails that one setup and keeps its paths."""

from __future__ import annotations

from dataclasses import replace

import pytest
from committee import EPOCH_PARAMS, Script
from harness import AppHarness, node_body, sqlite_url
from overlaynet import chat, directory, make_user, start_overlay
from smallorder import SmallOrderKeys
from waiting import run, until

from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.chain.messages import RotateNodeKey
from planetserve.registry.entities import User

CHAIN_ID = "planetserve-test"
REFUSAL = "small-order part: no onion layer or clove can be sealed to it"


@pytest.fixture
def s(tmp_path) -> Script:
    return Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))


def test_the_ledger_registers_no_key_that_nothing_can_be_sealed_to(s):
    adversary = SmallOrderKeys()
    old = next(iter(s.nodes.values()))
    attempts = (
        ("signer", lambda: s.h.tx(adversary, "register-user", {"address": "10.0.0.9:9000", "region": "eu"})),
        ("node_pubkey", lambda: s.h.tx(s.owner, "register-model-node", node_body(adversary))),
        ("new_pubkey", lambda: s.h.tx(s.owner, "rotate-node-key",
                                      RotateNodeKey.signed(CHAIN_ID, "org1", old, adversary).body())),
    )
    for field, attempt in attempts:
        raw = attempt()
        checked = s.h.check(raw)
        assert checked.code == Code.INVALID_FIELD and field in checked.log and REFUSAL in checked.log, checked.log
        [result] = s.h.block(raw).tx_results
        assert result.code == Code.INVALID_FIELD, result.log
    assert s.state.user(adversary.public) is None and s.state.node(adversary.public) is None
    assert s.state.retired(old.public) is None
    honest = KeySet.generate()
    [ok] = s.h.block(s.h.tx(honest, "register-user", {"address": "10.0.0.8:9000", "region": "eu"})).tx_results
    assert ok.code == 0, ok.log


def test_a_listed_key_nothing_can_be_sealed_to_costs_a_user_no_paths(quick_family):
    async def main():
        net = await start_overlay(quick_family, [make_user() for _ in range(6)], 1)
        try:
            client = net.client
            listed = directory(net.users, net.nodes, 2)
            poison = User(SmallOrderKeys().public, "127.0.0.1:9", "global", 0, 1 << 40)
            view = replace(listed, users={**listed.users, poison.pubkey: poison})
            for user in net.users:
                user.apply_view(view)
            failures = client.paths.counters["setup_failures"]
            statuses = [(await chat(client, f"Question {i}?")).status_code for i in range(8)]
            assert statuses == [200] * 8
            await until(lambda: client.paths.counters["setup_failures"] > failures, timeout=30)
            assert "nothing can be sealed to it" in client.paths.last_error
            assert not any(poison.pubkey in p.route for p in client.paths.live())
            await until(lambda: not any(poison.pubkey in p.route for p in client.paths.paths.values()))
            assert await client.paths.wait_live(client.paths.settings.target, 20)
        finally:
            await net.close()

    run(main(), timeout=180)
