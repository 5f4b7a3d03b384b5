"""A client floods a one-validator network's public RPC with heavy `/prefix` queries (abci_query) from
twelve connections at once: the whole state (a thousand users' entries, more than 3,000) at every
retained height in turn, so that the app walks `max_query_entries` (3,000) leaves of the trie before it
refuses each with OVERSIZE. Refusals are never cached and their answers are small, so the work is the
app's, not CometBFT's. Queries are answered on worker threads from the committed state through database
snapshots of their own, never on the event loop that runs FinalizeBlock and Commit: blocks keep at least
half their pace before the flood (measured: 16 blocks in 5 s during it against 16 before it, in two
runs), an honest registration commits and a verified list is read during it. Before this, with queries
answered on that loop, back to back while the flood kept CometBFT's query connection full, the same
flood cut the pace to 5 blocks in 5 s against 16 (and to 2 to 5 in 6 s against 19 in earlier runs)."""

from __future__ import annotations

import base64
import itertools
import threading
import time

import httpx
import pytest
from chainnet import ledger, start_network

from planetserve.chain import tx as txlib
from planetserve.chain.keys import KeySet
from planetserve.chain.messages import RegisterUser
from planetserve.registry.params import Params

pytestmark = [pytest.mark.network]

USERS = 1_000
MAX_ENTRIES = 3_000
FLOODERS = 12
BATCH = 100
WINDOW = 5.0
PARAMS = Params(probation_epochs=0, user_work_bits=0, max_query_entries=MAX_ENTRIES)


def register_many(url: str, chain_id: str, count: int) -> None:
    """`count` fresh users in batches of broadcast_tx_async."""
    with httpx.Client(timeout=30.0) as http:
        for start in range(0, count, BATCH):
            body = []
            for i in range(start, min(count, start + BATCH)):
                keys = KeySet.generate()
                msg = RegisterUser(f"10.8.{i // 256}.{i % 256}:9000", "flood").solved(chain_id, keys.public, PARAMS)
                raw = txlib.sign(keys, chain_id, msg, 0)
                body.append({"jsonrpc": "2.0", "id": i, "method": "broadcast_tx_async",
                             "params": {"tx": base64.b64encode(raw).decode()}})
            answers = http.post(url, json=body).json()
            assert all(a.get("result", {}).get("code") == 0 for a in answers), answers[:3]


def flood(url: str, heights: list[int], stop: threading.Event, answered: list[int], seed: int) -> None:
    """Heavy queries back to back until stopped: the whole state, each at another retained height (an
    old height's list is read from the trie), refused once `max_query_entries` leaves are read."""
    prefix = ""  # the whole state: every entry of every user
    with httpx.Client(timeout=60.0) as http:
        for n in itertools.count(seed):
            if stop.is_set():
                return
            height = heights[n % len(heights)]
            try:
                r = http.post(url, json={"jsonrpc": "2.0", "id": n, "method": "abci_query",
                                         "params": {"path": "/prefix", "data": prefix, "height": str(height),
                                                    "prove": True}})
                if r.status_code == 200 and b'"code":6' in r.content:
                    answered[0] += 1
            except httpx.HTTPError:
                pass


def blocks_in(net, seconds: float) -> int:
    start = net.height(0)
    time.sleep(seconds)
    return net.height(0) - start


def test_a_flood_of_heavy_queries_does_not_hold_up_blocks(tmp_path):
    net = start_network(tmp_path / "net", n=1, params=PARAMS,
                        extra_config={"rpc": {"max_request_batch_size": BATCH}})
    try:
        client = ledger(net)
        chain_id = client.chain_id()
        register_many(net.rpc_url(0), chain_id, USERS)
        deadline = time.monotonic() + 60
        while len(client.users("flood")[1]) < USERS:
            assert time.monotonic() < deadline, "the users did not all commit"
            time.sleep(0.5)
        first = net.height(0)
        net.wait_for_height(first + 2)
        before = blocks_in(net, WINDOW)
        assert before >= 4, f"only {before} blocks in {WINDOW} s before the flood"

        latest = net.height(0)
        heights = list(range(first, latest))  # the whole state at each of these heights
        stop, answered = threading.Event(), [0]
        flooders = [threading.Thread(target=flood, args=(net.rpc_url(0), heights, stop, answered, i * 7))
                    for i in range(FLOODERS)]
        for t in flooders:
            t.start()
        try:
            time.sleep(1.0)  # the flood is under way
            during = blocks_in(net, WINDOW)
            honest = KeySet.generate()
            msg = RegisterUser("10.7.0.1:9000", "eu").solved(chain_id, honest.public, PARAMS)
            done = client.submit(honest, msg, timeout=20)
            assert done.outcome.ok, done.outcome.log
            client.min_height = done.height
            listing, users = client.users("eu")  # verified against a header signed during the flood
            assert listing.verified and [u.pubkey for u in users] == [honest.public]
        finally:
            stop.set()
            for t in flooders:
                t.join()
        assert answered[0] >= FLOODERS, f"the flood got only {answered[0]} answers"
        # the pace during the flood is at least half the pace before it (answered on the event loop,
        # about a quarter)
        assert during * 2 >= before, f"{during} blocks in {WINDOW} s during the flood, {before} before it"
    finally:
        net.close()
