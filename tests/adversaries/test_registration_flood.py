"""A client floods a real four-validator network with registrations from fresh keys, each with a valid
proof of work (cheap at this chain's difficulty), through every validator's public RPC, as fast as one
thread can make them (about 15,000 in the test's 20 s), while the committee elects the next epoch's
leader and commits its plan. CheckTx admits at most `max_registrations_per_block` registrations and
`mempool_non_member_txs` non-member transactions between two blocks, and PrepareProposal puts the
committee's work first: the epoch's transactions commit in their windows, the leader is elected by VRF,
the plan is committed, and the ledger takes at most the cap of registrations a block. Without the
limits, the same flood commits about 4,700 registrations in 26 blocks (the growth assertion fails);
the epoch's transactions still commit at this load, because the app drains a 600-transaction mempool
every block, so that part of the test shows the defence holding rather than a failure it prevents."""

from __future__ import annotations

import base64
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from chainnet import ledger, member_keys, start_network

from planetserve.chain import tx as txlib
from planetserve.chain import vrf
from planetserve.chain.keys import KeySet
from planetserve.chain.messages import CommitPlan, RegisterUser, SubmitVrf
from planetserve.registry import epochs
from planetserve.registry.params import Params

pytestmark = [pytest.mark.network]

PARAMS = Params(epoch_blocks=24, results_blocks=8, vrf_window_blocks=8, plan_window_blocks=8,
                probation_epochs=0, user_work_bits=4, mempool_non_member_txs=300)
SCHEDULE = epochs.Schedule.from_params(PARAMS)
MEMPOOL = 600
BATCH = 50


def registration(chain_id: str, i: int) -> bytes:
    keys = KeySet.generate()
    msg = RegisterUser(f"10.9.{i // 256 % 256}.{i % 256}:9000", "flood").solved(chain_id, keys.public, PARAMS)
    return txlib.sign(keys, chain_id, msg, 0)


def flood(urls: list[str], chain_id: str, stop: threading.Event, sent: list[int]) -> None:
    """Open loop until stopped: batches of fresh registrations by broadcast_tx_async, round robin over
    the validators."""
    with httpx.Client(timeout=10.0) as http:
        while not stop.is_set():
            i = sent[0]
            body = [{"jsonrpc": "2.0", "id": n, "method": "broadcast_tx_async",
                     "params": {"tx": base64.b64encode(registration(chain_id, i + n)).decode()}}
                    for n in range(BATCH)]
            with contextlib.suppress(httpx.HTTPError):
                http.post(urls[(i // BATCH) % len(urls)], json=body)
            sent[0] = i + BATCH


def test_a_registration_flood_does_not_keep_the_epochs_work_out(tmp_path):
    net = start_network(tmp_path / "net", params=PARAMS, limits=True, timeout_commit="200ms",
                        extra_config={"mempool": {"size": MEMPOOL, "cache_size": 10 * MEMPOOL},
                                      "rpc": {"max_request_batch_size": BATCH}})
    try:
        clients = [ledger(net, i) for i in range(4)]
        members = [member_keys(net, i) for i in range(4)]
        chain_id = clients[0].chain_id()
        stop, sent = threading.Event(), [0]
        flooder = threading.Thread(target=flood, args=([net.rpc_url(i) for i in range(4)], chain_id, stop, sent))
        flooder.start()
        try:
            net.wait_for_height(SCHEDULE.setup_height(0), timeout=60)
            assert sent[0] >= MEMPOOL, "the flood had not started when the window opened"
            for client in clients:
                client.min_height = SCHEDULE.setup_height(0)
            seed = clients[0].epoch(1).seed
            with ThreadPoolExecutor(4) as pool:
                done = list(pool.map(lambda i: clients[i].submit(
                    members[i], SubmitVrf(1, vrf.prove(bytes(members[i].vrf), seed)), timeout=20), range(4)))
            assert [d.outcome.code for d in done] == [0] * 4, [d.outcome.log for d in done]
            leader0 = clients[0].epoch(0).leader
            i = next(i for i, m in enumerate(members) if m.public == leader0)
            planned = clients[i].submit(members[i], CommitPlan(1, (), final=True), timeout=20)
            assert planned.outcome.code == 0, planned.outcome.log
            assert max(d.height for d in [*done, planned]) <= SCHEDULE.end(0)
        finally:
            stop.set()
            flooder.join()
        net.wait_for_height(SCHEDULE.start(1) + 1, timeout=60)
        clients[0].min_height = SCHEDULE.start(1)
        epoch = clients[0].epoch(1)
        assert epoch.election == "vrf" and epoch.plan_status == epochs.PLAN_COMMITTED
        _, registered = clients[0].users("flood")
        height = clients[0].rpc.latest_height()
        # the ledger grew by at most the cap a block, however many fresh keys came (without the limits,
        # thousands of the flood's registrations commit in these blocks)
        assert 0 < len(registered) <= PARAMS.max_registrations_per_block * height, (len(registered), height)
    finally:
        net.close()
