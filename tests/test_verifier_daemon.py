"""The verifier daemon's parts that need no network: its home, its journal, plan parts, the CLI, and
how it reads a user relay's answers (a real HTTP server answering as a relay would)."""

from __future__ import annotations

import functools
import json
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

import pytest
from click.testing import CliRunner
from committee import EPOCH_PARAMS, HONEST, TEMPERATURE, Script, unopenable_plan, unsound_plan
from harness import CHAIN_ID, AppHarness, events, sqlite_url
from inprocess import InProcessLedger, Rounds, answered

from planetserve import workloads
from planetserve.chain.challenge import (
    ANSWERED_BY,
    Challenge,
    response_extension,
    response_valid,
    served_extension,
    sign_response,
)
from planetserve.chain.keys import KeySet
from planetserve.chain.lightclient import DEFAULT_MAX_AGE
from planetserve.chain.messages.epochs import MAX_ENTRIES, PlanItem
from planetserve.chain.messages.registry import RotateNodeKey
from planetserve.cli import main
from planetserve.config import HomeError
from planetserve.genesis.network import free_ports
from planetserve.models import load
from planetserve.registry import codec
from planetserve.registry.entities import ModelNode
from planetserve.registry.epochs import ATTEST_BLOCKS, INVALID, UNOPENED, VALID, Schedule, SignedResponse
from planetserve.registry.params import Params
from planetserve.verifier import ReferenceModel
from planetserve.verifier import daemon as daemon_module
from planetserve.verifier.config import CONFIG_FILE, STATUS_FILE, SUBMISSIONS_FILE, JsonLines, VerifierConfig
from planetserve.verifier.credibility import Answer, Rejection, Verdict
from planetserve.verifier.daemon import (
    LATE,
    TX_MARGIN_BYTES,
    Asked,
    Daemon,
    Journal,
    Scheduled,
    _parts,
    first_rechallenge,
    last_rechallenge,
    rechallenge_cutoff,
)
from planetserve.verifier.overlay import MAX_ANSWER_BYTES, NoAnswer, OverlayChannel, RelayUnavailable, Reply


def test_config_loads_strictly(tmp_path):
    with pytest.raises(HomeError, match="planetserve verifier init --home"):
        VerifierConfig.load(tmp_path)
    VerifierConfig(keys="k.json").save(tmp_path)
    assert VerifierConfig.load(tmp_path).models == {"gt": "gt"}
    assert VerifierConfig.load(tmp_path).max_age == DEFAULT_MAX_AGE  # the light client's own default
    VerifierConfig(keys="k.json", witness="http://10.0.0.8:26657", max_age=60).save(tmp_path)
    loaded = VerifierConfig.load(tmp_path)
    assert (loaded.witness, loaded.max_age) == ("http://10.0.0.8:26657", 60)
    for bad, message in [({"keys": "k", "colour": "red"}, "unknown settings colour"),
                         ({"keys": "k", "credibility": "vibes"}, "credibility must be one of calibrated, ppl"),
                         ({"keys": "k", "workload": "chess"}, "workload must be one of"),
                         ({"keys": "k", "models": {}}, "models must map"),
                         ({"keys": "k", "max_tokens": 0}, "max_tokens must be a positive integer"),
                         ({"keys": "k", "tolerance": -1}, "tolerance must lie in"),
                         ({"keys": "k", "greedy_share": 2}, "greedy_share must be null or lie in"),
                         ({"keys": "k", "chat_share": "half"}, "chat_share must be null or lie in"),
                         ({"keys": "k", "stop_share": -1}, "stop_share must be null or lie in"),
                         ({"keys": "k", "logprobs_share": 1.5}, "logprobs_share must lie in"),
                         ({"keys": "k", "logprobs_share": None}, "logprobs_share must lie in"),
                         ({"keys": "k", "rechallenge_share": None}, "rechallenge_share must lie in"),
                         ({"keys": "k", "silent_escape": 2}, "silent_escape must lie in"),
                         ({"keys": "k", "max_tokens": 513}, "max_tokens must be at most 512"),
                         ({"keys": "k", "witness": "10.0.0.8:26657"}, "witness must be an http:// URL"),
                         ({"keys": "k", "witness": "http://127.0.0.1:26657/"},
                          "witness must be another endpoint than rpc"),
                         ({"keys": "k", "max_age": 0}, "max_age must be a positive number of seconds"),
                         ({"keys": "k", "max_age": "5m"}, "max_age must be a positive number of seconds"),
                         ({"keys": "k", "max_age": True}, "max_age must be a positive number of seconds"),
                         ({"keys": ""}, "`keys` must name")]:
        (tmp_path / CONFIG_FILE).write_text(json.dumps(bad))
        with pytest.raises(HomeError, match=message):
            VerifierConfig.load(tmp_path)


def test_the_journal_survives_a_restart(tmp_path):
    journal = Journal(tmp_path / "j.jsonl")
    node = bytes(range(32))
    challenge = Challenge.new("How do tides work? And why?", 700, max_tokens=9, earlier=(18,))
    journal.add(3, node, challenge)
    with (tmp_path / "j.jsonl").open("a") as fh:
        fh.write('{"epoch": 4, "node": "')  # a line cut short by a crash
    again = Journal(tmp_path / "j.jsonl")
    assert again.get(3, node) == challenge and again.get(4, node) is None
    assert again.get(3, node).commitment == challenge.commitment
    again.add(5, node, challenge)  # written whole after the cut line
    assert Journal(tmp_path / "j.jsonl").get(5, node) == challenge
    assert (tmp_path / "j.jsonl").stat().st_mode & 0o777 == 0o600  # challenges are secret until revealed
    # a line an earlier version wrote (no cap, no earlier turns) asks the default cap
    with (tmp_path / "j.jsonl").open("a") as fh:
        fh.write(json.dumps({"epoch": 6, "node": node.hex(), "prompt": "Why?", "salt": "00" * 32,
                             "temperature": 0, "question": ""}) + "\n")
    assert Journal(tmp_path / "j.jsonl").get(6, node) == Challenge("Why?", bytes(32), 0)


def test_a_journal_line_cut_by_a_crash_is_skipped_and_ended(tmp_path):
    path = tmp_path / SUBMISSIONS_FILE
    JsonLines(path).append({"epoch": 1, "code": 0})
    assert path.stat().st_mode & 0o777 == 0o600
    with path.open("a") as fh:
        fh.write('{"epoch": 2, "co')  # cut short by a crash
    again = JsonLines(path)
    assert again.read() == [{"epoch": 1, "code": 0}]
    again.append({"epoch": 3, "code": 6}, durable=True)
    assert JsonLines(path).read() == [{"epoch": 1, "code": 0}, {"epoch": 3, "code": 6}]
    assert path.read_text().count("\n") == 3  # the cut line was ended, not glued to the next
    (tmp_path / "empty").touch()
    assert JsonLines(tmp_path / "empty").read() == [] and (tmp_path / "empty").read_bytes() == b""


def test_plan_parts_stay_under_the_limit_and_end_in_a_final_part():
    entries = [PlanItem(bytes([i]) * 32, bytes(32), ((bytes(32), bytes(80)),), bytes(900)) for i in range(10)]
    size = len(codec.pack(entries[0].body()))
    parts = _parts(entries, 3 * size)
    assert [len(p) for p in parts] == [3, 3, 3, 1]
    assert [e for p in parts for e in p] == entries
    assert all(len(codec.pack([e.body() for e in p])) <= 3 * size + 4 for p in parts)
    assert _parts([], 1000) == [[]]  # nothing left to cover: one empty, final part
    scores = [(bytes(32), bytes(32), 0, 0)] * (2 * MAX_ENTRIES + 1)
    many = _parts(scores, 1 << 30, lambda score: len(codec.pack(list(score))))  # a chain voted to huge txs
    assert [len(p) for p in many] == [MAX_ENTRIES, MAX_ENTRIES, 1]  # still no more than a list holds


def test_attestations_of_more_results_than_one_transaction_holds_go_in_parts(tmp_path):
    """Fifty-six planned nodes, each answered to the leader and re-challenged by the three other members
    (as four members do by default): 224 valid results, whose scores take more than one transaction of
    the default 16 KiB, which the chain refuses whole. A member's daemon attests them all, in parts."""
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS), nodes=56)
    s.run_election_and_plan(1)
    leader, nodes = s.leader(1), list(s.nodes)
    chunks = [nodes[i:i + 20] for i in range(0, len(nodes), 20)]
    assert s.block(*(s.tx(leader, "submit-results", s.leader_results(1, HONEST, chunk))
                     for chunk in chunks)) == [(0, "ok")] * len(chunks)
    members = [m for k, m in s.members.items() if k != leader.public]
    own = {(m.public, n): Challenge.new(f"Member {i} asks node {j}: why do tides turn?", TEMPERATURE)
           for i, m in enumerate(members) for j, n in enumerate(nodes)}
    assert s.block(*(s.tx(m, "commit-rechallenge", {"epoch": 1, "tags": [own[m.public, n].tag(n) for n in nodes]})
                     for m in members)) == [(0, "ok")] * len(members)
    reveals = [s.tx(m, "submit-results", {"epoch": 1, "kind": "rechallenge", "results": [
        own[m.public, n].reveal(s.answer(n, own[m.public, n])) for n in chunk]}) for m in members for chunk in chunks]
    assert s.block(*reveals) == [(0, "ok")] * len(reveals)
    valid = [r for r in s.results(1) if r.status == VALID]
    assert len(valid) == 224
    attesting = next(iter(s.members.values()))
    whole = s.h.tx(attesting, "attest", {"epoch": 1, "scores": [[r.node, r.submitter, HONEST, 0] for r in valid]},
                 sequence=s.h.sequences.get(attesting.public, 0))
    assert s.h.check(whole).code != 0  # one transaction cannot carry them
    daemon = Daemon(attesting, InProcessLedger(s.h, Rounds(s.h)), {}, None, None, tmp_path)  # type: ignore[arg-type]
    daemon.scores.update({(1, r.node, r.submitter): (HONEST, 0) for r in valid})
    daemon._attest(1, Params().max_tx_bytes - TX_MARGIN_BYTES)
    submitted = daemon.submissions.read()
    assert len(submitted) == 2 and all(entry["code"] == 0 and entry["type"] == "attest" for entry in submitted)
    assert all(any(m == attesting.public for m, *_ in s.state.attestations(1, r.node, r.submitter))
               for r in valid)


# -- reading a relay's answers ------------------------------------------------------------------


def test_sampled_rechallenges_come_before_the_epoch_inside_its_results_window_and_after_it(tmp_path):
    """A member's sampled re-challenges start at offsets its secret spreads from the first block one can be
    sent, in the closing windows of the epoch before once this epoch's plan and tags can be committed (-12,
    two blocks after that epoch's setup height), to the last, four before the block before the epoch's
    last eight, whose results need not be attested (27): about a third of them before the epoch starts, a
    third inside the results window (16), where the leader's challenges come, the rest after it; the same
    member draws the same after a restart, another member its own. Neither on the localnet nor with the
    default parameters is a block left between an epoch's last re-challenge and the next epoch's first:
    with the defaults they reach from offset 88 of the epoch before to offset 87 (with a ten-block plan
    window, from 92, leaving four blocks free; before that they stopped at 85 and started at 5)."""
    schedule = Schedule(epoch_blocks=40, results_blocks=16, vrf_window_blocks=10, plan_window_blocks=14)
    keys = KeySet.generate()
    channel = OverlayChannel("http://127.0.0.1:9")
    member, restarted = (Daemon(keys, None, {}, channel, None, tmp_path / name) for name in ("a", "b"))
    other = Daemon(KeySet.generate(), None, {}, channel, None, tmp_path / "c")
    nodes = [secrets.token_bytes(32) for _ in range(4_000)]  # each of 100 offsets missed by (0.99)^4000
    offsets = [member._sample_offset(3, node, schedule) for node in nodes]
    assert (min(offsets), max(offsets)) == (-12, 27)
    assert schedule.start(3) - 12 == schedule.setup_height(2) + daemon_module.AHEAD_BLOCKS
    assert 0.2 < sum(o < 0 for o in offsets) / len(offsets) < 0.4  # 12 of 40 offsets
    assert 0.3 < sum(0 <= o < schedule.results_blocks for o in offsets) / len(offsets) < 0.5  # 16 of 40
    # the last is sent GIVE_UP_BLOCKS before re-challenges still out are claimed (block 31, the one before
    # the epoch's last eight), and the daemon sends none later
    cutoff = schedule.offset(rechallenge_cutoff(schedule, 3))
    assert cutoff == 31 and max(offsets) + daemon_module.GIVE_UP_BLOCKS == cutoff
    assert last_rechallenge(schedule, 3) >= first_rechallenge(schedule, 4) - 1
    defaults = Schedule.from_params(Params())
    spread = [member._sample_offset(3, node, defaults) for node in nodes]
    assert (min(spread), max(spread)) == (-12, 87)
    assert first_rechallenge(defaults, 4) == last_rechallenge(defaults, 3) + 1
    assert max(defaults.vrf_window_blocks, defaults.plan_window_blocks) == (
        daemon_module.AHEAD_BLOCKS + daemon_module.GIVE_UP_BLOCKS + ATTEST_BLOCKS)
    assert offsets == [restarted._sample_offset(3, node, schedule) for node in nodes]
    assert offsets != [other._sample_offset(3, node, schedule) for node in nodes]
    assert offsets != [member._sample_offset(4, node, schedule) for node in nodes]


def test_the_next_epochs_re_challenges_are_held_until_it_starts_and_dropped_by_its_leader(tmp_path):
    """Answers of the next epoch's re-challenges, sent in this epoch's closing windows, wait in `pending`
    for that epoch; an earlier epoch's are dropped. Elected to lead that epoch, the member drops them:
    a leader re-challenges nothing, and its one result per node is its own challenge's."""
    daemon = Daemon(KeySet.generate(), None, {}, OverlayChannel("http://127.0.0.1:9"), None, tmp_path)
    node = KeySet.generate().public
    waiting = {(number, node, kind): Future() for number in (2, 3, 4) for kind in ("leader", "rechallenge")}
    daemon.pending.update(waiting)
    assert daemon.results(3) == {"leader": [], "rechallenge": []}
    assert set(daemon.pending) == {k for k in waiting if k[0] in (3, 4)}
    assert all(waiting[k].cancelled() for k in waiting if k[0] == 2)
    daemon._drop_rechallenges(4)
    assert set(daemon.pending) == {(3, node, "leader"), (3, node, "rechallenge"), (4, node, "leader")}
    assert waiting[4, node, "rechallenge"].cancelled()


SKY = "Why is the sky blue?"
UNSOUND = {
    "salt of 31 bytes": Challenge(SKY, secrets.token_bytes(31), 0),
    "blank prompt": Challenge("  \n ", secrets.token_bytes(32), 0),
    "prompt with a control character": Challenge("Why\x07?", secrets.token_bytes(32), 0),
    "more tokens asked than a challenge asks": Challenge(SKY, secrets.token_bytes(32), 0, max_tokens=65_536),
    "question rendered otherwise": Challenge(SKY, secrets.token_bytes(32), 0, question="Why is grass green?"),
    "stop token id outside the vocabulary": Challenge(SKY, secrets.token_bytes(32), 0, stop_token_ids=(5_000,)),
    "prompt too long for a node": Challenge("word " * 800, secrets.token_bytes(32), 0),
}
PLANNERS: dict[str, Callable[[Script, bytes], None]] = {
    "keys sealed as garbage": unopenable_plan,
    **{name: functools.partial(unsound_plan, challenge=challenge) for name, challenge in UNSOUND.items()},
}


@pytest.mark.parametrize("plan", PLANNERS.values(), ids=PLANNERS.keys())
def test_a_leader_whose_planned_challenge_does_not_open_says_so(tmp_path, quick_family, plan):
    """The leader's real daemon, facing a plan entry that does not open (its key sealed as garbage: it
    left the node out before, a `skipped-node` fault for what the planner sealed), whose reveal the
    ledger would refuse (its whole batch of results was refused: a `skipped-node` fault per node, five of
    which reach the member fault limit), or that an honest node refuses (a cap of 65,536 tokens, a stop
    id outside the vocabulary, a prompt past what a node accepts) or answers for another prompt (it
    reported the node, and the planner's own claim took the report past a third of the power), claims
    `UNOPENED` for that node in its results window and asks the other node as planned."""
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))
    node0, node1 = list(s.nodes)
    plan(s, node0)
    reference = ReferenceModel.from_loaded(load("gt", quick_family), model_id="gt")
    leader = Daemon(s.leader(1), InProcessLedger(s.h, Rounds(s.h)), {"gt": reference},
                    OverlayChannel("http://127.0.0.1:9"), None, tmp_path)  # type: ignore[arg-type]
    leader._lead(1)
    assert leader.unopened == {(1, node0)} and (1, node1, "leader") in leader.pending
    leader._collect(1, Params().max_tx_bytes - TX_MARGIN_BYTES)
    claim = s.state.result(1, node0, s.epoch(1).leader)
    assert claim is not None and claim.status == INVALID and claim.reason == UNOPENED
    assert s.state.reports(1, node0) == [] and leader.unopened == set()


def test_a_challenge_that_failed_here_leaves_the_other_answers_to_be_revealed(tmp_path):
    """A failure of this member's own (an exception no answer should raise) is logged and the challenge
    tried again; the answers collected beside it are still submitted, where they were lost with the tick."""
    daemon = Daemon(KeySet.generate(), None, {}, OverlayChannel("http://127.0.0.1:9"), None, tmp_path)
    daemon.ledger = type("Unregistered", (), {"node": lambda self, key: None})()
    node = KeySet.generate()
    challenge = Challenge.new("Why?", 0)
    response = sign_response(node, "Why?", [5, 6], "Light.", "gt", int(time.time()), "h:1", 0, challenge.seed)
    broken, answered = Future(), Future()
    broken.set_exception(RecursionError("maximum recursion depth exceeded"))
    answered.set_result(Asked(challenge, node.public, Reply(response)))
    daemon.pending.update({(1, bytes(32), "leader"): broken, (1, node.public, "leader"): answered})
    entries = daemon.results(1)
    assert [e.node for e in entries["leader"]] == [node.public] and entries["leader"][0].response == response
    assert daemon.pending == {}


def test_a_re_challenge_sent_late_is_not_claimed_unanswered_at_the_cutoff(tmp_path):
    """A tick that spent blocks on its transactions can pass over a sampled offset: the re-challenge then
    goes out after `last_rechallenge`, up to the cutoff, and where its answer has not come by the cutoff
    nothing is claimed, since the node had less than `GIVE_UP_BLOCKS` to answer. One sent in time that has
    not come back is claimed unanswered, naming its commitment."""
    daemon = Daemon(KeySet.generate(), None, {}, OverlayChannel("http://127.0.0.1:9"), None, tmp_path)
    late, on_time = KeySet.generate().public, KeySet.generate().public
    challenges = {node: Challenge.new("Why is the sky blue?", 500, max_tokens=12) for node in (late, on_time)}
    for node, challenge in challenges.items():
        daemon.journal.add(3, node, challenge)
        daemon.pending[3, node, "rechallenge"] = Future()
    daemon.late.add((3, late))
    claimed = daemon.results(3, {"rechallenge"})["rechallenge"]
    assert [(e.node, e.invalid, e.commitment) for e in claimed] == [(on_time, LATE, challenges[on_time].commitment)]
    assert daemon.pending == {}
    daemon._forget_before(4)
    assert daemon.late == set()


def test_a_scheduled_re_challenge_goes_out_at_the_first_block_seen_from_its_offset_until_the_cutoff(tmp_path):
    """Sampled re-challenges wait in `scheduled` for their blocks and go out at the first block the daemon
    sees from then on (a tick's start, or after any of its transactions): one whose block a long tick
    passed over goes out late, flagged so that it is not claimed; one that finds the cutoff come is
    dropped unsent."""
    daemon = Daemon(KeySet.generate(), None, {}, OverlayChannel("http://127.0.0.1:9"), None, tmp_path)
    registered = ModelNode(KeySet.generate().public, "org1", "gt", "10.0.0.7:7000", "cpu", 1, "eu", "active", 0)
    challenge = Challenge.new("Why is the sky blue?", 500, max_tokens=12)
    nodes = [KeySet.generate().public for _ in range(3)]
    for node, height in zip(nodes, (10, 12, 15), strict=True):
        daemon.scheduled[3, node] = Scheduled(height, last=12, cutoff=16, challenge=challenge, node=registered)
    daemon.send_scheduled(9)
    assert daemon.pending == {} and len(daemon.scheduled) == 3
    daemon.send_scheduled(11)
    assert set(daemon.pending) == {(3, nodes[0], "rechallenge")} and daemon.late == set()
    daemon.send_scheduled(14)  # after a transaction that took blocks, past `last`: sent late
    assert (3, nodes[1], "rechallenge") in daemon.pending and daemon.late == {(3, nodes[1])}
    daemon.send_scheduled(16)  # the cutoff: the third is dropped unsent
    assert daemon.scheduled == {} and (3, nodes[2], "rechallenge") not in daemon.pending
    daemon.pool.shutdown(wait=False, cancel_futures=True)


def test_a_re_challenge_waits_for_its_epochs_keys_once_the_epoch_has_started(tmp_path):
    """Key rotations take effect at an epoch's first block: a scheduled re-challenge of the epoch is not
    sent after that block (a transaction of a tick that began before it landed after it) until the daemon
    has read the plan as the block left it (`_follow_rotations`), so it never goes to a key the node
    left. Before the epoch's first block it goes out as scheduled."""
    daemon = Daemon(KeySet.generate(), None, {}, OverlayChannel("http://127.0.0.1:9"), None, tmp_path)
    registered = ModelNode(KeySet.generate().public, "org1", "gt", "10.0.0.7:7000", "cpu", 1, "eu", "active", 0)
    challenge = Challenge.new("Why is the sky blue?", 500, max_tokens=12)
    before, after = KeySet.generate().public, KeySet.generate().public
    daemon.starts[3] = 20
    daemon.scheduled[3, before] = Scheduled(19, last=25, cutoff=28, challenge=challenge, node=registered)
    daemon.send_scheduled(20)  # block 20 is the next: the epoch has not started
    assert set(daemon.pending) == {(3, before, "rechallenge")}
    daemon.scheduled[3, after] = Scheduled(21, last=25, cutoff=28, challenge=challenge, node=registered)
    daemon.send_scheduled(22)
    assert (3, after) in daemon.scheduled and (3, after, "rechallenge") not in daemon.pending
    daemon.followed.add(3)
    daemon.send_scheduled(22)
    assert (3, after, "rechallenge") in daemon.pending and daemon.scheduled == {}
    daemon.pool.shutdown(wait=False, cancel_futures=True)


class _Reference:
    """A reference model that scores 1 every answer signed by the key it is told (`ReferenceModel.check`'s
    first check: whose answer it is) and refuses any other as `wrong_node`."""

    def verify(self, answers: list[Answer]) -> list[Verdict]:
        return [Verdict.reject(Rejection.WRONG_NODE, "another key") if a.response.node != a.node
                else Verdict(1.0, 1.0, len(a.response.token_ids)) for a in answers]

    def ending(self, challenge: Challenge, response: object) -> str:
        return ""


class _Nodes:
    """The overlay as the daemon sees it: a challenge sent to a key is answered by whoever holds that key
    now (`keys`), signed with it; a key nobody holds gets no answer."""

    max_tokens = 64

    def __init__(self, keys: dict[bytes, KeySet]) -> None:
        self.keys = keys

    def ask(self, pubkey: bytes, model_id: str, challenge: Challenge) -> Reply:
        keys = self.keys.get(pubkey)
        if keys is None:
            raise NoAnswer("no node answers under this key")
        return Reply(sign_response(keys, challenge.prompt, [11, 12, 13], "Because of Rayleigh scattering.", model_id,
                                   int(time.time()), "10.0.0.7:7000", challenge.temperature, challenge.seed,
                                   challenge.top_p))


def test_a_member_re_challenges_a_node_that_rotated_under_its_new_key_and_so_does_a_restarted_one(tmp_path):
    """A node's rotation takes effect at the first block of an epoch whose re-challenges three members
    tagged, under the key it had, in the closing windows before. The first sent its challenge then: its
    daemon reveals the answer, signed with the old key, under the new one. The second's offset comes after
    the rotation: the challenge it scheduled goes to the new key. The third's daemon restarts after the
    rotation: it finds its journalled challenge under the old key, commits no tag again (it holds as many
    as the plan has nodes), keeps the offset drawn for the key the node was planned under, sends the
    challenge to the new key and reveals it. Each attests the others' results at their score (the answer
    signed with the old key is the node's, not `wrong_node`), and the chain refuses nothing. Before, the
    first revealed under the old key (refused: not in the plan), the second asked the old key, which no
    node answers any more, and the third looked its journal up by the new key and drew a new challenge,
    whose tag the chain refused (more than the plan has nodes): the node escaped all three."""
    params = replace(EPOCH_PARAMS, epoch_blocks=20, vrf_window_blocks=5, plan_window_blocks=5,
                     response_slack_seconds=3_600)
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=params, genesis_time=int(time.time())))
    schedule = s.schedule
    rotating, control = list(s.nodes)
    new = KeySet.generate()
    assert s.block(s.tx(s.owner, "rotate-node-key",
                        RotateNodeKey.signed(CHAIN_ID, "org1", s.nodes[rotating], new).body())) == [(0, "ok")]
    s.run_to(schedule.setup_height(0))
    s.h.block()
    plan_txs, _ = s.plan_txs(1)
    assert all(c == 0 for c, _ in s.block(*plan_txs, *s.vrf_txs(1)))
    leader = s.leader(1)
    early, waiting, restarting = [m for m in s.members.values() if m.public != leader.public]
    overlay = _Nodes(dict(s.nodes))
    rounds = Rounds(s.h)
    offsets = {early.public: -1, waiting.public: 3, restarting.public: 3}  # the epoch's first block is offset 0
    drawn: list[bytes] = []

    def daemon(member: KeySet) -> Daemon:
        d = Daemon(member, InProcessLedger(s.h, rounds), {"gt": _Reference()}, overlay, None,  # type: ignore[arg-type]
                   tmp_path / member.public.hex(), rechallenge_share=1.0, silent_escape=1.0)

        def offset(number: int, node: bytes, schedule: Schedule) -> int:
            drawn.append(node)
            return offsets[member.public]

        def fresh(model_id: str, count: int = 1) -> list[Challenge]:
            return [Challenge.new(f"{secrets.token_hex(4)}: why do tides turn?", TEMPERATURE) for _ in range(count)]

        d._sample_offset = offset  # type: ignore[method-assign]
        d._fresh = fresh  # type: ignore[method-assign]
        return d

    for member in (early, waiting, restarting):
        (tmp_path / member.public.hex()).mkdir()
    daemons = [daemon(early), daemon(waiting), daemon(restarting)]
    for d in daemons:
        d.tick()  # each commits its tags of epoch 1 over the planned keys, in a block of its own
    assert s.h.height == schedule.start(1) - 1
    daemons[0].tick()  # the first one's offset has come: it asks both nodes before the rotation
    answered(daemons)
    assert set(daemons[0].pending) == {(1, rotating, "rechallenge"), (1, control, "rechallenge")}
    assert daemons[0].pending[1, rotating, "rechallenge"].result().reply.response.node == rotating

    s.run_to(schedule.start(1))
    assert events(s.h.block(), "node_key_rotated")  # the node moves to its new key and answers under it
    overlay.keys = {new.public: new, control: s.nodes[control]}
    s.nodes[new.public] = s.nodes.pop(rotating)
    s.nodes[new.public] = new
    assert s.block(s.tx(leader, "submit-results", s.leader_results(1, HONEST, sorted([new.public, control])))) == [
        (0, "ok")]
    assert (1, rotating) in daemons[1].scheduled
    daemons[2] = daemon(restarting)  # restarted: its journal is all it kept
    drawn.clear()
    for _ in range(schedule.start(1) + offsets[restarting.public] - s.h.height + 2):
        for d in daemons:
            d.tick()
            answered([d])
        s.h.block()

    refused = [entry["log"] for d in daemons for entry in d.submissions.read() if entry["code"] != 0]
    mine = {m: s.state.result(1, new.public, m) for m in offsets}
    assert {m: r and r.status for m, r in mine.items()} == dict.fromkeys(offsets, VALID), refused
    signed = {m: SignedResponse.from_record(r.response).node for m, r in mine.items()}
    assert signed == {early.public: rotating, waiting.public: new.public, restarting.public: new.public}
    assert rotating in drawn and new.public not in drawn  # the restart drew for the key it was planned under
    for submitter in offsets:
        assert {m: (c, d) for m, c, d in s.state.attestations(1, new.public, submitter)} == {
            m: (HONEST, 0) for m in offsets}
    for d in daemons:
        submitted = d.submissions.read()
        assert all(entry["code"] == 0 for entry in submitted), submitted
        assert sum(entry["type"] == "commit-rechallenge" for entry in submitted) == 1
        d.pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.parametrize("stream", [False, True])
def test_a_signed_answer_comes_back_whole(relay, stream):
    """Streamed or not (as often as users' programs stream), the answer is the signed text and the
    request asks for the challenge's own output cap."""
    node = KeySet.generate()
    response = sign_response(node, "Why is the sky blue?", [5, 6], "Light.", "gt", int(time.time()), "h:1", 500, 0)
    relay.body = {"choices": [{"text": "Light."}], "planetserve": response_extension(response)}
    challenge = Challenge.new("Why is the sky blue?", 500, max_tokens=12)
    got = OverlayChannel(relay.url, stream_share=float(stream), logprobs_share=0.0).ask(node.public, "gt", challenge)
    assert got.response == response and response_valid(got.response) and got.served is None
    assert relay.received[0] == {"path": "/v1/completions", "model": "gt", "prompt": "Why is the sky blue?",
                                 "max_tokens": 12, "temperature": 0.5, "stream": stream,
                                 "planetserve": {"node": node.public.hex(), "seed": challenge.seed}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_challenge_goes_as_its_one_message(relay, stream):
    """A chat challenge is sent as the user's message, as a chat program would; the node signs the
    rendered template, which is what the challenge commits."""
    node = KeySet.generate()
    rendered = "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n"
    response = sign_response(node, rendered, [5, 6], "Light.", "gt", int(time.time()), "h:1", 0, 0)
    relay.body = {"choices": [{"message": {"role": "assistant", "content": "Light."}}],
                  "planetserve": response_extension(response)}
    challenge = Challenge.new(rendered, 0, "Why is the sky blue?", max_tokens=12)
    got = OverlayChannel(relay.url, stream_share=float(stream), logprobs_share=0.0).ask(node.public, "gt", challenge)
    assert got.response == response
    assert relay.received[0] == {"path": "/v1/chat/completions", "model": "gt", "max_tokens": 12,
                                 "temperature": 0.0, "stream": stream,
                                 "planetserve": {"node": node.public.hex(), "seed": challenge.seed},
                                 "messages": [{"role": "user", "content": "Why is the sky blue?"}]}
    relay.body = {"choices": [{"text": "Light."}], "planetserve": response_extension(response)}
    with pytest.raises(NoAnswer, match="malformed answer"):
        OverlayChannel(relay.url, stream_share=float(stream)).ask(node.public, "gt", challenge)


def test_challenges_ask_for_log_probabilities_as_each_form_spells_it(relay):
    """A challenge asking for log-probabilities (a tenth by default, as the workload's programs ask) says
    so as a program would for its form, with 0-5 alternatives; its answer is the same signed text."""
    assert OverlayChannel(relay.url).logprobs_share == workloads.LOGPROBS_SHARE
    node = KeySet.generate()
    rendered = "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"
    asked = []
    for prompt, question in (("Why?", ""), (rendered, "Why?")) * 12:
        response = sign_response(node, prompt, [5, 6], "Light.", "gt", int(time.time()), "h:1", 0, 0)
        choice = {"message": {"role": "assistant", "content": "Light."}} if question else {"text": "Light."}
        relay.body = {"choices": [{**choice, "logprobs": {"content": []}}], "planetserve": response_extension(response)}
        challenge = Challenge.new(prompt, 0, question, max_tokens=12)
        assert OverlayChannel(relay.url, logprobs_share=1.0).ask(node.public, "gt", challenge).response == response
        body = relay.received[-1]
        if question:
            assert body["logprobs"] is True
            asked.append(body["top_logprobs"])
        else:
            assert "top_logprobs" not in body
            asked.append(body["logprobs"])
    assert set(asked) <= set(range(workloads.MAX_TOP_LOGPROBS + 1)) and len(set(asked)) > 2


def test_a_follow_up_challenge_sends_its_first_turn_under_the_same_session(relay):
    """As a user's program continues a conversation: the previous turn first, then the follow-up, both
    under one session id; a first turn the node does not answer is its failure to answer."""
    node = KeySet.generate()
    response = sign_response(node, "Why? And how?", [5, 6], "Light.", "gt", int(time.time()), "h:1", 0, 0)
    relay.body = {"choices": [{"text": "Light."}], "planetserve": response_extension(response)}
    challenge = Challenge.new("Why? And how?", 0, max_tokens=12, earlier=(4,))
    assert OverlayChannel(relay.url).ask(node.public, "gt", challenge).response == response
    first, second = relay.received
    assert (first["prompt"], second["prompt"]) == ("Why?", "Why? And how?")
    assert first["planetserve"]["session_id"] == second["planetserve"]["session_id"]
    assert first["planetserve"]["node"] == second["planetserve"]["node"] == node.public.hex()
    # the scored turn carries the committed seed; the earlier one a fresh seed, as a program's turn does
    assert second["planetserve"].pop("seed") == challenge.seed != first["planetserve"].pop("seed")
    assert {k: v for k, v in first.items() if k != "prompt"} == {k: v for k, v in second.items() if k != "prompt"}
    relay.first = [(502, {"error": {"code": "node_unreachable", "message": "gone"}})]
    with pytest.raises(NoAnswer, match="turn 1 of the session failed: HTTP 502 node_unreachable"):
        OverlayChannel(relay.url).ask(node.public, "gt", challenge)


def test_a_forwarded_answer_names_the_node_that_computed_it(relay):
    entry, peer = KeySet.generate(), KeySet.generate()
    now = int(time.time())
    answer = sign_response(entry, "Why?", [5, 6], "Light.", "gt", now, "entry:1", 0, 0)
    computed = sign_response(peer, "Why?", [5, 6], "Light.", "gt", now - 1, "peer:1", 0, 0)
    relay.body = {"choices": [{"text": "Light."}],
                  "planetserve": {**response_extension(answer), "served": served_extension(computed)}}
    got = OverlayChannel(relay.url).ask(entry.public, "gt", Challenge.new("Why?", 0))
    assert got.response == answer and got.served == computed
    # a serving signature that does not check is dropped: the entry node alone answers for it
    forged = {**served_extension(computed), "signature": "00" * 64}
    relay.body["planetserve"]["served"] = forged
    assert OverlayChannel(relay.url).ask(entry.public, "gt", Challenge.new("Why?", 0)).served is None
    other_text = sign_response(peer, "Why?", [5, 7], "Dark.", "gt", now, "peer:1", 0, 0)
    relay.body["planetserve"]["served"] = served_extension(other_text)
    assert OverlayChannel(relay.url).ask(entry.public, "gt", Challenge.new("Why?", 0)).served is None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("body", "message"), [
    (b"[" * 5_000 + b"]" * 5_000, "not JSON|carried no choice"),
    (b"[" + b"[]," * 300_000 + b"[]]", "holds more than|may build"),
    (b"data: " + b"[" * 5_000 + b"]" * 5_000 + b"\n\n", "not JSON"),
], ids=["deep", "wide", "deep event"])
def test_an_answer_built_to_exhaust_its_reader_is_no_answer(relay, stream, body, message):
    """JSON nested past the interpreter's recursion (a RecursionError ended the daemon's tick, and with it
    every answer it had collected) or built to decode into many objects, in 1.2 MB."""
    relay.body = body
    with pytest.raises(NoAnswer, match=message):
        OverlayChannel(relay.url, stream_share=float(stream)).ask(bytes(32), "gt", Challenge.new("Why?", 0))


@pytest.mark.parametrize("event", [b'{"choices": 1}', b'{"choices": [1]}', b"[1, 2]", b'"text"'])
def test_a_streamed_event_of_another_shape_is_no_answer(relay, event):
    """A streamed event whose `choices` is no list raised a TypeError past the challenge's tries, so the
    challenge was neither claimed nor revealed; an event that is no object is no answer either."""
    relay.body = b"data: " + event + b"\n\ndata: [DONE]\n\n"
    with pytest.raises(NoAnswer, match="malformed answer"):
        OverlayChannel(relay.url, stream_share=1.0).ask(bytes(32), "gt", Challenge.new("Why?", 0))


@pytest.mark.parametrize(("status", "body", "error", "message"), [
    (503, {"error": {"code": "too_few_paths", "message": "2 live"}}, RelayUnavailable, "too_few_paths"),
    (502, {"error": {"code": "node_unreachable", "message": "proxies could not reach it"}}, NoAnswer,
     "HTTP 502 node_unreachable: proxies could not reach it"),
    (404, {"error": {"code": "node_not_found", "message": "no such node"}}, NoAnswer, "node_not_found"),
    (500, {"error": {"code": "x\x07", "message": "no\x00\x1b\nanswer"}}, NoAnswer,
     "^HTTP 500 x : no answer$"),  # a node's own words, kept to one printable line
    (200, {"choices": [{"text": "x"}]}, NoAnswer, "no planetserve extension"),
    (200, {"choices": []}, NoAnswer, "malformed answer"),
    (200, {"choices": [{"text": 5}], "planetserve": {}}, NoAnswer, "malformed answer"),
    (200, {"choices": [{"text": "x" * MAX_ANSWER_BYTES}]}, NoAnswer, f"answer larger than {MAX_ANSWER_BYTES} bytes"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_what_is_not_an_answer(relay, status, body, error, message, stream):
    relay.status, relay.body = status, body
    relay.headers = {ANSWERED_BY: "node" if status == 200 else "relay"}
    with pytest.raises(error, match=message):
        OverlayChannel(relay.url, stream_share=float(stream)).ask(bytes(32), "gt", Challenge.new("Why?", 0))


@pytest.mark.parametrize("said", ["node", None])
def test_a_node_saying_the_relay_cannot_send_is_no_answer(relay, said):
    """A node's answer reaches the verifier as the node wrote it, so a node could answer each challenge
    with the relay's "cannot send now" and be tried again, never reported: only the relay's own word
    (`ANSWERED_BY`, which the relay sets) makes the relay unavailable."""
    relay.status, relay.body = 503, {"error": {"code": "too_few_paths", "message": "0 live"}}
    relay.headers = {ANSWERED_BY: said} if said else {}
    with pytest.raises(NoAnswer, match="HTTP 503 too_few_paths: 0 live"):
        OverlayChannel(relay.url).ask(bytes(32), "gt", Challenge.new("Why?", 0))


def test_a_challenge_is_tried_again_before_the_node_is_reported(relay, tmp_path, monkeypatch):
    monkeypatch.setattr(daemon_module, "RETRY_DELAY_S", 0.0)
    node = KeySet.generate()
    challenge = Challenge.new("Why?", 0)
    response = sign_response(node, "Why?", [5, 6], "Light.", "gt", int(time.time()), "h:1", 0, challenge.seed)
    relay.body = {"choices": [{"text": "Light."}], "planetserve": response_extension(response)}
    cut = (500, {"error": {"message": "Generation failed: the peer failed mid-answer"}})
    registered = ModelNode(node.public, "org", "gt", "h:1", "cpu", 1, "eu", "active", 0)

    def asked(attempts: int):
        daemon = Daemon(KeySet.generate(), None, {}, OverlayChannel(relay.url), None, tmp_path, attempts=attempts)
        daemon._ask((1, node.public, "leader"), challenge, registered)
        return daemon.pending[1, node.public, "leader"].result(timeout=30)

    relay.first = [cut]
    assert asked(2).reply.response == response  # the second try got the answer
    relay.first = [cut, cut]
    failed = asked(2)
    assert failed.reply is None and failed.failure.startswith("2 attempts: HTTP 500")
    relay.first = [cut]
    assert asked(1).reply is None


@pytest.mark.faults
def test_a_silent_node_and_a_missing_relay(relay):
    relay.delay, relay.body = 2.0, {}
    with pytest.raises(NoAnswer, match="no answer within 0.5 s"):
        OverlayChannel(relay.url, timeout=0.5).ask(bytes(32), "gt", Challenge.new("Why?", 0))
    with pytest.raises(RelayUnavailable, match="unreachable"):
        OverlayChannel(f"http://127.0.0.1:{free_ports(1)[0]}").ask(bytes(32), "gt", Challenge.new("Why?", 0))


# -- the CLI ------------------------------------------------------------------------------------


def test_cli_init_and_status(tmp_path):
    runner = CliRunner()
    keys = tmp_path / "member.json"
    KeySet.generate().save(keys)
    assert runner.invoke(main, ["genesis", "init", str(tmp_path / "net"), "-n", "1"]).exit_code == 0
    genesis = tmp_path / "net" / "v0" / "config" / "genesis.json"
    home = tmp_path / "ver"
    args = ["verifier", "init", "--home", str(home), "--keys", str(keys), "--genesis", str(genesis)]
    done = runner.invoke(main, [*args, "--model", "gt=gt", "--model", "big=/models/big", "--witness",
                                "http://10.0.0.8:26657", "--max-age", "90", "--json"])
    assert done.exit_code == 0, done.output
    config = VerifierConfig.load(home)
    assert config.models == {"gt": "gt", "big": "/models/big"} and config.keys == str(keys.resolve())
    assert (config.witness, config.max_age) == ("http://10.0.0.8:26657", 90)
    again = runner.invoke(main, args)
    assert again.exit_code != 0 and "already has verifier.json" in again.output
    bad = runner.invoke(main, ["verifier", "init", "--home", str(tmp_path / "v2"), "--keys", str(keys),
                               "--genesis", str(genesis), "--model", "gt"])
    assert bad.exit_code != 0 and "MODEL_ID=REFERENCE" in bad.output
    bad = runner.invoke(main, ["verifier", "init", "--home", str(tmp_path / "v3"), "--keys", str(keys),
                               "--genesis", str(genesis), "--relay", "127.0.0.1:8080"])
    assert bad.exit_code == 1 and "relay must be an http:// URL" in bad.output and not (tmp_path / "v3").exists()
    (tmp_path / "empty.json").write_text("{}")
    bad = runner.invoke(main, ["verifier", "init", "--home", str(tmp_path / "v4"), "--keys", str(keys),
                               "--genesis", str(tmp_path / "empty.json")])
    assert bad.exit_code == 1 and "not a usable genesis file" in bad.output

    missing = runner.invoke(main, ["verifier", "status", "--home", str(home)])
    assert missing.exit_code != 0 and "has not run yet" in missing.output
    (home / STATUS_FILE).write_text(json.dumps({"member": "ab" * 32, "epoch": 3, "height": 95, "leader": True,
                                                "submitted": 4, "rejected": 1, "pending": 0,
                                                "last_error": None}))
    (home / SUBMISSIONS_FILE).write_text(json.dumps({"time": 1, "epoch": 3, "type": "attest", "code": 0,
                                                     "height": 90, "log": ""}) + "\n")
    with (home / SUBMISSIONS_FILE).open("a") as fh:
        fh.write('{"time": 2, "epoch": 3, "ty')  # cut short by a crash
    shown = runner.invoke(main, ["verifier", "status", "--home", str(home)])
    assert shown.exit_code == 0 and "epoch 3" in shown.output and "leader" in shown.output
    assert "attest" in shown.output
    as_json = json.loads(runner.invoke(main, ["verifier", "status", "--home", str(home), "--json"]).output)
    assert as_json["submissions"][0]["type"] == "attest" and as_json["rejected"] == 1
    assert len(as_json["submissions"]) == 1
    for garbage in ("garbage", "{}"):
        (home / STATUS_FILE).write_text(garbage)
        refused = runner.invoke(main, ["verifier", "status", "--home", str(home)])
        assert refused.exit_code == 1 and "is not the daemon's status" in refused.output


def test_cli_run_explains_a_missing_home(tmp_path):
    done = CliRunner().invoke(main, ["verifier", "run", "--home", str(tmp_path)])
    assert done.exit_code != 0 and "planetserve verifier init" in done.output



@pytest.mark.parametrize("seed", [-1, 2**64, "7"])
def test_an_answer_signed_with_a_seed_outside_the_protocols_is_not_an_answer(relay, seed):
    node = KeySet.generate()
    extension = response_extension(sign_response(node, "Why?", [5, 6], "Light.", "gt", int(time.time()), "h:1",
                                                 0, 0))
    relay.body = {"choices": [{"text": "Light."}], "planetserve": {**extension, "seed": seed}}
    expected = "extension seed must lie in" if isinstance(seed, int) else "extension field 'seed' is missing or not a int"
    with pytest.raises(NoAnswer, match=f"malformed answer: {expected}"):
        OverlayChannel(relay.url).ask(node.public, "gt", Challenge.new("Why?", 0))
