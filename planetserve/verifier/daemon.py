"""The verifier daemon: one committee member's part in every epoch (docs/architecture.md, "The
verifier daemon").

Each tick reads the verified ledger and does what is due at the next height, so a restarted daemon
simply resumes: the ledger, not memory, says what was already done, and nothing is submitted twice.
Due work, in order:

- in the VRF window: prove the next epoch's seed;
- as the leader of this epoch, in the plan window: commit the next epoch's plan (fresh challenges,
  sealed to every member);
- as the leader of this epoch, in its results window: send each planned challenge through the
  overlay, score the answer and submit it with the proposed credibility;
- always: score every valid result not yet attested and attest;
- once the results window has closed: re-challenge every planned node without a valid leader result
  (commitment first, then the challenge, then the revealed result, or an invalid claim);
- from the epoch's plan on (in the closing windows of the epoch before), re-challenge a secret share of
  its nodes, each from a secret block, holding the answers until the epoch starts.

Challenges run in a thread pool so that a slow node never holds up attestations; a re-challenge's
prompt and salt are written to a journal before its commitment, so a restart can still reveal it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from planetserve.chain import vrf
from planetserve.chain.challenge import DEFAULT_MAX_TOKENS, Challenge, SealedPromptError, open_plan_entry
from planetserve.chain.client import TRANSIENT, LedgerClient
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.chain.messages.base import Body, Message
from planetserve.chain.messages.epochs import (
    MAX_ENTRIES,
    Attest,
    CommitPlan,
    CommitRechallenge,
    PlanItem,
    Revealed,
    SubmitResults,
    SubmitVrf,
    Unanswered,
)
from planetserve.metrics import StatusCollector
from planetserve.registry import codec, epochs, fields
from planetserve.registry.entities import Member, ModelNode
from planetserve.registry.epochs import (
    PLAN_COMMITTED,
    UNOPENED,
    VALID,
    ChallengeResult,
    PlanEntry,
    Schedule,
    SignedResponse,
)
from planetserve.registry.params import Params
from planetserve.verifier.challenges import ChallengeError, ChallengeSource, to_challenge
from planetserve.verifier.config import (
    RECHALLENGE_FILE,
    RECHALLENGE_SHARE,
    STATUS_FILE,
    SUBMISSIONS_FILE,
    JsonLines,
)
from planetserve.verifier.coverage import KEEP_SHARE, SILENT_ESCAPE, rechallenge_share
from planetserve.verifier.credibility import Answer, ReferenceModel, Verdict
from planetserve.verifier.overlay import NoAnswer, OverlayChannel, RelayUnavailable, Reply

log = logging.getLogger(__name__)

Entry = TypeVar("Entry")

TX_MARGIN_BYTES = 1_024
"""Room left in max_tx_bytes for the envelope around a part of a plan or of results."""
TAG_BYTES = 34
"""A re-challenge tag in a transaction: 32 bytes and their msgpack header."""
PLAN_DRAWS = 8
ERROR_BACKOFF_MAX = 30.0
RETRY_DELAY_S = 2.0
SETTLE_BLOCKS = 5
"""The leader sends an epoch's challenges from this many blocks into it (at most half the results
window): the previous epoch's finalization may just have delisted a node, and a challenged node that
forwards on a view of the list a few seconds old would answer for what an unlisted peer computed."""
GIVE_UP_BLOCKS = 4
"""The leader claims no answer for each of its challenges still out this many blocks before its results
window closes, so the claim lands in the window: a node that answers late, or answers the leader late
on purpose and the members' re-challenges on time, costs the leader no `skipped-node` fault (and the
claim, one report, has the members re-challenge it). A daemon ticks more often than this many blocks."""
AHEAD_BLOCKS = 2
"""An epoch's plan lands in the block after the setup height of the epoch before at the earliest, and a
member's tags of it in the block after that: from then on its sampled re-challenges may be sent."""
OVERDUE = f"no answer {GIVE_UP_BLOCKS} blocks before the results window closed"
LATE = "no answer in time to be revealed where every member must attest it"
"""A re-challenge still out at `rechallenge_cutoff` is claimed unanswered with this reason."""
SIGNED_TIME_TOLERANCE_S = 60
"""How far from its arrival an answer's signed time may be: half the chain's default slack, so an answer
this member reveals never makes it `stale-response`-faulty for the node's choice of time."""


@dataclass(frozen=True)
class Asked:
    """A challenge sent to a node: the answer, or why there is none."""

    challenge: Challenge
    node: bytes
    reply: Reply | None = None
    failure: str = ""


@dataclass(frozen=True)
class Scheduled:
    """A re-challenge waiting for block `height` (a sampled one's offset; the next block for one the
    leader's result left needed): sent at the first block from it the daemon sees, between its tick's
    transactions as well as at a tick's start (`send_scheduled`)."""

    height: int
    last: int
    """`last_rechallenge` of its epoch: one sent after it is `late`."""
    cutoff: int
    """`rechallenge_cutoff` of its epoch: none is sent from it on."""
    challenge: Challenge
    node: ModelNode


class Journal:
    """Re-challenge prompts and salts, appended and fsynced before their commitment is submitted."""

    def __init__(self, path: Path) -> None:
        self.lines = JsonLines(path)  # owner-only: the prompts are secret until revealed
        self.entries: dict[tuple[int, bytes], Challenge] = {}
        for item in self.lines.read():
            # a line written before challenges sealed their cap, earlier turns and nucleus asked the
            # default cap over the whole vocabulary
            self.entries[item["epoch"], bytes.fromhex(item["node"])] = Challenge(
                item["prompt"], bytes.fromhex(item["salt"]), item["temperature"], item["question"],
                item.get("max_tokens", DEFAULT_MAX_TOKENS), tuple(item.get("earlier", ())),
                item.get("top_p", epochs.MILLI))

    def add(self, epoch: int, node: bytes, challenge: Challenge) -> None:
        self.lines.append({"epoch": epoch, "node": node.hex(), "prompt": challenge.prompt,
                           "salt": challenge.salt.hex(), "temperature": challenge.temperature,
                           "question": challenge.question, "max_tokens": challenge.max_tokens,
                           "earlier": list(challenge.earlier), "top_p": challenge.top_p}, durable=True)
        self.entries[epoch, node] = challenge

    def get(self, epoch: int, node: bytes) -> Challenge | None:
        return self.entries.get((epoch, node))


class Daemon:
    def __init__(self, keys: KeySet, ledger: LedgerClient, references: dict[str, ReferenceModel],
                 channel: OverlayChannel, source: ChallengeSource, home: Path, *,
                 calibrated: bool = True, concurrency: int = 8, attempts: int = 2,
                 rechallenge_share: float = RECHALLENGE_SHARE, silent_escape: float = SILENT_ESCAPE,
                 retired: KeySet | None = None) -> None:
        self.keys = keys
        self.earlier_x25519 = (retired.x25519,) if retired is not None else ()
        """The X25519 key this member had before its last rotation: the plan sealed before it took
        effect opens only with that one."""
        self.me = keys.public
        self.ledger = ledger
        self.references = references
        self.channel = channel
        self.source = source
        self.calibrated = calibrated
        self.rechallenge_share = rechallenge_share
        self.silent_escape = silent_escape
        self.shares: dict[int, float] = {}
        """Epoch → the share this member re-challenges at in it (`coverage.rechallenge_share`), fixed by
        the committee as first read for it, so that a coin drawn once is drawn alike later."""
        self.attempts = attempts
        """Tries per challenge before the node is reported: one failure may be the network's (a
        forwarded answer cut off), and a user would ask again too."""
        self.journal = Journal(home / RECHALLENGE_FILE)
        self.submissions = JsonLines(home / SUBMISSIONS_FILE)
        self.status_file = home / STATUS_FILE
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="challenge")
        self.pending: dict[tuple[int, bytes, str], Future[Asked]] = {}
        self.scores: dict[tuple[int, bytes, bytes], tuple[int, int]] = {}
        """(epoch, node, submitter) → what this member stands behind: (credibility ppm, deviations)."""
        self.given_up: set[tuple[int, Hashable]] = set()
        self.tagged: set[int] = set()
        """Epochs whose re-challenge tags this member has all committed."""
        self.scheduled: dict[tuple[int, bytes], Scheduled] = {}
        """(epoch, node) → its re-challenge, tag committed, waiting for its block: at most one per planned
        node of this epoch and the next."""
        self.late: set[tuple[int, bytes]] = set()
        """(epoch, node) of re-challenges sent after `last_rechallenge`: a tick that spent blocks on its
        transactions passed over their offsets. Their answers are revealed if they come before the cutoff;
        one that does not is not claimed, since the node had less than `GIVE_UP_BLOCKS` to answer."""
        self.unopened: set[tuple[int, bytes]] = set()
        """(epoch, node) of planned challenges this leader could not open: it says so (`UNOPENED`) rather
        than leave the node out, which was its `skipped-node` fault for what the planner sealed."""
        self.starts: dict[int, int] = {}
        """Epoch → its first block, where key rotations take effect (`_follow_rotations`)."""
        self.followed: set[int] = set()
        """Epochs whose plan this member has read as its first block left it: the keys it names are final."""
        self.moved: dict[tuple[int, bytes], tuple[bytes, ...]] = {}
        """(epoch, node's key) → the node's keys in the epoch (`PlanEntry.node_keys`), for a node whose
        rotation took effect at the epoch's first block: the key it was planned under is the one its tags
        name and its answers to the challenges sent before then are signed with."""
        self.status: dict[str, Any] = {"member": self.me.hex(), "started": int(time.time()), "ticks": 0,
                                       "submitted": 0, "rejected": 0, "challenges": 0, "scored": 0,
                                       "last_error": None}

    # -- the loop --------------------------------------------------------------------------------

    def run(self, stop: threading.Event, poll_interval: float = 1.0) -> None:
        """Tick until `stop` is set; ledger and relay outages back off and are retried."""
        delay = poll_interval
        while not stop.is_set():
            try:
                self.tick()
                delay = poll_interval
                self.status["last_error"] = None
            except (*TRANSIENT, RelayUnavailable, ChallengeError) as exc:
                delay = min(ERROR_BACKOFF_MAX, delay * 2)
                self.status["last_error"] = f"{type(exc).__name__}: {exc}"
                log.warning("tick failed, retrying in %.0f s: %s", delay, exc)
            self._write_status()
            stop.wait(delay)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def tick(self) -> None:
        with self.ledger.snapshot() as verified:
            params = self.ledger.params()
            schedule = Schedule.from_params(params)
            upcoming = verified + 1  # the earliest block a transaction sent now can land in
            number = schedule.epoch_of(upcoming)
            current = self.ledger.epoch(number)
            self.status.update(ticks=self.status["ticks"] + 1, height=verified, epoch=number,
                               leader=bool(current and current.leader == self.me))
            if current is None:
                return
            self._forget_before(number)
            self.starts.update({number: schedule.start(number), number + 1: schedule.start(number + 1)})
            self._follow_rotations(number, verified)
            if current.leader == self.me:
                self._drop_rechallenges(number)
            leading = current.leader == self.me and schedule.in_results(upcoming)
            overdue = {"leader"} if leading and not schedule.in_results(upcoming + GIVE_UP_BLOCKS) else set()
            if upcoming >= rechallenge_cutoff(schedule, number):
                overdue.add("rechallenge")
            self._collect(number, params.max_tx_bytes - TX_MARGIN_BYTES, overdue)
            if schedule.in_plan_window(upcoming):  # first: the plan takes longer than the proof
                self._plan(number + 1, params, schedule, upcoming)
            if schedule.in_vrf_window(upcoming):
                self._prove(number + 1, schedule)
            planned = current.plan_status == PLAN_COMMITTED
            settled = upcoming >= leader_start(schedule, number)
            if planned and leading and settled and "leader" not in overdue:
                self._lead(number)
            self._attest(number, params.max_tx_bytes - TX_MARGIN_BYTES)
            tags_per_tx = min(MAX_ENTRIES, (params.max_tx_bytes - TX_MARGIN_BYTES) // TAG_BYTES)
            if planned:
                self._rechallenge(number, current.leader, schedule, tags_per_tx)
            if upcoming > schedule.setup_height(number):  # the next epoch's plan may be committed
                following = self.ledger.epoch(number + 1)
                if following is not None and following.plan_status == PLAN_COMMITTED:
                    self._rechallenge(number + 1, None, schedule, tags_per_tx)

    def _forget_before(self, number: int) -> None:
        """Past epochs' scores and refusals are of no more use (their transactions would be refused)."""
        self.scores = {k: v for k, v in self.scores.items() if k[0] >= number}
        self.given_up = {k for k in self.given_up if k[0] >= number}
        self.tagged = {n for n in self.tagged if n >= number}
        self.shares = {n: v for n, v in self.shares.items() if n >= number}
        self.late = {k for k in self.late if k[0] >= number}
        self.scheduled = {k: v for k, v in self.scheduled.items() if k[0] >= number}
        self.unopened = {k for k in self.unopened if k[0] >= number}
        self.starts = {n: v for n, v in self.starts.items() if n >= number}
        self.followed = {n for n in self.followed if n >= number}
        self.moved = {k: v for k, v in self.moved.items() if k[0] >= number}

    def _follow_rotations(self, number: int, verified: int) -> None:
        """Once epoch `number`'s first block is in, where key rotations take effect: what this member holds
        under a key that the epoch's plan moved (`PlanEntry.moved_from`) goes on under the node's new key.
        Its re-challenges scheduled, out or answered are revealed or claimed under it (their tags name the
        old key, which the chain opens for the new one, and an answer signed with the old key before the
        rotation counts as the node's), and those not yet sent go to the new key: a node that rotated
        would otherwise escape them all (and the chain refused each reveal under the old key)."""
        if number in self.followed or verified < self.starts[number]:
            return
        for entry in self.ledger.plan(number)[1]:
            if not entry.moved_from:
                continue
            old, new = entry.moved_from, entry.node
            self.moved[number, new] = entry.node_keys
            for kind in ("leader", "rechallenge"):
                if (number, old, kind) in self.pending:
                    self.pending[number, new, kind] = self.pending.pop((number, old, kind))
            if (number, old) in self.late:
                self.late.discard((number, old))
                self.late.add((number, new))
            item = self.scheduled.pop((number, old), None)
            if item is not None and (node := self._verifiable(new)) is not None:
                self.scheduled[number, new] = replace(item, node=node)
            log.info("node %s was rotated to %s at epoch %d's start: its re-challenges follow it",
                     old.hex()[:16], new.hex()[:16], number)
        self.followed.add(number)

    def _node_keys(self, number: int, node: bytes) -> tuple[bytes, ...]:
        """`node`'s keys in epoch `number`, as `PlanEntry.node_keys` gives them."""
        return self.moved.get((number, node), (node,))

    def _journalled(self, number: int, keys: tuple[bytes, ...]) -> tuple[bytes, Challenge] | None:
        """This member's re-challenge of a node in epoch `number` and the key it was journalled and tagged
        under: one of the node's `keys` (its key in the plan, then the one it had when the plan was
        committed, if it rotated since)."""
        for key in keys:
            if (challenge := self.journal.get(number, key)) is not None:
                return key, challenge
        return None

    def _drop_rechallenges(self, number: int) -> None:
        """The leader of epoch `number` re-challenges nothing in it, and it submits one result per node:
        the re-challenges it sent in the closing windows before, not knowing it would lead, go unrevealed."""
        for key in [k for k in self.pending if k[0] == number and k[2] == "rechallenge"]:
            self.pending.pop(key).cancel()
        self.scheduled = {k: v for k, v in self.scheduled.items() if k[0] != number}

    def _open(self, window: Callable[[int], bool]) -> bool:
        """Whether the window still holds for the next block, by the endpoint's latest height."""
        return window(self._next_height())

    def _next_height(self) -> int:
        """The next block by the endpoint's latest height: only a matter of timing (a wrong answer costs a
        refused transaction, or a re-challenge sent a block early or late), so it is not verified."""
        return int(self.ledger.rpc.status()["sync_info"]["latest_block_height"]) + 1

    # -- submitting ------------------------------------------------------------------------------

    def _submit(self, msg: Message, epoch: int, keys: Iterable[Hashable] = ()) -> bool:
        """Submit and record the outcome. A refusal other than a stale sequence will not change on a
        retry, so the work items `keys` are given up for this epoch instead of being sent again; one the
        endpoint says a block made is first checked against the verified headers (`verified_outcome`:
        where it does not check, the tick fails and the work is tried again)."""
        done = self.ledger.submit(self.keys, msg)
        if done.height:
            self.send_scheduled(done.height + 1)
        if done.height and not done.outcome.ok:
            done = self.ledger.verified_outcome(done)
        tx_type = msg.TYPE
        code, message = done.outcome.code, done.outcome.log
        self.status["submitted" if code == 0 else "rejected"] += 1
        self.submissions.append({"time": int(time.time()), "epoch": epoch, "type": tx_type, "code": code,
                                 "height": done.height, "log": message})
        if code == 0:
            log.info("%s for epoch %d committed at height %d", tx_type, epoch, done.height)
            return True
        log.warning("%s for epoch %d refused (code %d): %s", tx_type, epoch, code, message)
        if code != Code.BAD_SEQUENCE:
            self.given_up.update((epoch, key) for key in keys)
        return False

    def _due(self, epoch: int, key: Hashable) -> bool:
        return (epoch, key) not in self.given_up

    # -- leader election and plans ---------------------------------------------------------------

    def _prove(self, target_number: int, schedule: Schedule) -> None:
        target = self.ledger.epoch(target_number)
        if (target is None or not self._due(target_number, "vrf")
                or self.ledger.vrf_entry(target_number, self.me) is not None
                or not self._open(schedule.in_vrf_window)):
            return
        proof = vrf.prove(bytes(self.keys.vrf), target.seed)
        self._submit(SubmitVrf(target_number, proof), target_number, ["vrf"])

    def _plan(self, target_number: int, params: Params, schedule: Schedule, upcoming: int) -> None:
        """As the planner of `target_number`, commit its plan; as its backup planner, complete in the plan
        window's last half what the planner has not committed."""
        target = self.ledger.epoch(target_number)
        if target is None or target.plan_status == PLAN_COMMITTED or not self._due(target_number, "plan"):
            return
        leading = target.plan_leader == self.me
        if not (leading or schedule.in_backup_plan_window(upcoming)):
            return
        _, committee = self.ledger.committee()
        window = schedule.in_plan_window
        if not leading:
            operators = [m.operator for m in committee]
            if epochs.backup_planner(target.seed, operators, target.plan_leader) != self.me:
                return
            window = schedule.in_backup_plan_window
            log.warning("the plan of epoch %d is not committed: completing it as its backup planner",
                        target_number)
        required = self.ledger.plan_required(target_number)
        planned = {entry.node for entry in self.ledger.plan(target_number)[1]}
        models = {n.pubkey: n.model_id for n in self.ledger.registered_nodes()}
        entries = [self._plan_entry(node, models.get(node, ""), committee, params)
                   for node in required if node not in planned]
        parts = _parts(entries, params.max_tx_bytes - TX_MARGIN_BYTES)
        for index, part in enumerate(parts):
            final = index == len(parts) - 1
            if not self._open(window) or not self._submit(
                    CommitPlan(target_number, tuple(part), final), target_number, ["plan"]):
                return

    def _plan_entry(self, node: bytes, model_id: str, committee: list[Member], params: Params) -> PlanItem:
        """A fresh challenge for `node`, drawn again while its plan entry would not fit a transaction or a
        node could not answer it (`ReferenceModel.unanswerable`: the leader would claim it unopened)."""
        reference = self.references.get(model_id)
        for _ in range(PLAN_DRAWS):
            challenge = self._fresh(model_id)[0]
            entry = challenge.plan_entry(node, committee)
            if (_body_size(entry) <= params.max_tx_bytes - TX_MARGIN_BYTES
                    and not (reference is not None and reference.unanswerable(challenge))):
                return entry
        raise ChallengeError(f"no answerable challenge small enough for a {len(committee)}-member plan entry "
                             f"in {PLAN_DRAWS} draws; lower max_prompt_tokens")

    # -- challenges ------------------------------------------------------------------------------

    def _fresh(self, model_id: str, count: int = 1) -> list[Challenge]:
        """`count` new challenges for nodes of `model_id`, drawn from one run of the workload: a chat is
        committed as the text the reference model's chat template makes of it (what the node will sign);
        a model without one gets a completion."""
        reference = self.references.get(model_id)
        encode = reference.encode if reference is not None else None
        return [to_challenge(drawn, reference.chat_prompt(drawn.text) if drawn.chat and reference is not None
                             else None, self.channel.max_tokens, encode)
                for drawn in self.source.draw(count)]

    def _ask(self, key: tuple[int, bytes, str], challenge: Challenge, node: ModelNode) -> None:
        if key in self.pending:
            return

        reference = self.references.get(node.model_id)

        def run() -> Asked:
            failures = []
            for attempt in range(self.attempts):
                if attempt:
                    time.sleep(RETRY_DELAY_S)
                try:
                    reply = self.channel.ask(node.pubkey, node.model_id, challenge)
                    now = int(time.time())
                    mismatch = challenge.signed_otherwise(reply.response, now, SIGNED_TIME_TOLERANCE_S)
                    if not mismatch and reference is not None:
                        mismatch = reference.ending(challenge, reply.response)
                    if mismatch:
                        raise NoAnswer(mismatch)
                    return Asked(challenge, node.pubkey, reply)
                except NoAnswer as exc:
                    failures.append(str(exc))
            return Asked(challenge, node.pubkey, failure=f"{len(failures)} attempts: " + "; ".join(failures))

        self.pending[key] = self.pool.submit(run)
        self.status["challenges"] += 1

    def _collect(self, number: int, limit: int, overdue: Collection[str] = ()) -> None:
        """Submit what finished challenges brought back, each kind's answers together in as few
        transactions of at most `limit` bytes as hold them: the daemon waits for each transaction's
        block, so one per answer took a leader's results past its window on a slow machine."""
        for kind, entries in self.results(number, overdue).items():
            for part in _parts([_revealable(entry, kind, limit) for entry in entries], limit):
                if part:
                    self._submit(SubmitResults(number, kind, tuple(part)), number,
                                 [(entry.node, kind) for entry in part])

    def results(self, number: int, overdue: Collection[str] = ()) -> dict[str, list[Revealed | Unanswered]]:
        """The entries of epoch `number`'s finished challenges by kind, taken out of `pending`; for the
        kinds `overdue`, the challenges still out too, each claimed unanswered (the leader's
        `GIVE_UP_BLOCKS` before its window closes, re-challenges at `rechallenge_cutoff`, naming the
        commitment that opens their tags). The next epoch's re-challenges, sent in this one's closing
        windows, are kept until it starts; other epochs' challenges are dropped."""
        entries: dict[str, list[Revealed | Unanswered]] = {"leader": [], "rechallenge": []}
        for key in sorted(self.pending):
            future = self.pending[key]
            epoch, node, kind = key
            if epoch != number:
                if epoch != number + 1:
                    future.cancel()
                    del self.pending[key]
                continue
            if not future.done():
                if kind in overdue:
                    future.cancel()
                    del self.pending[key]
                    if kind == "rechallenge" and (epoch, node) in self.late:
                        log.info("node %s has not answered a re-challenge sent late in epoch %d: not claimed",
                                 node.hex()[:16], number)
                        continue
                    log.warning("node %s has not answered the %s in epoch %d: claimed unanswered",
                                node.hex()[:16], "leader's challenge" if kind == "leader" else "re-challenge",
                                number)
                    entries[kind].append(self._unanswered(number, node, kind))
                continue
            del self.pending[key]
            try:
                asked = future.result()
            except RelayUnavailable as exc:
                log.warning("challenge of %s not sent, will retry: %s", node.hex()[:16], exc)
                continue
            except Exception:  # this member's fault, not the node's: the other answers collected still go
                log.exception("challenge of %s failed here, will retry", node.hex()[:16])
                continue
            entries[kind].append(self._entry(number, asked, kind, node))
        for epoch, node in sorted(self.unopened):
            if epoch == number:
                entries["leader"].append(Unanswered(node, UNOPENED))
        self.unopened = {k for k in self.unopened if k[0] != number}
        return entries

    def _unanswered(self, number: int, node: bytes, kind: str) -> Unanswered:
        if kind == "leader":
            return Unanswered(node, OVERDUE)
        journalled = self._journalled(number, self._node_keys(number, node))
        if journalled is None:
            raise RuntimeError(f"re-challenge of {node.hex()} in epoch {number} is not in the journal")
        return Unanswered(node, LATE, journalled[1].commitment)

    def _lead(self, number: int) -> None:
        mine = {r.node for r in self.ledger.results(number) if r.submitter == self.me}
        for entry in self.ledger.plan(number)[1]:
            if (entry.node in mine or (number, entry.node, "leader") in self.pending
                    or not self._due(number, (entry.node, "leader"))):
                continue
            node = self._verifiable(entry.node)
            if node is None:
                continue
            try:
                challenge = open_plan_entry(entry, self.me, self.keys.x25519, *self.earlier_x25519)
            except SealedPromptError as exc:
                log.error("planned challenge of %s does not open: %s; saying so", entry.node.hex()[:16], exc)
                self.unopened.add((number, entry.node))
                continue
            if reason := self.references[node.model_id].unanswerable(challenge):
                log.error("planned challenge of %s cannot be answered as sealed: %s; saying so",
                          entry.node.hex()[:16], reason)
                self.unopened.add((number, entry.node))
                continue
            self._ask((number, entry.node, "leader"), challenge, node)

    def _verifiable(self, key: bytes) -> ModelNode | None:
        """The registered node, if this member has a reference model for its model."""
        node = self.ledger.node(key)
        if node is None or node.model_id not in self.references:
            log.error("cannot verify node %s: no reference model for %r", key.hex()[:16],
                      node.model_id if node else None)
            return None
        return node

    def _verdict(self, node: ModelNode | None, response: SignedResponse, prompt: str,
                 signer: bytes | None = None) -> Verdict | None:
        """The answer checked and scored with `node`'s reference model, as signed by `signer` (by default
        the node's key; a node that rotated since it was asked signed with the key it had)."""
        if node is None or node.model_id not in self.references:
            return None
        return self.references[node.model_id].verify([Answer(response, prompt, signer or node.pubkey)])[0]

    def _score(self, verdict: Verdict) -> tuple[int, int]:
        """The credibility and count of deviating tokens this member stands behind: a response the node
        signed but that cannot be scored (empty, not the detokenisation of its ids, beyond the
        vocabulary) is worth nothing. The paper's 1/PPL counts no deviations."""
        self.status["scored"] += 1
        if not verdict.ok:
            return 0, 0
        value = verdict.calibrated_ppm if self.calibrated else verdict.credibility_ppm
        return (value if value is not None else 0), (verdict.deviations if self.calibrated else 0)

    def _entry(self, number: int, asked: Asked, kind: str,
               named: bytes | None = None) -> Revealed | Unanswered:
        """A submit-results entry: the revealed challenge, or an invalid claim when there is no answer
        the node can be held to (a re-challenger's names its challenge, which opens its tag). It names
        the node by `named`, its key in the plan now (`_follow_rotations`; by default the key it was asked
        under), and the answer must be signed with the key it was asked under."""
        named = named or asked.node
        commitment = asked.challenge.commitment if kind == "rechallenge" else None
        if asked.reply is None:
            log.warning("node %s gave no answer in epoch %d: %s", named.hex()[:16], number, asked.failure)
            return Unanswered(named, _reason(asked.failure), commitment)
        node = self.ledger.node(named)
        response = asked.reply.response
        verdict = self._verdict(node, response, asked.challenge.prompt, asked.node)
        if verdict is not None and not verdict.ok and not verdict.rejection.node_fault:
            log.warning("node %s's answer in epoch %d is not its own: %s", named.hex()[:16], number,
                        verdict.detail)
            return Unanswered(named, _reason(f"{verdict.rejection.value}: {verdict.detail}"), commitment)
        entry = replace(asked.challenge.reveal(response, asked.reply.served), node=named)
        if verdict is not None:
            self.scores[number, named, self.me] = self._score(verdict)
            if kind == "leader":
                entry = replace(entry, credibility=self.scores[number, named, self.me][0])
        return entry

    def _rechallenge(self, number: int, leader: bytes | None, schedule: Schedule, tags_per_tx: int) -> None:
        """Challenge, with a prompt of our own, each planned node the leader left without a valid result
        of the node's own (none, or one a peer computed, which shows the peer's model, not the node's)
        once the results window has closed, and a secret share of the nodes whatever the leader's result,
        each from its secret offset into the epoch (`_sampled`, `_sample_offset`), which may lie in the
        closing windows of the epoch before (its `leader` then not yet known: None): each is scheduled,
        and sent once its block has come (`send_scheduled`). Every challenge's tag was committed once the
        plan was (`_commit_tags`); only where some part of them was not is a challenge's own tag looked up
        before it is scheduled."""
        if self.me == leader:
            return
        plan = self.ledger.plan(number)[1]
        self._commit_tags(number, plan, tags_per_tx)
        upcoming = self._next_height()  # not the tick's: its transactions may have taken blocks since
        last, cutoff = last_rechallenge(schedule, number), rechallenge_cutoff(schedule, number)
        if upcoming >= cutoff:
            return
        results = self.ledger.results(number)
        answered = {r.node for r in results
                    if r.submitter == leader and r.status == VALID and not r.served_by}
        mine = {r.node for r in results if r.submitter == self.me}
        after_results = upcoming >= schedule.start(number) + schedule.results_blocks
        for entry in plan:
            key = (entry.node, "rechallenge")
            planned_as = entry.moved_from or entry.node  # the coin and offset drawn before a rotation stand
            needed = after_results and entry.node not in answered
            sampled = self._sampled(number, planned_as)
            if (not (needed or sampled) or entry.node in mine or (number, *key) in self.pending
                    or ((number, entry.node) in self.scheduled and not needed) or not self._due(number, key)):
                continue
            node = self._verifiable(entry.node)
            journalled = self._journalled(number, entry.node_keys)
            if node is None or journalled is None or (number not in self.tagged and self.ledger.rechallenge(
                    number, self.me, journalled[1].tag(journalled[0])) is None):
                continue
            challenge = journalled[1]
            start = upcoming if needed else schedule.start(number) + self._sample_offset(
                number, planned_as, schedule)
            self.scheduled[number, entry.node] = Scheduled(start, last, cutoff, challenge, node)
        self.send_scheduled(upcoming)

    def send_scheduled(self, upcoming: int) -> None:
        """Send each scheduled re-challenge whose block has come, `upcoming` being the next block: called at
        the start of a re-challenge round and after each of this member's transactions, so that a tick
        whose transactions take blocks does not pass over an offset. One whose cutoff has come is dropped
        unsent; one sent after `last_rechallenge` is `late`."""
        for (number, key), item in sorted(self.scheduled.items()):
            started = upcoming > self.starts.get(number, upcoming)
            if item.height > upcoming or (started and number not in self.followed):
                continue  # not yet due, or its epoch has started and may have moved the node to a new key
            del self.scheduled[number, key]
            if upcoming >= item.cutoff or (number, key, "rechallenge") in self.pending:
                continue
            self._ask((number, key, "rechallenge"), item.challenge, item.node)
            if upcoming > item.last:
                self.late.add((number, key))

    def _commit_tags(self, number: int, plan: list[PlanEntry], tags_per_tx: int) -> None:
        """A challenge of every planned node this member can verify, journalled, its tag committed with
        the others as soon as the plan is (in the closing windows of the epoch before), whether or not it
        will be sent: so neither when a member commits nor how many tags it commits tells a node that it
        is about to be asked (a node watching the ledger would otherwise answer honestly just after each
        commit, and cheaply the rest of the epoch)."""
        if number in self.tagged or not self._due(number, "tags"):
            return
        unjournalled: dict[str, list[bytes]] = {}
        for entry in plan:
            node = self._verifiable(entry.node)
            if node is not None and self._journalled(number, entry.node_keys) is None:
                unjournalled.setdefault(node.model_id, []).append(entry.node)
        for model_id, nodes in unjournalled.items():
            for node_key, challenge in zip(nodes, self._fresh(model_id, len(nodes)), strict=True):
                self.journal.add(number, node_key, challenge)
        committed = {r.tag for r in self.ledger.rechallenges(number, self.me)}
        # a node that rotated at the epoch's start keeps the tag over the key it was planned under
        untagged = [tag for entry in plan
                    if (journalled := self._journalled(number, entry.node_keys)) is not None
                    and (tag := journalled[1].tag(journalled[0])) not in committed]
        for i in range(0, len(untagged), tags_per_tx):
            part = CommitRechallenge(number, tuple(untagged[i:i + tags_per_tx]))
            if not self._submit(part, number, ["tags"]):
                return
        self.tagged.add(number)

    def _sample_offset(self, number: int, node: bytes, schedule: Schedule) -> int:
        """The offset into epoch `number` from which this member sends its sampled re-challenge of `node`:
        keyed by this member's secret, spread from the first block one can be sent (`first_rechallenge`,
        in the epoch before: a negative offset) to the last (`last_rechallenge`). So a node cannot tell a
        sampled re-challenge from the leader's challenge by when it comes: one told its challenge by a
        colluding leader, honest on it and cheating on the rest, meets re-challenges inside the results
        window and after it alike; and the epoch before's closing windows, which its own re-challenges
        reach only in part, see this epoch's (leaving none free where those windows are at least
        `AHEAD_BLOCKS + GIVE_UP_BLOCKS + ATTEST_BLOCKS` long, as the localnet's and the defaults' 14)."""
        low = first_rechallenge(schedule, number) - schedule.start(number)
        high = max(low, last_rechallenge(schedule, number) - schedule.start(number))
        digest = hashlib.blake2b(b"when" + number.to_bytes(8, "big") + node, key=bytes(self.keys.x25519),
                                 digest_size=8).digest()
        return low + int.from_bytes(digest, "big") % (high - low + 1)

    def _sampled(self, number: int, node: bytes) -> bool:
        """Whether this member challenges `node` again in epoch `number` although the leader got its
        answer: a coin of the epoch's share (`_share`) keyed by this member's secret, so no node can tell
        which of its requests are re-challenges, and a restarted daemon draws the same."""
        digest = hashlib.blake2b(number.to_bytes(8, "big") + node, key=bytes(self.keys.x25519),
                                 digest_size=8).digest()
        return int.from_bytes(digest, "big") < self._share(number) * 2**64

    def _share(self, number: int) -> float:
        """`rechallenge_share`, raised where the committee is too small for it to see a silent node
        reported by more than a third of the power in all but `silent_escape` of epochs. Kept as it is
        (`KEEP_SHARE`), it needs no reading of the committee."""
        if self.silent_escape >= KEEP_SHARE:
            return self.rechallenge_share
        if number not in self.shares:
            powers = [m.power for m in self.ledger.committee()[1]]
            self.shares[number] = rechallenge_share(powers, self.rechallenge_share, self.silent_escape)
        return self.shares[number]

    # -- attestations ----------------------------------------------------------------------------

    def _attest(self, number: int, limit: int) -> None:
        """Score every valid result not yet attested, in as few transactions of at most `limit` bytes as
        hold the scores: with every member re-challenging every node, a plan of some fifty-five nodes has more
        results than one transaction holds, and a refused one would cost each of its results."""
        results = [r for r in self.ledger.results(number) if r.status == VALID]
        if not results:
            return
        attested = self.ledger.attestations(number)
        scores = []
        for result in results:
            if (any(member == self.me for member, *_ in attested.get((result.node, result.submitter), []))
                    or not self._due(number, (result.node, result.submitter, "attest"))):
                continue
            score = self._attested_score(number, result)
            if score is not None:
                scores.append((result.node, result.submitter, *score))
        for part in _parts(scores, limit, lambda score: len(codec.pack(list(score)))):
            if part:
                self._submit(Attest(number, tuple(part)), number,
                             [(node, submitter, "attest") for node, submitter, *_ in part])

    def _attested_score(self, number: int, result: ChallengeResult) -> tuple[int, int] | None:
        key = (number, result.node, result.submitter)
        if key not in self.scores:
            node = self.ledger.node(result.node)
            response = SignedResponse.from_record(result.response)
            # signed with the key the node had when it answered: its own, or the one it rotated from
            signer = response.node if response.node in self._node_keys(number, result.node) else result.node
            verdict = self._verdict(node, response, result.prompt, signer)
            if verdict is None:
                log.error("cannot attest node %s: no reference model for its model", result.node.hex()[:16])
                return None
            self.scores[key] = self._score(verdict)
        return self.scores[key]

    # -- status ----------------------------------------------------------------------------------

    def _write_status(self) -> None:
        self.status.update(pending=len(self.pending), updated=int(time.time()))
        temporary = self.status_file.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.status, indent=2, sort_keys=True) + "\n")
        temporary.replace(self.status_file)


def rechallenge_cutoff(schedule: Schedule, number: int) -> int:
    """The block from which a member claims each of its re-challenges of epoch `number` still out as
    unanswered (it sends none from this block on, and does not claim those it sent after
    `last_rechallenge`, `Daemon.late`): the one before the epoch's last blocks, where a
    revealed result need not be attested (`Schedule.attest_before`), so that every answer it reveals must
    be attested by every member. A node holding its answers back until those blocks would otherwise have
    them revealed where a colluding member could leave them unattested without a fault; instead they are
    reported."""
    return schedule.attest_before(number) - 1


def leader_start(schedule: Schedule, number: int) -> int:
    """The first block the leader of epoch `number` sends its challenges in: `SETTLE_BLOCKS` into the
    epoch, at most half its results window."""
    return schedule.start(number) + min(SETTLE_BLOCKS, schedule.results_blocks // 2)


def first_rechallenge(schedule: Schedule, number: int) -> int:
    """The first block a member sends a sampled re-challenge of epoch `number` in: `AHEAD_BLOCKS` after
    the setup height of the epoch before, in its closing windows, which that epoch's own re-challenges
    reach only up to its `last_rechallenge`; their answers are revealed once `number` starts."""
    return schedule.setup_height(number - 1) + AHEAD_BLOCKS


def last_rechallenge(schedule: Schedule, number: int) -> int:
    """The last block a member's secret offsets place a re-challenge of epoch `number` in: `GIVE_UP_BLOCKS`
    before `rechallenge_cutoff`, so its answer has time to come back before it would be claimed."""
    return rechallenge_cutoff(schedule, number) - GIVE_UP_BLOCKS


def _reason(text: str) -> str:
    """A reason as the ledger takes it: one line of at most 256 printable characters, never empty. It
    quotes what the node sent (an error's message), which must not get the claim refused, and with it
    every entry batched beside it."""
    return fields.one_line(text, 256) or "no answer"


def _revealable(entry: Revealed | Unanswered, kind: str, limit: int) -> Revealed | Unanswered:
    """The entry, or a claim of no valid response where it takes more than the `limit` bytes a part
    holds: the transaction carrying it would be refused (the member would lose the result, a leader its
    plan's coverage). A challenge asks for at most `challenge.MAX_CHALLENGE_TOKENS` tokens, for a prompt the
    ledger bounds, which fit, so only a node that ignored that, or padded its text, gives such an answer."""
    if isinstance(entry, Unanswered) or (size := _body_size(entry)) <= limit:
        return entry
    log.warning("node %s's answer makes a result of %d bytes, too many to reveal: claimed as none",
                entry.node.hex()[:16], size)
    commitment = (epochs.commitment(entry.prompt, entry.temperature, entry.salt, entry.top_p)
                  if kind == "rechallenge" else None)
    return Unanswered(entry.node, f"an answer whose result takes {size} bytes, more than a transaction "
                                  "carries", commitment)


def _body_size(entry: Body) -> int:
    return len(codec.pack(entry.body()))


def _parts(entries: list[Entry], limit: int, size: Callable[[Entry], int] = _body_size) -> list[list[Entry]]:
    """Plan, result or score entries in consecutive parts of at most `limit` bytes by `size` (an entry
    larger than that alone in its part) and at most `MAX_ENTRIES` entries, as a transaction's list holds;
    at least one (maybe empty) part, so that the last one of a plan, marked final, always exists."""
    parts: list[list[Entry]] = [[]]
    used = 0
    for entry in entries:
        length = size(entry)
        if parts[-1] and (used + length > limit or len(parts[-1]) == MAX_ENTRIES):
            parts.append([])
            used = 0
        parts[-1].append(entry)
        used += length
    return parts


def collector(daemon: Daemon) -> StatusCollector:
    """The daemon's Prometheus metrics (docs/operators.md, "Monitoring")."""
    st = daemon.status

    def counters() -> dict[str, tuple[float, str]]:
        return {"ticks": (st["ticks"], "Passes over the ledger"),
                "challenges": (st["challenges"], "Challenges sent through the overlay"),
                "scored": (st["scored"], "Answers scored with the reference model"),
                "submissions": (st["submitted"], "Transactions the chain accepted"),
                "rejected_submissions": (st["rejected"], "Transactions the chain refused")}

    def gauges() -> dict[str, tuple[float, str]]:
        return {"height": (st.get("height", 0), "The last verified height"),
                "epoch": (st.get("epoch", 0), "The epoch of the next block"),
                "leader": (1 if st.get("leader") else 0, "1 while this member leads the epoch"),
                "pending_challenges": (len(daemon.pending), "Challenges awaiting their answers"),
                "failing": (1 if st.get("last_error") else 0, "1 while the last pass failed")}

    return StatusCollector("planetserve_verifier", counters, gauges)
