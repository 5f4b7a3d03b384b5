"""A real four-validator network: agreement, crash and restart of validators and apps, lying endpoints,
and a CheckTx flood through one validator's public RPC."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing, suppress
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
from chainnet import assert_same_app_hashes, ledger, member_keys, start_network
from tamper import TamperProxy
from waiting import run, until, wait_until

from planetserve.chain import layout
from planetserve.chain import tx as txlib
from planetserve.chain.client import LedgerClient, OutcomeMismatch, QueryRefused
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.chain.lightclient import LightClient, VerificationError
from planetserve.chain.messages import (
    Heartbeat,
    ProposeMember,
    RegisterModel,
    RegisterModelNode,
    RegisterOrg,
    RegisterUser,
    VoteMember,
)
from planetserve.chain.rpc import RpcClient, RpcError
from planetserve.dashboard.collect import Collector, Settings
from planetserve.genesis.network import edit_toml, free_ports
from planetserve.localnet.processes import read_pids
from planetserve.node.home import UserConfig
from planetserve.node.overlay.directory import Directory
from planetserve.node.overlay.transport import Peering, TransportError
from planetserve.node.routing.group import Group
from planetserve.node.user import UserRelay
from planetserve.registry import codec
from planetserve.registry.entities import ModelNode
from planetserve.registry.params import Params

pytestmark = pytest.mark.network

JUNK = 3_000
"""The most junk transactions the CheckTx flood sends to one validator's RPC: it goes on until an honest
transaction sent during it has committed, the validator has committed two blocks and more junk has been
answered since (300 took 0.9 s on a fast machine, under one block)."""
JUNK_BEFORE = 75
"""Junk answered before the honest transaction is sent."""
JUNK_SENDERS = 4
JUNK_SECONDS = 60.0
"""The flood's time limit: all of it must have been answered by then."""
FLOOD_RSS_BOUND = 32 << 20
"""What the flood may add to the flooded app's resident memory (bytes), a tenth of what the old cache of
decoded transactions kept: 1.1 MiB per junk transaction, 328 MiB for this flood (measured)."""


def resident_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for {pid}")


def cpu_seconds(pid: int) -> float:
    """The CPU time a process has used, user and system."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    cluster = start_network(tmp_path_factory.mktemp("net"))
    yield cluster
    cluster.close()


def register_org_and_nodes(client, org_id: str, count: int) -> list[KeySet]:
    owner = KeySet.generate()
    assert client.submit(owner, RegisterOrg(org_id, org_id)).outcome.code == 0
    nodes = []
    for i in range(count):
        node = KeySet.generate()
        done = client.submit(owner, RegisterModelNode.signed(
            client.chain_id(), org_id, node, model_id="gt", address=f"127.0.0.1:{7000 + i}", hardware="cpu", capacity=2,
            region="local"))
        assert done.outcome.code == 0, done.outcome.log
        nodes.append(node)
    return nodes


def test_registry_txs_commit_and_all_app_hashes_agree(net):
    clients = [ledger(net, i) for i in range(4)]
    nodes = register_org_and_nodes(clients[0], "org-a", 2)
    user = KeySet.generate()
    done = clients[2].submit(user, RegisterUser("127.0.0.1:9100", "eu"))
    assert done.outcome.code == 0
    for client in clients:  # every validator answers the same verified lists
        client.min_height = done.height
        listing, listed = client.nodes("gt")
        assert listing.verified
        assert sorted(n.pubkey for n in listed) == sorted(k.public for k in nodes)
        _, users = client.users("eu")
        assert [u.pubkey for u in users] == [user.public]
    height = min(net.wait_for_height(0).values())
    assert_same_app_hashes(net, height)


def test_refused_tx_reports_its_code_over_rpc(net):
    client = ledger(net, 1)
    stranger = KeySet.generate()
    done = client.submit(stranger, RegisterModel("m", "n"))
    assert done.outcome.code == 10 and "committee" in done.outcome.log


def test_a_checktx_flood_through_a_validators_rpc_leaves_its_app_memory_and_honest_traffic_alone(net):
    """A client floods one validator's public RPC (broadcast_tx_sync, from several connections) with
    well-signed heartbeats at a wrong sequence whose bodies are the densest the decoder admits: as many
    empty lists as a transaction of the byte limit may hold (`tx.max_containers`), padded to the limit
    (bodies of 15,800 lists are refused undecoded: tests/adversaries/test_checktx_flood.py). The app
    refuses each on its sequence and keeps nothing of it: its resident memory grows by less than
    FLOOD_RSS_BOUND (measured: 0.1-0.2 MiB; with the old cache of decoded transactions, 328 MiB), honest
    transactions sent through the same RPC during and after the flood commit, and the app lives on (the
    same process) while blocks keep coming."""
    flooded = 1
    home = net.spec.validators[flooded].home
    pid = read_pids(home)["app"]["pid"]
    client = ledger(net, flooded)
    chain_id = client.chain_id()
    attacker = KeySet.generate()
    limit = Params().max_tx_bytes  # the network's: it runs on the defaults
    lists = txlib.max_containers(limit) - 3  # the envelope, the body, the list of lists
    probe = txlib.build(attacker, chain_id, "heartbeat", {"junk": [[]] * lists, "pad": bytes(1_000)}, 1_000)
    body = {"junk": [[] for _ in range(lists)], "pad": bytes(1_000 + limit - len(probe))}

    def junk(i: int) -> bytes:
        """`txlib.build`'s bytes, packed without its canonical walk of the body (already canonical), which
        would make the client, not the validator, the bottleneck."""
        sequence = 1_000 + i
        signed = [txlib.DOMAIN, chain_id, "heartbeat", body, attacker.public, sequence]
        signature = attacker.sign(msgpack.packb(signed, use_bin_type=True))
        return msgpack.packb([txlib.VERSION, "heartbeat", body, attacker.public, sequence, chain_id, signature],
                             use_bin_type=True)

    assert junk(0) == txlib.build(attacker, chain_id, "heartbeat", body, 1_000)
    assert len(junk(0)) == limit
    with RpcClient(net.rpc_url(flooded)) as rpc:  # the decoder's transient memory is in use before measuring
        assert [rpc.broadcast_tx_sync(junk(-i)).code for i in range(1, 5)] == [Code.BAD_SEQUENCE] * 4
    before, cpu, began = resident_bytes(pid), cpu_seconds(pid), time.monotonic()
    height = net.rpc(flooded).latest_height()
    deadline = began + JUNK_SECONDS
    codes: dict[int, int] = {}
    errors: list[str] = []
    numbers = itertools.count()
    stop = threading.Event()

    def flood() -> None:
        with RpcClient(net.rpc_url(flooded)) as rpc:
            while not stop.is_set() and time.monotonic() < deadline and (i := next(numbers)) < JUNK:
                try:
                    codes[i] = rpc.broadcast_tx_sync(junk(i)).code
                except RpcError as exc:
                    errors.append(str(exc))

    def blocks() -> int:
        return net.rpc(flooded).latest_height() - height

    senders = [threading.Thread(target=flood) for _ in range(JUNK_SENDERS)]
    for sender in senders:
        sender.start()
    try:
        wait_until(lambda: len(codes) + len(errors) >= JUNK_BEFORE, timeout=JUNK_SECONDS)
        during = client.submit(KeySet.generate(), RegisterOrg("during-flood", "x"))
        answered_by_then = len(codes)
        # the flood goes on after the honest transaction committed: it did not have to wait for its end
        wait_until(lambda: len(codes) > answered_by_then and blocks() >= 2 or errors or not any(
            sender.is_alive() for sender in senders), timeout=JUNK_SECONDS)
    finally:
        stop.set()
        for sender in senders:
            sender.join()
    seconds, sent, committed = time.monotonic() - began, len(codes), blocks()
    after, cpu = resident_bytes(pid), cpu_seconds(pid) - cpu
    print(f"\nCheckTx flood: {sent} junk transactions in {seconds:.1f} s through one RPC; the app's RSS "
          f"{before / 2**20:.1f} -> {after / 2**20:.1f} MiB, its CPU {cpu * 1000 / sent:.1f} ms per junk "
          f"transaction (blocks included), {committed} blocks meanwhile")
    assert not errors, errors[:3]
    assert sorted(codes.items()) == [(i, Code.BAD_SEQUENCE) for i in range(sent)], "the flood was not all answered"
    assert after - before < FLOOD_RSS_BOUND, f"the app grew by {(after - before) >> 20} MiB"
    assert answered_by_then < sent < JUNK, "the honest transaction committed only once the flood was over"
    assert committed >= 2, f"the flooded validator committed {committed} blocks in the flood's {seconds:.1f} s"
    done = client.submit(KeySet.generate(), RegisterOrg("after-flood", "x"))
    assert [during.outcome.code, done.outcome.code] == [0, 0], [during.outcome.log, done.outcome.log]
    other = ledger(net, 0)
    other.min_height = done.height
    assert other.org("during-flood") is not None and other.org("after-flood") is not None
    assert read_pids(home)["app"]["pid"] == pid and net.running(flooded)["app"]
    net.wait_for_height(done.height + 2, validators=[flooded], timeout=30)


@pytest.mark.faults
def test_one_down_continues_two_down_halts(net):
    client = ledger(net, 0)
    net.stop(3)
    start = max(net.wait_for_height(0, validators=[0, 1, 2]).values())
    net.wait_for_height(start + 3, validators=[0, 1, 2], timeout=30)
    owner = KeySet.generate()
    assert client.submit(owner, RegisterOrg("while-down", "x")).outcome.code == 0
    net.start(3)
    caught_up = max(net.wait_for_height(0, validators=[0]).values())
    net.wait_for_height(caught_up, validators=[3], timeout=60)
    assert_same_app_hashes(net, caught_up, validators=[0, 3])

    net.stop(2)
    net.stop(3)
    time.sleep(1.5)
    stalled = max(net.wait_for_height(0, validators=[0, 1]).values())
    time.sleep(3)
    assert max(net.wait_for_height(0, validators=[0, 1]).values()) <= stalled + 1, "blocks without 2/3"
    net.start(2)
    net.start(3)
    net.wait_for_height(stalled + 3, timeout=60)
    assert client.org("while-down") is not None
    assert_same_app_hashes(net, stalled + 2)


@pytest.mark.faults
def test_a_partitioned_validator_commits_nothing_and_catches_up(net):
    """v3's P2P port moves and it forgets its peers: the others' connections to it fail as if the
    port were blocked, and it reaches nobody. The other three keep committing what clients send;
    v3 commits nothing on its own; once the partition heals it catches up to the same app hashes."""
    config = net.spec.validators[3].home / "config" / "config.toml"
    original = config.read_text()
    client = ledger(net, 0)
    net.stop(3, part="cometbft")
    config.write_text(edit_toml(original, {"p2p": {"laddr": f"tcp://127.0.0.1:{free_ports(1)[0]}",
                                                   "persistent_peers": ""}}))
    try:
        net.start(3)
        isolated = net.rpc(3).latest_height()
        for i in range(3):
            done = client.submit(KeySet.generate(), RegisterOrg(f"partitioned-{i}", "x"))
            assert done.outcome.code == 0, done.outcome.log
        top = max(net.wait_for_height(0, validators=[0, 1, 2]).values())
        assert top >= isolated + 3
        assert net.rpc(3).latest_height() <= isolated + 1  # no block without 2/3 of the power
    finally:
        net.stop(3, part="cometbft")
        config.write_text(original)
        net.start(3)
    net.wait_for_height(top, validators=[3], timeout=60)
    assert_same_app_hashes(net, top, validators=[0, 3])
    assert all(ledger(net, 3).org(f"partitioned-{i}") is not None for i in range(3))


@pytest.mark.faults
def test_sigkill_app_under_load_recovers_same_app_hash(net):
    client = ledger(net, 0)
    stop = threading.Event()
    codes: dict[bytes, int] = {}  # key -> result code; -1: unknown (a submit that timed out may still commit)

    def load() -> None:
        while not stop.is_set():
            user = KeySet.generate()
            codes[user.public] = -1
            with suppress(Exception):  # the load only has to keep blocks busy
                codes[user.public] = client.submit(
                    user, RegisterUser("127.0.0.1:1", "load"), timeout=20).outcome.code

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    time.sleep(2)
    net.stop(2, sig=signal.SIGKILL, part="app")
    time.sleep(2)
    net.stop(2, part="cometbft")
    time.sleep(1)
    net.start(2)
    deadline = time.monotonic() + 60  # on a loaded machine one submit can take many seconds
    while list(codes.values()).count(0) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    stop.set()
    worker.join(30)
    top = max(net.wait_for_height(0, validators=[0]).values())
    net.wait_for_height(top, validators=[2], timeout=60)
    assert_same_app_hashes(net, top, validators=[0, 2])
    committed = {key for key, code in codes.items() if code == 0}
    assert len(committed) >= 3
    _, users = client.users("load")
    registered = {u.pubkey for u in users}
    assert committed <= registered <= set(codes)  # nothing lost, nothing invented
    assert all(codes[key] in (0, -1) for key in registered)


def test_an_institution_joins_from_its_own_home_and_is_admitted(net, tmp_path):
    """`chain init` makes a home from the published genesis and a member's peer address; the node
    syncs as a full node; a member proposes it with the keys `chain init` printed, two more approve
    (3 of 4), and it signs the next blocks with the same app hashes as the others."""
    ports = free_ports(5)
    made = subprocess.run(
        [sys.executable, "-m", "planetserve", "chain", "init", "--home", str(tmp_path / "newcomer"),
         "--genesis", str(net.spec.genesis_path), "--peer", net.spec.validators[0].p2p_address,
         "--moniker", "newcomer", "--p2p", f"127.0.0.1:{ports[0]}", "--rpc", f"127.0.0.1:{ports[1]}",
         "--abci", f"127.0.0.1:{ports[2]}", "--metrics", f"127.0.0.1:{ports[3]}",
         "--app-metrics", f"127.0.0.1:{ports[4]}", "--local", "--json"], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    joined = json.loads(made.stdout)
    refused = subprocess.run(
        [sys.executable, "-m", "planetserve", "chain", "init", "--home", str(tmp_path / "newcomer"),
         "--genesis", str(net.spec.genesis_path), "--peer", "not-a-peer", "--moniker", "x"],
        capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "not node_id@host:port" in refused.stderr
    node = subprocess.Popen([sys.executable, "-m", "planetserve", "chain", "start", "--home", joined["home"]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = ledger(net, 0)
        newcomer = RpcClient(f"http://127.0.0.1:{ports[1]}")
        wait_until(lambda: _height(newcomer) >= client.rpc.latest_height() - 1, timeout=60)  # synced

        proposal = ProposeMember("add", operator=bytes.fromhex(joined["operator"]),
                                 consensus_key=bytes.fromhex(joined["consensus_key"]),
                                 vrf_key=bytes.fromhex(joined["vrf_key"]),
                                 x25519_key=bytes.fromhex(joined["x25519_key"]),
                                 credential="Institute of Tests", power=1)
        assert client.submit(member_keys(net, 0), proposal).outcome.code == 0
        for i in (1, 2):
            done = client.submit(member_keys(net, i), VoteMember(1, True))
            assert done.outcome.code == 0, done.outcome.log
        height = client.rpc.latest_height()
        net.wait_for_height(height + 4)
        _, validators = client.rpc.validators(height + 3)
        assert len(validators) == 5
        _, committee = client.committee()
        assert {m.credential for m in committee} >= {"Institute of Tests"}
        address = hashlib.sha256(bytes.fromhex(joined["consensus_key"])).hexdigest()[:40].upper()

        def signed_by_newcomer() -> bool:
            latest = client.rpc.latest_height() - 1
            return address in {sig.get("validator_address")
                               for sig in client.rpc.commit(latest)["commit"]["signatures"]}

        wait_until(signed_by_newcomer, timeout=30)  # the newcomer votes on blocks now
        latest = client.rpc.latest_height()
        wait_until(lambda: _height(newcomer) >= latest, timeout=30)
        assert newcomer.commit(latest)["header"]["app_hash"] == client.rpc.commit(latest)["header"]["app_hash"]
        # a light client following the changed set still verifies the latest lists
        fresh = ledger(net, 1)
        listing, _ = fresh.nodes("gt")
        assert listing.verified and listing.height >= height + 2
    finally:
        node.terminate()
        node.wait(30)


def _height(rpc: RpcClient) -> int:
    try:
        return rpc.latest_height()
    except RpcError:
        return 0


def _rewrite_query(mutate):
    """A proxy rewrite that applies `mutate(response_dict)` to abci_query answers only."""

    def rewrite(method, params, answer):
        if method == "abci_query" and "result" in answer:
            mutate(answer["result"]["response"])
        return answer

    return rewrite


def _entries(response):
    return codec.unpack(base64.b64decode(response["value"]))


def _set_entries(response, entries):
    response["value"] = base64.b64encode(codec.pack(entries)).decode()


def alter_entry(response):
    entries = _entries(response)
    node = ModelNode.decode(entries[0][1])
    entries[0][1] = replace(node, address="203.0.113.66:7000").encode()
    _set_entries(response, entries)


def drop_entry(response):
    _set_entries(response, _entries(response)[1:])


def add_entry(response):
    entries = _entries(response)
    fake = replace(ModelNode.decode(entries[0][1]), pubkey=b"\x07" * 32)
    entries.append([entries[0][0][:-64] + b"f" * 64, fake.encode()])
    _set_entries(response, entries)


def corrupt_proof(response):
    op = response["proofOps"]["ops"][0]
    raw = bytearray(base64.b64decode(op["data"]))
    raw[len(raw) // 2] ^= 0x01
    op["data"] = base64.b64encode(bytes(raw)).decode()


def strip_proof(response):
    response["proofOps"] = None


def older_height(response):
    """Claim the answer is from height 2, before any node was registered."""
    response["height"] = "2"


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (alter_entry, "does not match the committed app hash"),
        (drop_entry, "does not match the committed app hash"),
        (add_entry, "does not match the committed app hash"),
        (corrupt_proof, "malformed proof|does not match the committed app hash"),
        (strip_proof, "proof missing"),
        (older_height, "asked for height"),
    ],
)
@pytest.mark.faults
def test_lying_endpoint_cannot_alter_the_node_list(net, mutate, words):
    honest = ledger(net, 0)
    if len(honest.nodes("gt")[1]) < 2:
        register_org_and_nodes(honest, f"org-{mutate.__name__}", 2)
    proxy = TamperProxy(net.rpc_url(1))
    try:
        client = ledger(net, url=proxy.url)
        client.min_height = honest.min_height
        assert len(client.nodes("gt")[1]) >= 2  # honest pass-through verifies
        proxy.rewrite = _rewrite_query(mutate)
        with pytest.raises(QueryRefused, match=words):
            client.nodes("gt")
    finally:
        proxy.close()


def test_a_list_read_again_in_one_snapshot_is_asked_for_once(net):
    """Inside a snapshot the client reads one verified state, so a list read again there (the verifier's
    tick reads an epoch's results once per duty) is not asked for and proven again; after a write of the
    client's own, and in the next snapshot, it is read anew."""
    proxy = TamperProxy(net.rpc_url(1))
    asked: list[str] = []

    def count(method: str, params: dict, answer: dict) -> None:
        if method == "abci_query" and params.get("path") == "/prefix":
            asked.append(params["data"])

    try:
        client = ledger(net, url=proxy.url)
        proxy.rewrite = count
        with client.snapshot():
            _, members = client.committee()
            assert client.committee()[1] == members and len(members) >= 4
            assert len(asked) == 1
            done = client.submit(KeySet.generate(), RegisterOrg("read-once", "x"))
            assert done.outcome.ok
            assert client.committee()[1] == members and client.committee()[1] == members
            assert len(asked) == 2  # once more, at our own write's height
        with client.snapshot():
            assert client.committee()[1] == members
        assert len(asked) == 3
    finally:
        proxy.close()


@pytest.mark.faults
def test_lying_endpoint_cannot_hide_an_entity(net):
    honest = ledger(net, 0)
    (node,) = register_org_and_nodes(honest, "org-hidden", 1)
    proxy = TamperProxy(net.rpc_url(1))

    def claim_absent(response):
        response["info"] = "absent"
        response["value"] = None

    try:
        client = ledger(net, url=proxy.url)
        client.min_height = honest.min_height
        assert client.node(node.public) is not None
        proxy.rewrite = _rewrite_query(claim_absent)
        with pytest.raises(QueryRefused, match="does not match the committed app hash"):
            client.node(node.public)
    finally:
        proxy.close()


@pytest.mark.faults
def forge_app_hash(method, params, answer):
    """Every signed header with an app hash of the endpoint's own (its signatures no longer match)."""
    if method == "commit" and "result" in answer:
        answer["result"]["signed_header"]["header"]["app_hash"] = "AB" * 32
    return answer


def test_lying_endpoint_cannot_forge_the_commit(net):
    proxy = TamperProxy(net.rpc_url(1))
    try:
        client = ledger(net, url=proxy.url)
        proxy.rewrite = forge_app_hash
        with pytest.raises(VerificationError, match="header hash mismatch"):
            client.nodes("gt")
    finally:
        proxy.close()


def test_the_dashboard_shows_the_ledger_only_where_its_witness_agrees(net):
    """The dashboard's witness (`--witness`) serves another header at every height, as one side of a fork
    would: the ledger's sections show its disagreement instead of the state read from the endpoint, whose
    headers verify against the genesis. Once the witness agrees again, the same dashboard shows them."""
    proxy = TamperProxy(net.rpc_url(1))
    collector = Collector(Settings(genesis=net.spec.genesis_path, rpc=(net.rpc_url(0),), witness=proxy.url))
    try:
        proxy.rewrite = forge_app_hash
        state = collector.collect()
        assert state["ledger"]["verified"] is False
        assert f"witness {proxy.url} disagrees with primary {net.rpc_url(0)}" in state["ledger"]["error"]
        assert state["nodes"]["items"] == [] and state["epoch"]["error"] == state["ledger"]["error"]
        proxy.rewrite = None
        state = collector.collect()
        assert state["ledger"]["verified"] is True and state["ledger"]["error"] is None
        assert state["ledger"]["height"] > 0 and state["epoch"]["error"] is None
    finally:
        collector.close()
        proxy.close()


@pytest.mark.faults
def test_a_relay_drops_lists_from_a_stalled_endpoint_keeps_running_and_recovers(net):
    """An endpoint stuck at one height keeps serving validly signed lists of it. A relay reading through
    it keeps its lists while they are fresh, drops them once they are older than max_age (its directory
    loop running on), and takes fresh lists again once the endpoint moves on; a model node's group too.
    Between, the endpoint answers every call with JSON built to exhaust its reader (5,000 levels deep,
    then 200,000 empty arrays): each is refused by name and the loop runs on."""
    max_age = 4.0
    honest = ledger(net, 0)
    (node,) = register_org_and_nodes(honest, "org-stale", 1)
    user = KeySet.generate()
    assert honest.submit(user, RegisterUser("127.0.0.1:9101", "global")).outcome.code == 0
    proxy = TamperProxy(net.rpc_url(1))
    rpc = RpcClient(proxy.url)
    client = LedgerClient(rpc, LightClient.from_genesis_file(net.spec.genesis_path, rpc, max_age=max_age),
                          min_height=honest.min_height)
    directory, group = Directory(client), Group(client, "gt")

    def freeze(method, params, answer):
        if method == "status" and "result" in answer:
            answer["result"]["sync_info"]["latest_block_height"] = str(frozen)
        return answer

    async def scenario():
        nonlocal frozen
        relay = UserRelay(UserConfig(peer="127.0.0.1:0", list_interval=0.2), KeySet.generate(), directory)
        await relay.start(serve_http=False)
        try:
            await until(lambda: user.public in relay.view.users and node.public in relay.view.nodes)
            assert node.public in group.refresh().members
            frozen = rpc.latest_height()
            proxy.rewrite = freeze
            since = time.monotonic()
            await until(lambda: not relay.view.users, timeout=max_age + 10)
            assert time.monotonic() - since < max_age + 3  # dropped once past the bound, not later
            assert relay.view.nodes == {} and not relay._authorized(user.public)
            assert "older than max_age 4 s" in directory.last_error
            assert group.refresh().members == {} and "older than max_age" in group.last_error
            loop = [t for t in relay._tasks if not t.done()]
            assert loop, "the directory loop stopped"
            for bomb, refusal in ((b"[" * 5_000 + b"]" * 5_000, "nests too deeply"),
                                  (b"[" + b"[]," * 200_000 + b"[]]", "more than 131072 arrays and objects")):
                proxy.rewrite = lambda method, params, answer, bomb=bomb: bomb
                await until(lambda refusal=refusal: refusal in (directory.last_error or ""), timeout=10)
                assert group.refresh().members == {} and refusal in group.last_error
                assert all(not t.done() for t in loop), "the directory loop stopped"
            proxy.rewrite = None
            await until(lambda: user.public in relay.view.users and node.public in relay.view.nodes)
            assert directory.last_error is None and relay.view.height > frozen - 1
            assert node.public in group.refresh().members
        finally:
            await relay.close()

    frozen = 0
    try:
        run(scenario(), timeout=60)
    finally:
        proxy.close()


def test_fresh_keys_knocking_at_a_relay_cost_its_endpoint_small_lookups_not_list_reads(net):
    """A hello needs only a fresh key pair. Before, each one the relay did not know made it read every
    list again (every user and node with their proofs), up to twice a second for as long as the knocks
    went on. Now a knocking key is first looked up alone: fresh keys cost the endpoint a few small
    lookups a second (each key at most once) and no list read, and a user who registered after the
    relay's last read is still let in, after one read."""
    honest = ledger(net, 0)
    proxy = TamperProxy(net.rpc_url(2))
    calls: list[str] = []

    def count(method, params, answer):
        calls.append(str(params.get("path", method)))
        return answer

    rpc = RpcClient(proxy.url)
    client = LedgerClient(rpc, LightClient.from_genesis_file(net.spec.genesis_path, rpc),
                          min_height=honest.min_height)

    async def knock(relay: UserRelay, keys: KeySet) -> bool:
        async def nothing(peer, msg_type, body):
            return None

        knocker = Peering(keys, nothing, lambda key: True)
        try:
            await knocker.connect(relay.keys.public, f"127.0.0.1:{relay.peer_port}")
            return True
        except TransportError:
            return False
        finally:
            await knocker.close()

    async def scenario():
        relay = UserRelay(UserConfig(peer="127.0.0.1:0", list_interval=600), KeySet.generate(), Directory(client))
        await relay.start(serve_http=False)
        try:
            await until(lambda: relay.view.height > 0)
            proxy.rewrite = count
            started = time.monotonic()
            first = [KeySet.generate() for _ in range(4)]
            refused = []
            for _ in range(6):  # a round of fresh keys, and the first ones again, every 0.6 s for 3 s
                refused += [not await knock(relay, keys) for keys in [*first, *(KeySet.generate() for _ in range(8))]]
                await asyncio.sleep(0.6)
            elapsed = time.monotonic() - started
            assert len(refused) == 72 and all(refused)
            assert "/prefix" not in calls  # no list read
            counts = relay.knocks.counts
            assert counts["lookups"] <= 8 + 4 * elapsed + 1 and calls.count("/key") <= 2 * counts["lookups"]
            assert counts["absent"] >= 4 * 4 and counts["absent"] + counts["limited"] + counts["lookups"] == 72
            newcomer = KeySet.generate()  # registers after the relay's last read of the lists
            done = honest.submit(newcomer, RegisterUser("127.0.0.1:9111", "global"))
            assert done.outcome.code == 0
            await until(lambda: rpc.latest_height() >= done.height)  # the relay's validator has it too
            await asyncio.sleep(8 / 4)  # the lookups' bucket fills again
            assert await knock(relay, newcomer)
            assert "/prefix" in calls and newcomer.public in relay.view.users
        finally:
            await relay.close()

    try:
        run(scenario(), timeout=90)
    finally:
        proxy.close()


def test_an_endpoint_cannot_have_one_message_signed_twice(net):
    """A client's RPC endpoint lies about the client's account sequence, saying a higher one, then sends
    a transaction on and says it was refused (RATE_LIMITED). Either would have had the client sign the
    same message again at another sequence, so that the endpoint, which keeps every signed transaction,
    could apply the message twice: before, the first was signed at the sequence said and refused, and
    a retry signed the refused message again. The client signs at the sequence the ledger proves, and
    sends a refused transaction again as the same bytes: each message is signed once, applied once."""
    honest = ledger(net, 0)
    user = KeySet.generate()
    assert honest.submit(user, RegisterUser("127.0.0.1:9102", "global")).outcome.ok
    account = layout.account_key(user.public)
    proxy = TamperProxy(net.rpc_url(1))
    client = through(net, proxy, None, honest.min_height)
    sent: list[bytes] = []

    def higher(method, params, answer):
        if method == "abci_query" and params.get("data") == account.hex() and not params.get("prove"):
            response = answer["result"]["response"]
            said = codec.unpack(base64.b64decode(response["value"])) + 5
            response["value"] = base64.b64encode(codec.pack(said)).decode()
        if method == "broadcast_tx_sync":
            sent.append(base64.b64decode(params["tx"]))
        return answer

    def refused_once(method, params, answer):
        if method == "broadcast_tx_sync":
            sent.append(base64.b64decode(params["tx"]))
            if len(sent) == 1 and answer["result"]["code"] == 0:  # sent on to the mempool all the same
                answer["result"].update(code=int(Code.RATE_LIMITED), log="rate limited (so it says)")
        return answer

    try:
        for lie in (higher, refused_once):
            before = honest.sequence(user.public)
            sent.clear()
            proxy.rewrite = lie
            done = client.submit(user, Heartbeat())
            proxy.rewrite = None
            assert done.outcome.ok, (lie.__name__, done.outcome.log)
            net.wait_for_height(done.height + 1, timeout=30)
            assert len(set(sent)) == 1, lie.__name__  # one signed transaction, however often it was sent
            assert txlib.decode(sent[0], len(sent[0])).sequence == before, lie.__name__
            assert honest.sequence(user.public) == before + 1, lie.__name__  # applied once
    finally:
        proxy.close()


def test_a_commit_the_endpoint_made_up_does_not_leave_the_client_signing_ahead(net):
    """A client counts its own last transaction that committed as spent before the verified state, a
    block behind, shows it. An endpoint that kept a heartbeat back and said it committed would have the
    client sign every later transaction a sequence ahead of its account, each refused, for good; once
    the verified state should show that commit and does not, the client signs at the proven sequence
    again, and its next heartbeat commits."""
    honest = ledger(net, 0)
    user = KeySet.generate()
    assert honest.submit(user, RegisterUser("127.0.0.1:9103", "global")).outcome.ok
    proxy = TamperProxy(net.rpc_url(1))
    client = through(net, proxy, None, honest.min_height)
    kept: list[bytes] = []
    claimed = max(net.wait_for_height(0).values())

    def keep_back(method, params):
        if method == "broadcast_tx_sync":
            kept.append(base64.b64decode(params["tx"]))
            return {"code": 0, "data": "", "log": "", "codespace": "", "hash": _tx_hash(kept[-1])}
        if method == "tx" and kept and base64.b64decode(params["hash"]).hex().upper() == _tx_hash(kept[-1]):
            return {"hash": _tx_hash(kept[-1]), "height": str(claimed), "index": 0,
                    "tx": base64.b64encode(kept[-1]).decode(), "tx_result": {"code": 0}}
        return None

    try:
        before = honest.sequence(user.public)
        proxy.intercept = keep_back
        made_up = client.submit(user, Heartbeat())
        proxy.intercept = None
        assert made_up.outcome.ok and made_up.height == claimed and len(kept) == 1
        net.wait_for_height(claimed + 2, timeout=30)
        assert honest.sequence(user.public) == before  # the ledger never saw it
        done = client.submit(user, Heartbeat())
        assert done.outcome.ok, done.outcome.log
        assert honest.sequence(user.public) == before + 1
    finally:
        proxy.close()


def test_a_refusal_the_endpoint_made_up_is_not_believed_where_the_witness_takes_the_transaction(net):
    """An endpoint that answers CheckTx with a refusal of its own making, never sending the transaction
    on, would have a verifier daemon give up its duty for the epoch. A client with a witness asks the
    witness too, with the same bytes: the witness takes it, and the client awaits its block there, and
    believes it once the endpoint tells the same block. The endpoint's word stands without a witness, and
    where the witness refuses as well."""
    honest = ledger(net, 0)
    user = KeySet.generate()
    assert honest.submit(user, RegisterUser("127.0.0.1:9104", "global")).outcome.ok
    proxy = TamperProxy(net.rpc_url(1))
    made_up = {"code": int(Code.UNAUTHORIZED), "data": "", "log": "unauthorized: so it says", "codespace": "ps"}

    def refuse(method, params):
        if method == "broadcast_tx_sync":
            return {**made_up, "hash": _tx_hash(base64.b64decode(params["tx"]))}
        return None

    try:
        proxy.intercept = refuse
        before = honest.sequence(user.public)
        alone = through(net, proxy, None, honest.min_height).submit(user, Heartbeat())
        assert (alone.height, alone.outcome.code, alone.outcome.log) == (0, Code.UNAUTHORIZED, made_up["log"])
        witnessed = through(net, proxy, net.rpc_url(2), honest.min_height).submit(user, Heartbeat())
        assert witnessed.outcome.ok and witnessed.height > 0, witnessed.outcome.log
        honest.min_height = witnessed.height
        assert honest.sequence(user.public) == before + 1  # applied once, through the witness
        # a transaction the witness refuses too (the user is registered already) keeps the endpoint's refusal
        again = through(net, proxy, net.rpc_url(2), honest.min_height).submit(user, RegisterUser("127.0.0.1:9104", "global"))
        assert (again.height, again.outcome.code) == (0, Code.UNAUTHORIZED)
        net.wait_for_height(witnessed.height + 2, timeout=30)
        assert honest.sequence(user.public) == before + 1
        # nor is the witness's word taken alone: where the endpoint denies the block too, the client names
        # both rather than believe either
        proxy.rewrite = lambda method, params, answer: {
            "jsonrpc": "2.0", "id": answer.get("id"), "error": {"code": -32603, "message": "Internal error",
                                                                "data": "tx not found"}} if method == "tx" else None
        with pytest.raises(OutcomeMismatch, match=rf"{net.rpc_url(2)} says heartbeat committed at height \d+; "
                                                  rf"{proxy.url} does not know it"):
            through(net, proxy, net.rpc_url(2), honest.min_height).submit(user, Heartbeat(), timeout=5)
    finally:
        proxy.close()


def test_an_outcome_the_endpoint_made_up_is_refused_where_the_witness_tells_another(net):
    """An endpoint that sends a heartbeat on and says a block refused it has a client without a witness
    believe it, until the client checks the outcome against the verified headers (`verified_outcome`):
    the block's results say otherwise, and altered to agree they no longer hash as committed; a block
    the endpoint names that does not hold the transaction is refused too. With a witness, an outcome is
    believed only once the witness tells the same: here the client refuses it, naming what each said."""
    honest = ledger(net, 0)
    user = KeySet.generate()
    assert honest.submit(user, RegisterUser("127.0.0.1:9105", "global")).outcome.ok
    proxy = TamperProxy(net.rpc_url(1))

    def refused_in_block(method, params, answer):
        if method == "tx" and "result" in answer:
            answer["result"]["tx_result"] = {**answer["result"]["tx_result"], "code": int(Code.UNAUTHORIZED),
                                             "log": "unauthorized: so it says"}
        return answer

    def results_refused(method, params, answer):
        if method == "block_results" and "result" in answer:
            for result in answer["result"]["txs_results"] or []:
                result["code"] = int(Code.UNAUTHORIZED)
        return refused_in_block(method, params, answer)

    def elsewhere(method, params, answer):
        if method == "tx" and "result" in answer:
            answer["result"]["height"] = str(int(answer["result"]["height"]) - 1)
        return answer

    try:
        proxy.rewrite = refused_in_block
        before = honest.sequence(user.public)
        lied_to = through(net, proxy, None, honest.min_height)
        alone = lied_to.submit(user, Heartbeat())
        assert alone.height > 0 and alone.outcome.code == Code.UNAUTHORIZED  # the endpoint's word, until checked:
        with pytest.raises(OutcomeMismatch, match=rf"ended with code 10; block {alone.height}'s verified results "
                                                  r"say code 0"):
            lied_to.verified_outcome(alone)
        proxy.rewrite = results_refused  # the block's results altered to agree: they no longer hash as committed
        with pytest.raises(OutcomeMismatch, match=rf"results of block {alone.height} do not hash to the verified"):
            lied_to.verified_outcome(alone)
        proxy.rewrite = None
        assert honest.verified_outcome(replace(alone, outcome=replace(alone.outcome, code=0))).height == alone.height
        honest.min_height = alone.height
        proxy.rewrite = refused_in_block
        with pytest.raises(OutcomeMismatch, match=rf"{proxy.url} says heartbeat committed at height \d+ with "
                                                  rf"code 10; {net.rpc_url(2)} says height \d+, code 0"):
            through(net, proxy, net.rpc_url(2), honest.min_height).submit(user, Heartbeat())
        net.wait_for_height(alone.height + 3, timeout=30)
        assert honest.sequence(user.public) == before + 2  # both heartbeats committed, whatever was said
        proxy.rewrite = elsewhere  # a block that does not hold the transaction
        moved = lied_to.submit(user, Heartbeat())
        with pytest.raises(OutcomeMismatch, match=rf"committed at height {moved.height}; that block does not hold"):
            lied_to.verified_outcome(moved)
    finally:
        proxy.close()


def _tx_hash(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest().upper()


def through(net, proxy: TamperProxy, witness: str | None, min_height: int) -> LedgerClient:
    """A client verifying what it reads through `proxy` against the genesis, with `witness` if given."""
    rpc = RpcClient(proxy.url)
    return LedgerClient(rpc, LightClient.from_genesis_file(
        net.spec.genesis_path, rpc, witness=RpcClient(witness) if witness else None), min_height=min_height)


def _stored_nodes(i: int, net) -> int:
    """Rows in validator i's trie node table, read beside the running app (SQLite WAL readers)."""
    db = net.spec.validators[i].home / "data" / "planetserve.db"
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return conn.execute("SELECT count(*) FROM state_nodes").fetchone()[0]


def test_a_pruning_validator_agrees_and_serves_only_its_recent_heights(net):
    """v3 restarts with keep_heights 20 in its planetserve.json: it deletes the trie nodes only
    older heights used, keeps signing the same app hashes, answers verified lists at the recent
    heights, and refuses older ones by name while an archive validator still answers them."""
    config = net.spec.validators[3].home / "config" / "planetserve.json"
    original = config.read_text()
    net.stop(3)
    config.write_text(json.dumps({**json.loads(original), "keep_heights": 20}))
    try:
        net.start(3)
        client = ledger(net, 0)
        for _ in range(3):
            done = client.submit(KeySet.generate(), RegisterUser("127.0.0.1:1", "prune"))
            assert done.outcome.code == 0, done.outcome.log
        top = max(net.wait_for_height(max(done.height + 2, 2 + 20 + 3), timeout=60).values())  # height 2 pruned
        net.wait_for_height(top, validators=[3], timeout=60)
        assert_same_app_hashes(net, top)
        pruner = ledger(net, 3)
        pruner.min_height = done.height
        listing, users = pruner.users("prune")
        assert listing.verified and len(users) == 3
        old = net.rpc(3).abci_query("/prefix", b"user/", height=2)
        assert old.code != 0 and "height 2 is pruned" in old.log and "keeps the last 20 heights" in old.log
        assert net.rpc(0).abci_query("/prefix", b"user/", height=2).code == 0
        said = json.loads(net.rpc(3).abci_info()["data"])
        assert said["keep_heights"] == 20 and said["earliest_height"] > 2
        assert json.loads(net.rpc(0).abci_info()["data"])["earliest_height"] == 1
        assert _stored_nodes(3, net) < _stored_nodes(0, net)
    finally:
        net.stop(3)
        config.write_text(original)
        net.start(3)
