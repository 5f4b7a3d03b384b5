"""Lists longer than one query answer (the chain's `max_query_entries`), on a real validator: the app
refuses them whole with code 6 (OVERSIZE); the client reads them in parts, one per child of the trie
node that holds the list, each part proven on its own and all of one height, so together they are the
whole list; a lying endpoint can neither drop a part's entry nor invent a refusal to hide entries."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import pytest
from chainnet import ledger, start_network
from tamper import TamperProxy

from planetserve.chain import layout
from planetserve.chain.client import LedgerClient, QueryRefused
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.chain.messages import RegisterUser
from planetserve.chain.rpc import RpcClient
from planetserve.localnet.cluster import Cluster
from planetserve.registry import codec
from planetserve.registry.params import Params

pytestmark = pytest.mark.network

MAX_ENTRIES = 3
REGIONS = {"eu": 9, "us": 5, "x": 1}


@dataclass
class Registered:
    cluster: Cluster
    users: dict[str, set[bytes]]
    """Region -> the users registered there."""
    height: int
    """The height of the last registration."""

    def client(self, url: str | None = None) -> LedgerClient:
        client = ledger(self.cluster, url=url)
        client.min_height = self.height
        return client


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    cluster = start_network(tmp_path_factory.mktemp("long"), n=1, params=Params(max_query_entries=MAX_ENTRIES))
    try:
        client = ledger(cluster)
        users: dict[str, set[bytes]] = {}
        for region, count in REGIONS.items():
            for _ in range(count):
                user = KeySet.generate()
                done = client.submit(user, RegisterUser("10.0.0.1:9000", region))
                assert done.outcome.ok, done.outcome.log
                users.setdefault(region, set()).add(user.public)
        yield Registered(cluster, users, client.min_height)
    finally:
        cluster.close()


def test_the_app_refuses_a_list_longer_than_one_answer_with_oversize(net):
    answer = net.cluster.rpc(0).abci_query("/prefix", layout.user_list_prefix(), prove=True)
    assert answer.code == Code.OVERSIZE and f"more than {MAX_ENTRIES} entries" in answer.log


def test_the_client_reads_a_long_list_in_proven_parts(net):
    everyone = set().union(*net.users.values())
    listing, users = net.client().users()
    assert listing.verified and len(listing.entries) == len(everyone) == sum(REGIONS.values())
    assert {u.pubkey for u in users} == everyone
    assert [k for k, _ in listing.entries] == sorted(k for k, _ in listing.entries)  # key order, once each
    for region, keys in net.users.items():  # "eu" and "us" in parts, "x" whole
        assert {u.pubkey for u in net.client().users(region)[1]} == keys

    unverified = LedgerClient(RpcClient(net.cluster.rpc_url(0)), None)
    listing, users = unverified.users()
    assert not listing.verified and {u.pubkey for u in users} == everyone


def _rewrite_answers_to(prefix: bytes, mutate):
    def rewrite(method, params, answer):
        if method == "abci_query" and bytes.fromhex(params.get("data", "")) == prefix and "result" in answer:
            mutate(answer["result"]["response"])
        return answer

    return rewrite


def test_a_lying_endpoint_cannot_drop_an_entry_from_a_part(net):
    """Each part is proven complete on its own: an endpoint that answers one honestly refused
    sub-list without its last entry is caught."""
    proxy = TamperProxy(net.cluster.rpc_url(0))
    client = net.client(proxy.url)
    seen: list[bytes] = []

    def record(method, params, answer):
        if method == "abci_query" and answer.get("result", {}).get("response", {}).get("code", 0) == 0:
            seen.append(bytes.fromhex(params["data"]))
        return answer

    def drop_last(response):
        entries = codec.unpack(base64.b64decode(response["value"]))
        response["value"] = base64.b64encode(codec.pack(entries[:-1])).decode()

    try:
        proxy.rewrite = record
        client.users()
        part = next(p for p in seen if p.startswith(layout.user_list_prefix("eu")) and not p.endswith(b"\x00"))
        proxy.rewrite = _rewrite_answers_to(part, drop_last)
        with pytest.raises(QueryRefused, match="does not match the committed app hash"):
            client.users()
    finally:
        proxy.close()


def test_a_lying_endpoint_cannot_hide_entries_behind_an_invented_refusal(net):
    """Claiming a one-entry list is too long makes the client look for the node that holds it: the
    proof shows there is none with more than one entry, and the read fails instead of coming back
    short."""
    proxy = TamperProxy(net.cluster.rpc_url(0))
    client = net.client(proxy.url)

    def refuse(response):
        response.update(code=int(Code.OVERSIZE), log=f"more than {MAX_ENTRIES} entries", value=None)

    try:
        assert len(client.users("x")[1]) == 1
        proxy.rewrite = _rewrite_answers_to(layout.user_list_prefix("x"), refuse)
        with pytest.raises(QueryRefused, match="yet no trie node holds more than one of its entries"):
            client.users("x")
    finally:
        proxy.close()
