"""Verification epochs on a real four-validator network, the committee scripted here: every member
proves its VRF over RPC, the leader plans, results and attestations commit, and every validator ends
with the same reputations and app hashes, also with members offline and a leader that cheats."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from chainnet import assert_same_app_hashes, ledger, member_keys, start_network
from click.testing import CliRunner
from committee import TEMPERATURE

from planetserve.chain import vrf
from planetserve.chain.abci.epochs import validator_address
from planetserve.chain.challenge import Challenge, open_plan_entry, sign_response
from planetserve.chain.client import LedgerClient
from planetserve.chain.keys import KeySet
from planetserve.chain.messages import (
    Attest,
    CommitPlan,
    CommitRechallenge,
    RegisterModelNode,
    RegisterOrg,
    SubmitResults,
    SubmitVrf,
)
from planetserve.chain.messages.epochs import Unanswered
from planetserve.cli import main
from planetserve.registry import epochs, reputation
from planetserve.registry.credits import format_credits
from planetserve.registry.params import Params

pytestmark = [pytest.mark.network, pytest.mark.faults]

PARAMS = Params(epoch_blocks=40, results_blocks=15, vrf_window_blocks=15, plan_window_blocks=15,
                probation_epochs=0)  # nodes listed from registration: the test reads the list
SCHEDULE = epochs.Schedule.from_params(PARAMS)
RULE = reputation.ReputationRule.from_params(PARAMS)
CREDIBILITY = 750_000
HONEST = 1_000_000


STRICT = replace(PARAMS, member_fault_limit=1)
"""One fault takes a member's power."""


def network(tmp_path, params: Params):
    return start_network(tmp_path / "net", params=params, timeout_commit="150ms", timeout_propose="1s")


@pytest.fixture
def net(tmp_path):
    cluster = network(tmp_path, PARAMS)
    yield cluster
    cluster.close()


@pytest.fixture
def strict_net(tmp_path):
    cluster = network(tmp_path, STRICT)
    yield cluster
    cluster.close()


class Committee:
    """The four members' keys and ledger clients, and one organisation's two model nodes."""

    def __init__(self, net) -> None:
        self.net = net
        self.clients = [ledger(net, i) for i in range(4)]
        self.members = [member_keys(net, i) for i in range(4)]
        self.owner, self.nodes = KeySet.generate(), [KeySet.generate() for _ in range(2)]
        client = self.clients[0]
        assert client.submit(self.owner, RegisterOrg("org-e", "Org E")).outcome.code == 0
        for i, node in enumerate(self.nodes):
            done = client.submit(self.owner, RegisterModelNode.signed(
                client.chain_id(), "org-e", node, model_id="gt", address=f"127.0.0.1:{7100 + i}", hardware="cpu", capacity=2,
                region="local"))
            assert done.outcome.code == 0, done.outcome.log

    def index(self, operator: bytes) -> int:
        return next(i for i, m in enumerate(self.members) if m.public == operator)

    def own(self, member: KeySet) -> LedgerClient:
        """A member submits through its own validator, whose state has its latest sequence."""
        return self.clients[self.index(member.public)]

    def client(self, online: list[int]) -> LedgerClient:
        return self.clients[online[0]]

    def submit_all(self, online: list[int], msg_of) -> None:
        with ThreadPoolExecutor(len(online)) as pool:
            outcomes = list(pool.map(lambda i: self.clients[i].submit(self.members[i], msg_of(i)), online))
        assert [o.outcome.code for o in outcomes] == [0] * len(online), [o.outcome.log for o in outcomes]
        self.settle(online, max(o.height for o in outcomes))

    def settle(self, online: list[int], height: int) -> None:
        """Wait until every online validator has committed `height`: each checks the next transaction
        against its own state, and one a block behind would not yet know what was just committed."""
        self.net.wait_for_height(height, validators=online, timeout=60)

    def elect_and_plan(self, number: int, online: list[int]) -> None:
        """In epoch number-1's windows: VRF proofs of the online members, the plan of its leader."""
        self.net.wait_for_height(SCHEDULE.setup_height(number - 1), validators=online, timeout=120)
        client = self.client(online)
        client.min_height = SCHEDULE.setup_height(number - 1)
        seed = client.epoch(number).seed
        planner = self.members[self.index(client.epoch(number - 1).leader)]
        _, committee = client.committee()
        plan = CommitPlan(number, tuple(
            Challenge.new(f"Epoch {number} asks node {i}: what makes bread rise?", TEMPERATURE).plan_entry(
                n.public, committee)
            for i, n in enumerate(self.nodes)), final=True)
        self.submit_all(online, lambda i: SubmitVrf(number, vrf.prove(bytes(self.members[i].vrf), seed)))
        done = self.own(planner).submit(planner, plan)
        assert done.outcome.code == 0, done.outcome.log
        self.net.wait_for_height(SCHEDULE.start(number), validators=online, timeout=120)

    def leader_of(self, number: int, online: list[int]) -> KeySet:
        client = self.client(online)
        client.min_height = SCHEDULE.start(number)
        return self.members[self.index(client.epoch(number).leader)]

    def leader_results(self, number: int, online: list[int], alter: bytes = b"", tamper: bytes = b"",
                       skip: bytes = b"", claim_invalid: bytes = b"",
                       credibility: dict[bytes, int] | None = None) -> KeySet:
        """The elected leader answers its sealed prompts through the nodes and submits the results;
        it may alter the prompt to one node, tamper with one response, skip one node or claim one
        gave no valid response. Returns the leader's keys."""
        leader = self.leader_of(number, online)
        _, planned = self.client(online).plan(number)
        results = []
        for entry in planned:
            if entry.node == skip:
                continue
            if entry.node == claim_invalid:
                results.append(Unanswered(entry.node, "no response within 60 s"))
                continue
            challenge = open_plan_entry(entry, leader.public, leader.x25519)
            asked = challenge.prompt + (" Answer in one word." if entry.node == alter else "")
            result = replace(challenge.reveal(self.answer(entry.node, asked, challenge)),
                             credibility=(credibility or {}).get(entry.node, CREDIBILITY))
            if entry.node == tamper:
                result = replace(result, response=replace(result.response, text="I am a very bad model."))
            results.append(result)
        done = self.own(leader).submit(leader, SubmitResults(number, "leader", tuple(results)))
        assert done.outcome.code == 0, done.outcome.log
        self.settle(online, done.height)
        return leader

    def answer(self, node_key: bytes, prompt: str, challenge: Challenge):
        node = next(n for n in self.nodes if n.public == node_key)
        return sign_response(node, prompt, [5, 6, 7], "Yeast makes gas.", "gt", int(time.time()),
                             "127.0.0.1:7100", challenge.temperature, challenge.seed)

    def rechallenge(self, number: int, members: list[int], node: bytes) -> None:
        """Each member commits its own prompt for the node, has it answered, and reveals it."""
        own = {i: Challenge.new(f"Member {i} asks in epoch {number}: how do tides work?", TEMPERATURE)
               for i in members}
        self.submit_all(members, lambda i: CommitRechallenge(number, (own[i].tag(node),)))
        self.submit_all(members, lambda i: SubmitResults(
            number, "rechallenge", (own[i].reveal(self.answer(node, own[i].prompt, own[i])),)))

    def attest(self, number: int, online: list[int], submitter: KeySet, nodes: list[KeySet],
               credibility: dict[bytes, int] | None = None) -> None:
        self.attest_all(number, online, [(n.public, submitter.public, (credibility or {}).get(n.public, CREDIBILITY))
                                         for n in nodes])

    def attest_all(self, number: int, online: list[int], scores: list[tuple[bytes, bytes, int]]) -> None:
        """The `online` members attest each (node, submitter, credibility), in one transaction each."""
        self.submit_all(online, lambda i: Attest(number, tuple(sorted(scores))))


def test_an_honest_epoch_end_to_end(net):
    c = Committee(net)
    everyone = [0, 1, 2, 3]
    c.elect_and_plan(1, everyone)
    seed = c.clients[0].epoch(1).seed
    outputs = {m.public: vrf.proof_to_hash(vrf.prove(bytes(m.vrf), seed)) for m in c.members}
    epoch1 = c.clients[0].epoch(1)
    assert epoch1.election == "vrf" and epoch1.leader == min(outputs, key=lambda k: (outputs[k], k))
    leader = c.leader_results(1, everyone)
    c.attest(1, everyone, leader, c.nodes)

    end = SCHEDULE.end(1)
    net.wait_for_height(end + 1, timeout=120)
    value, _ = reputation.update(RULE, RULE.initial, CREDIBILITY, ())
    for client in c.clients:  # every validator serves the same verified reputations
        client.min_height = end
        assert client.epoch(1).finalized and client.epoch(1).scored == 2
        assert [client.reputation(n.public).value for n in c.nodes] == [value, value]
    assert_same_app_hashes(net, end)

    runner = CliRunner()
    genesis = ["--genesis", str(net.spec.genesis_path)]
    shown = runner.invoke(main, ["query", "reputation", c.nodes[0].public.hex(), "--node", net.rpc_url(1),
                                 *genesis, "--json"])
    assert shown.exit_code == 0, shown.output
    assert f'"value": {value}' in shown.output
    shown = runner.invoke(main, ["query", "epoch", "1", "--node", net.rpc_url(2), *genesis])
    assert shown.exit_code == 0 and "vrf" in shown.output and epoch1.leader.hex() in shown.output
    assert f"{SCHEDULE.start(1)}-{SCHEDULE.end(1)}" in shown.output  # the epoch's heights
    shown = runner.invoke(main, ["query", "credits", "org-e", "--node", net.rpc_url(3), *genesis, "--json"])
    assert shown.exit_code == 0, shown.output
    account = c.clients[3].credits("org-e")
    assert account.earned > 0 and account.spent == 0
    assert f'"earned": "{format_credits(account.earned)}"' in shown.output


def test_members_offline_and_a_cheating_leader(net):
    """One validator down: the epoch finalizes with three attestations. Next epoch the leader alters
    a prompt (recorded as its fault, no honest node harmed); a second validator stops, the chain
    halts and nothing finalizes; both return, the epoch finalizes and all app hashes agree."""
    c = Committee(net)
    planner = c.index(c.clients[0].epoch(0).leader)
    down = next(i for i in range(4) if i != planner)
    net.stop(down)
    online = [i for i in range(4) if i != down]
    c.elect_and_plan(1, online)
    leader = c.leader_results(1, online)
    c.attest(1, online, leader, c.nodes)
    c.elect_and_plan(2, online)
    value, _ = reputation.update(RULE, RULE.initial, CREDIBILITY, ())
    client = c.client(online)
    client.min_height = SCHEDULE.end(1)
    assert client.epoch(1).finalized and [client.reputation(n.public).value for n in c.nodes] == [value] * 2

    cheat = c.leader_results(2, online, alter=c.nodes[0].public)
    second = next(i for i in online if c.members[i].public != cheat.public)
    net.stop(second)
    still = [i for i in online if i != second]
    halted = max(net.wait_for_height(0, validators=still).values())
    time.sleep(3)
    assert max(net.wait_for_height(0, validators=still).values()) <= halted + 1  # no quorum: no blocks
    net.start([down, second])
    net.wait_for_height(halted + 1, timeout=120)  # the returning validators catch up first
    c.attest(2, [0, 1, 2, 3], cheat, c.nodes[1:])
    end = SCHEDULE.end(2)
    net.wait_for_height(end + 1, timeout=180)
    for client in c.clients:
        client.min_height = end
        assert client.epoch(2).finalized
        assert client.reputation(c.nodes[0].public).value == value  # unchanged by the altered prompt
        _, faults = client.faults(cheat.public)
        # and, since this script plans no epoch 3, the leader of epoch 2 also failed to plan it
        assert [f.kind for f in faults] == ["altered-prompt", "no-plan"]
    assert_same_app_hashes(net, end)


def test_each_leader_attack_is_detected_and_a_dishonest_node_is_delisted(net):
    """Epoch by epoch: a tampered response, a skipped node, a false "invalid response" (recorded as an
    unconfirmed report, which does not count toward removal), withheld results. Node 1 answers badly
    throughout; node 0 is honest and never loses reputation."""
    c = Committee(net)
    everyone = [0, 1, 2, 3]
    honest, dishonest = c.nodes
    bad = {dishonest.public: 100_000}
    c.elect_and_plan(1, everyone)

    leader = c.leader_results(1, everyone, tamper=honest.public, credibility=bad)
    c.attest(1, everyone, leader, [dishonest], bad)
    c.elect_and_plan(2, everyone)
    expect = {1: (leader.public, ["altered-response"])}

    leader = c.leader_results(2, everyone, skip=honest.public, credibility=bad)
    others = [c.members[i] for i in everyone if c.members[i].public != leader.public]
    c.rechallenge(2, [c.members.index(m) for m in others], honest.public)
    first = min(others, key=lambda m: m.public)
    c.attest_all(2, everyone, [(honest.public, m.public, CREDIBILITY if m == first else HONEST) for m in others]
                 + [(dishonest.public, leader.public, bad[dishonest.public])])
    c.elect_and_plan(3, everyone)
    expect[2] = (leader.public, ["skipped-node"])

    leader = c.leader_results(3, everyone, claim_invalid=honest.public, credibility=bad)
    others = [c.members[i] for i in everyone if c.members[i].public != leader.public]
    c.rechallenge(3, [c.members.index(m) for m in others], honest.public)
    c.attest_all(3, everyone, [(honest.public, m.public, HONEST) for m in others]
                 + [(dishonest.public, leader.public, bad[dishonest.public])])
    c.elect_and_plan(4, everyone)
    expect[3] = (leader.public, ["unconfirmed-report"])

    expect[4] = (c.leader_of(4, everyone).public, ["withheld-results"])
    end = SCHEDULE.end(4)
    net.wait_for_height(end + 1, timeout=180)
    client = c.clients[2]
    client.min_height = end
    _, faults = client.faults()
    recorded: dict[int, list[str]] = {}
    for f in faults:
        if f.kind != "no-plan":
            recorded.setdefault(f.epoch, []).append(f.kind)
            assert f.operator == expect[f.epoch][0], f
    assert recorded == {e: kinds for e, (_, kinds) in expect.items()}

    honest_rep = client.reputation(honest.public)
    assert honest_rep.trusted and honest_rep.window == (CREDIBILITY, HONEST)  # scored by re-challenges only
    dishonest_rep = client.reputation(dishonest.public)
    assert not dishonest_rep.trusted and dishonest_rep.window == (100_000,) * 3
    listing, listed = client.nodes("gt")
    assert listing.verified and [n.pubkey for n in listed] == [honest.public]
    assert_same_app_hashes(net, end)


def test_a_validator_that_stays_away_loses_its_power_and_the_network_goes_on_without_it(strict_net):
    """With `member_fault_limit` 1, a validator down for a whole epoch is recorded `missed-blocks` at the
    epoch's end and the chain takes its power: CometBFT applies the power-0 update, so the validator set
    is the other three from two blocks later, and they go on committing blocks. They planned, led and
    attested, so they have no fault and keep their power."""
    net = strict_net
    c = Committee(net)
    planner = c.index(c.clients[0].epoch(0).leader)
    down = next(i for i in range(4) if i != planner)
    online = [i for i in range(4) if i != down]
    _, committee = c.clients[0].committee()
    address = {m.operator: validator_address(m.consensus_key).hex().upper() for m in committee}
    net.stop(down)
    c.elect_and_plan(1, online)
    leader = c.leader_results(1, online)
    c.attest(1, online, leader, c.nodes)
    c.elect_and_plan(2, online)
    end = SCHEDULE.end(1)
    net.wait_for_height(end + 3, validators=online, timeout=120)

    client = c.client(online)
    client.min_height = end
    _, faults = client.faults()
    assert {(f.operator, f.kind) for f in faults} == {(c.members[down].public, "missed-blocks")}, faults
    _, committee = client.committee()
    assert sorted(m.operator for m in committee) == sorted(c.members[i].public for i in online)
    for i in online:
        _, validators = net.rpc(i).validators()
        assert sorted(v["address"] for v in validators) == sorted(address[c.members[j].public] for j in online)
    height = net.rpc(online[0]).latest_height()
    net.wait_for_height(height + 3, validators=online, timeout=60)
    assert_same_app_hashes(net, height + 2, online)
