"""Transaction handlers of the epoch family: VRF proofs, challenge plans, results, attestations,
invalid-response reports and re-challenges (docs/architecture.md, "Verification epochs").

A submission that is well formed but contradicts the plan or a node's signature is evidence, not an
error: it is stored as a faulty result and its submitter is recorded faulty."""

from __future__ import annotations

from dataclasses import replace

from planetserve.chain import vrf
from planetserve.chain.abci.handlers.context import Context
from planetserve.chain.keys import verify_signature
from planetserve.chain.messages.epochs import (
    Attest,
    CommitPlan,
    CommitRechallenge,
    ReportInvalid,
    Revealed,
    SubmitResults,
    SubmitVrf,
    Unanswered,
)
from planetserve.registry import epochs
from planetserve.registry.epochs import (
    FAULTY,
    INVALID,
    NO_PLAN,
    PLAN_COMMITTED,
    PLAN_PARTIAL,
    UNOPENED,
    VALID,
    ChallengeResult,
    Epoch,
    Fault,
    PlanEntry,
    Rechallenge,
    Schedule,
    SignedResponse,
    VrfEntry,
)
from planetserve.registry.errors import AlreadyExists, Expired, InvalidField, Unauthorized, UnknownEntity


def _schedule(ctx: Context) -> Schedule:
    return Schedule.from_params(ctx.params)


def _current(ctx: Context) -> tuple[int, Epoch]:
    number = _schedule(ctx).epoch_of(ctx.height)
    epoch = ctx.state.epoch(number)
    if epoch is None:  # created by the block hooks before any transaction can run
        raise UnknownEntity(f"epoch {number} has no record")
    return number, epoch


def _expect_epoch(got: int, expected: int) -> None:
    if got != expected:
        raise Expired(f"epoch {got} is not open for this transaction; it is for epoch {expected} now")


def _fault(ctx: Context, epoch: int, kind: str, node: bytes, detail: str) -> None:
    ctx.state.add_fault(Fault(ctx.signer, epoch, kind, node, detail))
    ctx.emit("fault", operator=ctx.signer.hex(), epoch=str(epoch), fault=kind, node=node.hex())


# -- leader election ----------------------------------------------------------------------------


def submit_vrf(ctx: Context, msg: SubmitVrf) -> None:
    member = ctx.require_member()
    current, _ = _current(ctx)
    _expect_epoch(msg.epoch, current + 1)
    if not _schedule(ctx).in_vrf_window(ctx.height):
        raise Expired(f"the VRF window of epoch {current} is not open at height {ctx.height}")
    target = ctx.state.epoch(current + 1)
    if target is None:
        raise UnknownEntity(f"epoch {current + 1} has no seed yet")
    if ctx.state.vrf_entry(target.number, ctx.signer) is not None:
        raise AlreadyExists(f"signer already submitted a VRF proof for epoch {target.number}")
    try:
        output = vrf.verify(member.vrf_key, msg.proof, target.seed)
    except vrf.VrfError as exc:
        raise InvalidField("proof", f"{exc} (member's VRF key, epoch {target.number}'s seed)") from exc
    ctx.state.put_vrf_entry(target.number, VrfEntry(ctx.signer, msg.proof, output))
    if not target.leader_output or (output, ctx.signer) < (target.leader_output, target.leader):
        ctx.state.put_epoch(replace(target, leader=ctx.signer, leader_output=output, election="vrf"))
    ctx.emit("submit_vrf", epoch=str(target.number), operator=ctx.signer.hex())


# -- challenge plan -----------------------------------------------------------------------------


def _sealed(sealed: tuple[tuple[bytes, bytes], ...], committee: list[bytes]) -> tuple[list, ...]:
    if len(sealed) != len(committee):
        raise InvalidField("sealed", "must hold one sealed box per committee member")
    if sorted(member for member, _ in sealed) != committee:
        raise InvalidField("sealed", "must hold exactly one box for each committee member")
    return tuple(sorted([member, box] for member, box in sealed))


def commit_plan(ctx: Context, msg: CommitPlan) -> None:
    """The leader of epoch e commits, in one or more parts, the challenges of epoch e+1; the part
    marked final is refused unless the plan covers every node it must. In the plan window's last half
    the backup planner may commit too, so that a leader that is down (or will not plan) does not leave
    e+1 unchecked; if the backup completes the plan, the leader gets its `no-plan` fault all the same."""
    ctx.require_member()
    current, _ = _current(ctx)
    _expect_epoch(msg.epoch, current + 1)
    target = ctx.state.epoch(current + 1)
    schedule = _schedule(ctx)
    if target is None or not schedule.in_plan_window(ctx.height):
        raise Expired(f"the plan window of epoch {current} is not open at height {ctx.height}")
    backup = epochs.backup_planner(target.seed, ctx.committee, target.plan_leader)
    if ctx.signer != target.plan_leader and not (ctx.signer == backup
                                                 and schedule.in_backup_plan_window(ctx.height)):
        raise Unauthorized(f"only the leader of epoch {current} commits the plan of epoch {target.number}, "
                           f"and its backup planner in the plan window's last half")
    if target.plan_status == PLAN_COMMITTED:
        raise AlreadyExists(f"the plan of epoch {target.number} is already committed")
    committee = sorted(ctx.committee)
    added = 0
    for entry in msg.entries:
        node, commitment = entry.node, entry.commitment
        if not ctx.state.plan_requires(target.number, node):
            raise InvalidField("node", f"{node.hex()} is not among the nodes this plan must cover")
        if ctx.state.plan_entry(target.number, node) is not None:
            raise AlreadyExists(f"node {node.hex()} is already in the plan")
        if ctx.state.commitment_used(target.number, commitment):
            raise AlreadyExists(f"commitment {commitment.hex()} repeats one of this epoch's")
        sealed = _sealed(entry.sealed, committee)
        ctx.state.put_plan_entry(target.number, PlanEntry(node, commitment, sealed, entry.ciphertext))
        ctx.state.use_commitment(target.number, commitment, node)
        added += 1
    planned = target.plan_nodes + added
    status = PLAN_PARTIAL
    if msg.final:
        required = ctx.state.plan_required_count(target.number)
        if planned != required:  # each entry is a required node, none twice: whole at that count
            raise InvalidField("entries", f"the plan omits {required - planned} of the {required} node(s) "
                                          "it must cover")
        status = PLAN_COMMITTED
        if ctx.signer != target.plan_leader:
            ctx.state.add_fault(Fault(target.plan_leader, current, NO_PLAN, b"", f"did not commit the plan "
                                      f"of epoch {target.number}; its backup planner did"))
    ctx.state.put_epoch(replace(target, plan_status=status, plan_nodes=planned))
    ctx.emit("commit_plan", epoch=str(target.number), entries=str(added), status=status)


# -- results ------------------------------------------------------------------------------------


def _inconsistency(ctx: Context, node_model: str, entry: Revealed, commitment: bytes,
                   since: int, signers: tuple[bytes, ...]) -> tuple[str, str] | None:
    """Why a submitted challenge contradicts the plan or the node's signature, if it does. `signers`:
    the node's keys for this epoch (`PlanEntry.node_keys`), the key it rotated away from at the epoch's
    start too, which its answers to challenges sent before then are signed with."""
    slack = ctx.params.response_slack_seconds
    prompt, temperature, salt, response = entry.prompt, entry.temperature, entry.salt, entry.response
    if epochs.commitment(prompt, temperature, salt, entry.top_p) != commitment:
        return "altered-prompt", ("revealed prompt, temperature, salt and top_p do not match the committed "
                                  "challenge")
    if temperature > epochs.MAX_CHALLENGE_TEMPERATURE:
        return "altered-prompt", (f"challenge temperature {temperature} is above "
                                  f"{epochs.MAX_CHALLENGE_TEMPERATURE} thousandths, where no answer scores "
                                  f"fairly")
    if response.node not in signers or not verify_signature(response.node, response.sign_bytes(),
                                                            response.signature):
        return "altered-response", "response is not signed by the challenged node"
    if response.prompt_hash != epochs.prompt_hash(prompt):
        return "altered-prompt", "the node answered a different prompt than the committed one"
    if response.temperature != temperature:
        return "altered-prompt", (f"the node was asked for temperature {response.temperature}, "
                                  f"not the committed {temperature} (thousandths)")
    if response.seed != (committed := epochs.challenge_seed(salt)):
        return "altered-prompt", f"the node was asked for seed {response.seed}, not the committed {committed}"
    if response.top_p != entry.top_p:
        return "altered-prompt", (f"the node was asked for top_p {response.top_p}, not the committed "
                                  f"{entry.top_p} (thousandths)")
    if not since - slack <= response.time <= ctx.time + slack:
        window = f"[{since - slack}, {ctx.time + slack}]"
        return "stale-response", f"response time {response.time} is outside {window}"
    if response.model_id != node_model:
        return "", f"node answered as model {response.model_id!r}, registered for {node_model!r}"
    return None


def _forged_serving(served: SignedResponse) -> tuple[str, str] | None:
    """A serving peer's signature that does not verify: a member checks it before it reveals, so only a
    submitter that altered it reveals one."""
    if not verify_signature(served.node, served.sign_bytes(), served.signature):
        return "altered-response", "the serving node's signature does not verify"
    return None


def _uncredited(ctx: Context, node_model: str, node: bytes) -> str:
    """Why the serving peer `node` is not credited with an answer it computed, or "" if it is. Only a
    node of the challenged node's model on the verified node list (active, trusted, past probation) may
    be forwarded to, or one that left the list no more than the response slack before this reveal. A
    member reveals an answer as soon as it has it (the next epoch's re-challenges, sent in an epoch's
    closing windows, once that epoch starts, just after the finalization that may delist their serving
    peers), and an honest node forwards on a view of the list a few seconds old: such a peer was listed,
    or only just delisted, when it was forwarded to. Without the slack the honest node would answer for
    its peer's model. What a member cannot check before it reveals (whether a key the challenged node
    names is registered for the model; a peer that changes its model or key between the answer and the
    reveal) is not the member's fault: the challenged node answers for the answer."""
    peer = ctx.state.node(node)
    if peer is None or peer.model_id != node_model:
        return "the serving node is not a registered node of the challenged node's model: not credited"
    if ctx.state.listed(peer):
        return ""
    delisted = ctx.state.delisted_at(node)
    if delisted is not None and ctx.time <= delisted + ctx.params.response_slack_seconds:
        return ""
    return "the serving node is not listed (inactive, untrusted or on probation): not credited"


def _moved(ctx: Context, node: bytes) -> str:
    """For a refusal naming a key its node rotated away from: the key to name instead."""
    rotation = ctx.state.retired(node)
    if rotation is None or rotation.old != node or rotation.height > ctx.height:
        return ""
    return f"; it was rotated to {rotation.new.hex()} at height {rotation.height}: name that key"


def submit_results(ctx: Context, msg: SubmitResults) -> None:
    ctx.require_member()
    number, epoch = _current(ctx)
    _expect_epoch(msg.epoch, number)
    kind = msg.kind
    if kind == "leader":
        if ctx.signer != epoch.leader:
            raise Unauthorized(f"only the leader of epoch {number} submits its results")
        if epoch.plan_status != PLAN_COMMITTED:
            raise UnknownEntity(f"epoch {number} has no committed plan")
        if not _schedule(ctx).in_results(ctx.height):
            raise Expired(f"the results of epoch {number} were due before offset {ctx.params.results_blocks}")
    for entry in msg.results:
        _submit_one(ctx, epoch, kind, entry)
    ctx.emit("submit_results", epoch=str(number), result_kind=kind)


def _submit_one(ctx: Context, epoch: Epoch, kind: str, entry: Revealed | Unanswered) -> None:
    node = entry.node
    plan = ctx.state.plan_entry(epoch.number, node)
    if plan is None or epoch.plan_status != PLAN_COMMITTED:
        raise UnknownEntity(f"node {node.hex()} is not in the plan of epoch {epoch.number}"
                            f"{_moved(ctx, node)}")
    if ctx.state.result(epoch.number, node, ctx.signer) is not None:
        raise AlreadyExists(f"signer already submitted a result for node {node.hex()}")
    signers = plan.node_keys
    if isinstance(entry, Revealed) and entry.served is not None and entry.served.node in signers:
        raise InvalidField("served", "names the challenged node itself; omit it for a direct answer")
    if kind == "leader":
        commitment, since = plan.commitment, epoch.start_time
    else:
        commitment, since = _opened_rechallenge(ctx, epoch.number, entry, signers)
    registered = ctx.state.node(node)
    model_id = registered.model_id if registered is not None else ""
    if isinstance(entry, Unanswered):
        result = ChallengeResult(node, ctx.signer, kind, INVALID, entry.invalid, "", b"", {}, -1, ctx.height)
    else:
        response = entry.response
        credibility = entry.credibility if entry.credibility is not None else -1
        served = entry.served.response(response) if entry.served is not None else None
        problem = _inconsistency(ctx, model_id, entry, commitment, since, signers)
        if problem is None and served is not None:
            problem = _forged_serving(served)
        status, reason = VALID, ""
        if problem is None and served is not None and (reason := _uncredited(ctx, model_id, served.node)):
            served = None
        if problem is not None:
            fault_kind, reason = problem
            status = FAULTY if fault_kind else INVALID
            if fault_kind:
                _fault(ctx, epoch.number, fault_kind, node, reason)
        result = ChallengeResult(node, ctx.signer, kind, status, reason, entry.prompt, entry.salt,
                                 response.to_record(), credibility, ctx.height,
                                 served.node if served is not None else b"")
    ctx.state.put_result(epoch.number, result)
    if result.status == INVALID and not (kind == "leader" and result.reason == UNOPENED):
        _add_report(ctx, epoch.number, node)


# -- attestations, reports, re-challenges -------------------------------------------------------


def attest(ctx: Context, msg: Attest) -> None:
    ctx.require_member()
    number, _ = _current(ctx)
    _expect_epoch(msg.epoch, number)
    for node, submitter, credibility, deviations in msg.scores:
        result = ctx.state.result(number, node, submitter)
        if result is None or result.status != VALID:
            raise UnknownEntity(
                f"no valid result of node {node.hex()} by {submitter.hex()} in epoch {number}")
        if deviations > (tokens := len(result.response.get("token_ids", ()))):
            raise InvalidField("deviations", f"{deviations} deviating tokens in an answer of {tokens}")
        scores = ctx.state.attestations(number, node, submitter)
        if any(m == ctx.signer for m, *_ in scores):
            raise AlreadyExists(f"signer already attested node {node.hex()}'s result by {submitter.hex()}")
        ctx.state.put_attestations(number, node, submitter, [*scores, [ctx.signer, credibility, deviations]])
    ctx.emit("attest", epoch=str(number), operator=ctx.signer.hex())


def _add_report(ctx: Context, epoch: int, node: bytes) -> None:
    reporters = ctx.state.reports(epoch, node)
    if ctx.signer in reporters:
        raise AlreadyExists(f"signer already reported node {node.hex()}")
    ctx.state.put_reports(epoch, node, [*reporters, ctx.signer])


def _planned_node(ctx: Context, epoch: int, node: bytes) -> int:
    """The current epoch, which must be `epoch`, where a member may act on `node` only if it is planned."""
    ctx.require_member()
    number, _ = _current(ctx)
    _expect_epoch(epoch, number)
    if ctx.state.plan_entry(number, node) is None:
        raise UnknownEntity(f"node {node.hex()} is not in the plan of epoch {number}")
    return number


def report_invalid(ctx: Context, msg: ReportInvalid) -> None:
    number = _planned_node(ctx, msg.epoch, msg.node)
    _add_report(ctx, number, msg.node)
    ctx.emit("report_invalid", epoch=str(number), node=msg.node.hex())


def commit_rechallenge(ctx: Context, msg: CommitRechallenge) -> None:
    """Tags, not nodes: which node is asked again stays hidden until the answer is revealed. A member
    commits at most as many re-challenges in an epoch as it plans nodes. The next epoch's are taken as
    soon as its plan is committed, so that members re-challenge its nodes through this epoch's closing
    windows, which would otherwise be free of challenges, and reveal the answers once it starts."""
    ctx.require_member()
    current, _ = _current(ctx)
    number = msg.epoch
    if number not in (current, current + 1):
        raise Expired(f"re-challenges are committed for epoch {current}, or for epoch {current + 1} once its "
                      f"plan is committed; not for epoch {number}")
    epoch = ctx.state.epoch(number)
    if epoch is None or epoch.plan_status != PLAN_COMMITTED:
        raise UnknownEntity(f"epoch {number} has no committed plan")
    for tag in msg.tags:
        if ctx.state.rechallenge(number, ctx.signer, tag) is not None:
            raise AlreadyExists(f"signer already committed re-challenge {tag.hex()} in epoch {number}")
    if ctx.state.rechallenges_committed(number, ctx.signer) + len(msg.tags) > epoch.plan_nodes:
        raise Unauthorized(f"signer would commit more re-challenges than epoch {number} plans nodes "
                           f"({epoch.plan_nodes})")
    for tag in msg.tags:
        ctx.state.put_rechallenge(number, Rechallenge(ctx.signer, tag, ctx.time, ctx.height))
    ctx.emit("commit_rechallenge", epoch=str(number), tags=str(len(msg.tags)))


def _opened_rechallenge(ctx: Context, number: int, entry: Revealed | Unanswered,
                        signers: tuple[bytes, ...]) -> tuple[bytes, int]:
    """The commitment of the signer's re-challenge of `entry.node` and when it was committed: the entry
    opens one of the signer's tags, whose commitment no other challenge of the epoch used. The tag names
    one of the node's keys of the epoch (`signers`): a node that rotated at the epoch's start was tagged
    under its old key in the epoch before, and would otherwise escape every member's re-challenge."""
    if isinstance(entry, Revealed):
        commitment = epochs.commitment(entry.prompt, entry.temperature, entry.salt, entry.top_p)
    elif entry.commitment is not None:
        commitment = entry.commitment
    else:
        raise InvalidField("commitment", "a re-challenge claimed unanswered names its challenge's commitment")
    rech = None
    for key in signers:
        rech = ctx.state.rechallenge(number, ctx.signer, epochs.rechallenge_tag(key, commitment))
        if rech is not None:
            break
    if rech is None:
        raise UnknownEntity(f"signer committed no re-challenge of node {entry.node.hex()} with this "
                            "challenge")
    if rech.height >= ctx.height:  # a proposer could commit another's revealed challenge and open it first
        raise InvalidField("commitment", "opens a tag committed in this block; a tag opens from the next")
    if ctx.state.commitment_used(number, commitment):
        raise AlreadyExists(f"commitment {commitment.hex()} repeats one of this epoch's")
    ctx.state.use_commitment(number, commitment, entry.node)
    return commitment, rech.time


HANDLERS = {
    SubmitVrf: submit_vrf,
    CommitPlan: commit_plan,
    SubmitResults: submit_results,
    Attest: attest,
    ReportInvalid: report_invalid,
    CommitRechallenge: commit_rechallenge,
}
