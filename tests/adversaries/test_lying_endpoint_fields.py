"""A lying RPC endpoint, a real HTTP server, that answers with what no CometBFT sends: integers spelled
"--1" or "²" (which `str.isdigit` took and `int` refused), a status without its chain id, an account
entry that is not a sequence, or an answer that trickles in a byte at a time within each read's timeout.
Each raised an error no caller handled, or held a call for ever: a relay's directory loop and a model
node's group loop ended for good (so lists past `max_age` were never dropped), a user's heartbeat task
died. Now each is an RpcError, a whole call has a deadline, and the list loops outlive whatever a read
raises."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest
from lyingrpc import Answer, json_answer, lying_endpoint
from test_lightclient import FakeChain, make_keys, uniform
from waiting import run

from planetserve.chain.client import LedgerClient, _sequence
from planetserve.chain.lightclient import LightClient
from planetserve.chain.rpc import RpcClient, RpcMalformed, RpcUnreachable
from planetserve.node.overlay.directory import OnDemand
from planetserve.registry import codec


def trickle(handler: BaseHTTPRequestHandler) -> None:
    """The answer a byte every 0.3 s, for ever, each byte within a read's timeout."""
    handler.send_response(200)
    handler.end_headers()
    for _ in range(200):
        handler.wfile.write(b" ")
        handler.wfile.flush()
        time.sleep(0.3)


@pytest.fixture
def endpoint() -> Iterator[tuple[str, list[Answer]]]:
    with lying_endpoint() as script:
        yield script.url, script.answers


@pytest.mark.parametrize("height", ["--1", "\u00b2", "\u0663", "9223372036854775808", 2**63, "1e3"])
def test_an_integer_no_cometbft_sends_is_malformed(endpoint, height):
    url, answers = endpoint
    answers.append(json_answer({"sync_info": {"latest_block_height": height}}))
    with RpcClient(url) as rpc, pytest.raises(RpcMalformed, match="expected an int64"):
        rpc.latest_height()


def test_a_status_without_its_chain_id_and_an_account_that_is_no_sequence_are_malformed(endpoint):
    url, answers = endpoint
    answers.append(json_answer({"sync_info": {}}))
    with RpcClient(url) as rpc, pytest.raises(RpcMalformed, match="node_info"):
        LedgerClient(rpc, None).chain_id()  # type: ignore[arg-type]
    for entry, words in ((codec.pack("seven"), "non-negative integer"), (codec.pack(-1), "non-negative integer"),
                         (b"\xc1", "account sequence")):
        with pytest.raises(RpcMalformed, match=words):
            _sequence(entry)


def test_an_answer_that_trickles_in_ends_at_the_calls_deadline(endpoint):
    url, answers = endpoint
    answers.append(trickle)
    with RpcClient(url, timeout=0.5) as rpc:
        started = time.monotonic()
        with pytest.raises(RpcUnreachable, match="took over 3 s to answer"):
            rpc.status()
        assert time.monotonic() - started < 3 + 1.0  # the deadline and at most one read's wait


def test_the_loops_go_on_reading_after_a_read_fails(endpoint):
    """A list read (`OnDemand`, what a relay's directory loop and a model node's group loop run) over an
    endpoint that answers garbage: the failure is logged, and the next read takes the honest answer."""
    url, answers = endpoint
    answers.append(json_answer({"sync_info": {"latest_block_height": "--1"}}))
    seen: list[int] = []

    async def main() -> None:
        with RpcClient(url) as rpc:
            refresh = OnDemand(rpc.latest_height, seen.append, min_interval=0)
            await refresh()
            answers[0] = json_answer({"sync_info": {"latest_block_height": "7"}})
            await asyncio.wait_for(refresh(), 10)

    run(main())
    assert seen == [7]


def test_a_verified_client_signs_for_its_genesis_chain_whatever_the_endpoint_names(endpoint):
    """A client verifying the endpoint against a genesis file signed for the chain id the endpoint named:
    a transaction it made could be replayed on that other chain. It signs for the genesis file's."""
    url, answers = endpoint
    answers.append(json_answer({"node_info": {"network": "another-chain"}}))
    chain = FakeChain([uniform(make_keys(4, "genesis"))] * 4, chain_id="the-genesis-chain")
    with RpcClient(url) as rpc:
        assert LedgerClient(rpc, None).chain_id() == "another-chain"
        verified = LedgerClient(rpc, LightClient(chain.genesis(), chain.rpc()))  # type: ignore[arg-type]
        assert verified.chain_id() == "the-genesis-chain"
