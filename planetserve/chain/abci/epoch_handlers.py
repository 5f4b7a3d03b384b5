"""Transaction handlers of the epoch family: VRF proofs, challenge plans, results, attestations,
invalid-response reports and re-challenges (docs/architecture.md, "Verification epochs").

A submission that is well formed but contradicts the plan or a node's signature is evidence, not an
error: it is stored as a faulty result and its submitter is recorded faulty."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from planetserve.chain import vrf
from planetserve.chain.abci.handlers import Context
from planetserve.chain.keys import verify_signature
from planetserve.registry import credits, epochs, fields
from planetserve.registry.epochs import (
    FAULTY,
    INVALID,
    PLAN_COMMITTED,
    PLAN_PARTIAL,
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
from planetserve.registry.reputation import PPM

MAX_SEALED_BYTES = 8_192
MAX_PROMPT_CHARS = 4_096
MAX_TEMPERATURE = 2 * epochs.MILLI
"""The hottest request a node may sign (the API's limit); challenges are held to 1.0."""
MAX_RESPONSE_TOKENS = 4_096
MAX_RESPONSE_CHARS = 32_768
MAX_ENTRIES = 1_000


def _schedule(ctx: Context) -> Schedule:
    return Schedule.from_params(ctx.params)


def _current(ctx: Context) -> tuple[int, Epoch]:
    number = _schedule(ctx).epoch_of(ctx.height)
    epoch = ctx.state.epoch(number)
    if epoch is None:  # created by the block hooks before any transaction can run
        raise UnknownEntity(f"epoch {number} has no record")
    return number, epoch


def _epoch_field(body: dict[str, Any], expected: int) -> None:
    got = fields.integer(body, "epoch", 0, 2**62)
    if got != expected:
        raise Expired(f"epoch {got} is not open for this transaction; it is for epoch {expected} now")


def _entries(body: dict[str, Any], name: str) -> list[Any]:
    value = body.get(name)
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_ENTRIES:
        raise InvalidField(name, f"must be a list of 1..{MAX_ENTRIES} entries")
    return value


def _map(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidField(name, "must be a map")
    return value


def _fault(ctx: Context, epoch: int, kind: str, node: bytes, detail: str) -> None:
    ctx.state.add_fault(Fault(ctx.signer, epoch, kind, node, detail))
    record = ctx.state.epoch(epoch)
    if record is not None:
        ctx.state.put_epoch(replace(record, faults=record.faults + 1))
    ctx.emit("fault", operator=ctx.signer.hex(), epoch=str(epoch), fault=kind, node=node.hex())


# -- leader election ----------------------------------------------------------------------------


def submit_vrf(ctx: Context, body: dict[str, Any]) -> None:
    """A member's VRF proof over the next epoch's seed; the lowest output leads that epoch."""
    fields.check_keys(body, {"epoch", "proof"})
    member = ctx.require_member()
    current, _ = _current(ctx)
    _epoch_field(body, current + 1)
    if not _schedule(ctx).in_vrf_window(ctx.height):
        raise Expired(f"the VRF window of epoch {current} is not open at height {ctx.height}")
    target = ctx.state.epoch(current + 1)
    if target is None:
        raise UnknownEntity(f"epoch {current + 1} has no seed yet")
    if ctx.state.vrf_entry(target.number, ctx.signer) is not None:
        raise AlreadyExists(f"signer already submitted a VRF proof for epoch {target.number}")
    proof = body.get("proof")
    if not isinstance(proof, bytes):
        raise InvalidField("proof", "must be bytes")
    try:
        output = vrf.verify(member.vrf_key, proof, target.seed)
    except vrf.VrfError as exc:
        raise InvalidField("proof", f"{exc} (member's VRF key, epoch {target.number}'s seed)") from exc
    ctx.state.put_vrf_entry(target.number, VrfEntry(ctx.signer, proof, output))
    if not target.leader_output or (output, ctx.signer) < (target.leader_output, target.leader):
        ctx.state.put_epoch(replace(target, leader=ctx.signer, leader_output=output, election="vrf"))
    ctx.emit("submit_vrf", epoch=str(target.number), operator=ctx.signer.hex())


# -- challenge plan -----------------------------------------------------------------------------


def required_nodes(ctx: Context, target: Epoch) -> list[bytes]:
    """The nodes the plan of `target` must cover: active at the plan's cutoff, sampled above the cap."""
    followers = {n for later in credits.pipelines(ctx.state.iterate_deployments()).values() for n in later}
    return epochs.plan_nodes(target, ctx.state.iterate_nodes(), ctx.params.max_plan_nodes, followers)


def _sealed(value: Any, committee: list[bytes]) -> tuple[list, ...]:
    if not isinstance(value, list) or len(value) != len(committee):
        raise InvalidField("sealed", "must hold one sealed box per committee member")
    boxes = []
    for item in value:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], bytes)
                or not 48 < len(item[1]) <= MAX_SEALED_BYTES):
            raise InvalidField("sealed", f"entries must be [member, sealed box of 49..{MAX_SEALED_BYTES} B]")
        boxes.append(item)
    if sorted(b[0] for b in boxes) != committee:
        raise InvalidField("sealed", "must hold exactly one box for each committee member")
    return tuple(sorted(boxes))


def commit_plan(ctx: Context, body: dict[str, Any]) -> None:
    """The leader of epoch e commits, in one or more parts, the challenges of epoch e+1; the part
    marked final is refused unless the plan covers every node it must."""
    fields.check_keys(body, {"epoch", "entries", "final"})
    ctx.require_member()
    current, _ = _current(ctx)
    _epoch_field(body, current + 1)
    target = ctx.state.epoch(current + 1)
    if target is None or not _schedule(ctx).in_plan_window(ctx.height):
        raise Expired(f"the plan window of epoch {current} is not open at height {ctx.height}")
    if ctx.signer != target.plan_leader:
        raise Unauthorized(f"only the leader of epoch {current} commits the plan of epoch {target.number}")
    if target.plan_status == PLAN_COMMITTED:
        raise AlreadyExists(f"the plan of epoch {target.number} is already committed")
    final = fields.flag(body, "final")
    raw_entries = body.get("entries")
    if not isinstance(raw_entries, list) or len(raw_entries) > MAX_ENTRIES or not (raw_entries or final):
        raise InvalidField("entries", f"must be a list of at most {MAX_ENTRIES} entries")
    committee = sorted(ctx.committee)
    required = set(required_nodes(ctx, target))
    added = 0
    for raw in raw_entries:
        entry = _map(raw, "entries")
        fields.check_keys(entry, {"node", "commitment", "sealed"})
        node = fields.key32(entry, "node")
        commitment = fields.key32(entry, "commitment")
        if node not in required:
            raise InvalidField("node", f"{node.hex()} is not among the nodes this plan must cover")
        if ctx.state.plan_entry(target.number, node) is not None:
            raise AlreadyExists(f"node {node.hex()} is already in the plan")
        if ctx.state.commitment_used(target.number, commitment):
            raise AlreadyExists(f"commitment {commitment.hex()} repeats one of this epoch's")
        sealed = _sealed(entry.get("sealed"), committee)
        ctx.state.put_plan_entry(target.number, PlanEntry(node, commitment, sealed))
        ctx.state.use_commitment(target.number, commitment, node)
        added += 1
    planned = target.plan_nodes + added
    status = PLAN_PARTIAL
    if final:
        missing = sorted(n for n in required if ctx.state.plan_entry(target.number, n) is None)
        if missing:
            raise InvalidField("entries", f"the plan omits {len(missing)} node(s) it must cover, "
                                          f"first {missing[0].hex()}")
        status = PLAN_COMMITTED
    ctx.state.put_epoch(replace(target, plan_status=status, plan_nodes=planned))
    ctx.emit("commit_plan", epoch=str(target.number), entries=str(added), status=status)


# -- results ------------------------------------------------------------------------------------


def _response(value: Any) -> SignedResponse:
    raw = _map(value, "response")
    fields.check_keys(raw, {"node", "prompt_hash", "token_ids", "text", "model_id", "temperature", "time",
                            "address", "signature"})
    tokens = raw.get("token_ids")
    if (not isinstance(tokens, list) or len(tokens) > MAX_RESPONSE_TOKENS
            or not all(type(t) is int and 0 <= t < 2**32 for t in tokens)):
        raise InvalidField("token_ids", f"must be a list of at most {MAX_RESPONSE_TOKENS} token ids")
    text = raw.get("text")
    if not isinstance(text, str) or len(text) > MAX_RESPONSE_CHARS:
        raise InvalidField("text", f"must be text of at most {MAX_RESPONSE_CHARS} characters")
    return SignedResponse(
        node=fields.key32(raw, "node"),
        prompt_hash=fields.key32(raw, "prompt_hash"),
        token_ids=tuple(tokens),
        text=text,
        model_id=fields.ident(raw, "model_id"),
        temperature=fields.integer(raw, "temperature", 0, MAX_TEMPERATURE),
        time=fields.integer(raw, "time", 0, 2**62),
        address=fields.address(raw),
        signature=fields.sig64(raw, "signature"),
    )


def _inconsistency(ctx: Context, node_model: str, node: bytes, commitment: bytes, prompt: str,
                   temperature: int, salt: bytes, response: SignedResponse,
                   since: int) -> tuple[str, str] | None:
    """Why a submitted challenge contradicts the plan or the node's signature, if it does."""
    slack = ctx.params.response_slack_seconds
    if epochs.commitment(prompt, temperature, salt) != commitment:
        return "altered-prompt", "revealed prompt, temperature and salt do not match the committed challenge"
    if temperature > epochs.MAX_CHALLENGE_TEMPERATURE:
        return "altered-prompt", (f"challenge temperature {temperature} is above "
                                  f"{epochs.MAX_CHALLENGE_TEMPERATURE} thousandths, where no answer scores "
                                  f"fairly")
    if response.node != node or not verify_signature(node, response.sign_bytes(), response.signature):
        return "altered-response", "response is not signed by the challenged node"
    if response.prompt_hash != epochs.prompt_hash(prompt):
        return "altered-prompt", "the node answered a different prompt than the committed one"
    if response.temperature != temperature:
        return "altered-prompt", (f"the node was asked for temperature {response.temperature}, "
                                  f"not the committed {temperature} (thousandths)")
    if not since - slack <= response.time <= ctx.time + slack:
        window = f"[{since - slack}, {ctx.time + slack}]"
        return "stale-response", f"response time {response.time} is outside {window}"
    if response.model_id != node_model:
        return "", f"node answered as model {response.model_id!r}, registered for {node_model!r}"
    return None


def _served(value: Any, response: SignedResponse) -> SignedResponse:
    """The serving peer's signature over the challenged node's response, when it forwarded it."""
    raw = _map(value, "served")
    fields.check_keys(raw, {"node", "time", "address", "signature"})
    served = replace(response, node=fields.key32(raw, "node"), time=fields.integer(raw, "time", 0, 2**62),
                     address=fields.address(raw), signature=fields.sig64(raw, "signature"))
    if served.node == response.node:
        raise InvalidField("served", "names the challenged node itself; omit it for a direct answer")
    return served


def _served_inconsistency(ctx: Context, node_model: str, served: SignedResponse) -> tuple[str, str] | None:
    """Why a claimed serving peer cannot be credited: its signature or its model does not match."""
    if not verify_signature(served.node, served.sign_bytes(), served.signature):
        return "altered-response", "the serving node's signature does not verify"
    peer = ctx.state.node(served.node)
    if peer is None or peer.model_id != node_model:
        return "altered-response", "the serving node is not a registered node of the challenged node's model"
    return None


def submit_results(ctx: Context, body: dict[str, Any]) -> None:
    """The leader's results for the epoch's plan, or a member's results of its own re-challenges."""
    fields.check_keys(body, {"epoch", "kind", "results"})
    ctx.require_member()
    number, epoch = _current(ctx)
    _epoch_field(body, number)
    kind = fields.choice(body, "kind", epochs.RESULT_KINDS)
    if kind == "leader":
        if ctx.signer != epoch.leader:
            raise Unauthorized(f"only the leader of epoch {number} submits its results")
        if epoch.plan_status != PLAN_COMMITTED:
            raise UnknownEntity(f"epoch {number} has no committed plan")
        if not _schedule(ctx).in_results(ctx.height):
            raise Expired(f"the results of epoch {number} were due before offset {ctx.params.results_blocks}")
    for raw in _entries(body, "results"):
        _submit_one(ctx, epoch, kind, _map(raw, "results"))
    ctx.emit("submit_results", epoch=str(number), result_kind=kind)


def _submit_one(ctx: Context, epoch: Epoch, kind: str, entry: dict[str, Any]) -> None:
    node = fields.key32(entry, "node")
    plan = ctx.state.plan_entry(epoch.number, node)
    if plan is None or epoch.plan_status != PLAN_COMMITTED:
        raise UnknownEntity(f"node {node.hex()} is not in the plan of epoch {epoch.number}")
    if ctx.state.result(epoch.number, node, ctx.signer) is not None:
        raise AlreadyExists(f"signer already submitted a result for node {node.hex()}")
    if kind == "leader":
        commitment, since = plan.commitment, epoch.start_time
    else:
        rech = ctx.state.rechallenge(epoch.number, node, ctx.signer)
        if rech is None:
            raise UnknownEntity(f"signer committed no re-challenge of node {node.hex()}")
        commitment, since = rech.commitment, rech.time
    registered = ctx.state.node(node)
    model_id = registered.model_id if registered is not None else ""
    if "invalid" in entry:
        fields.check_keys(entry, {"node", "invalid"})
        reason = fields.text(entry, "invalid", 256)
        result = ChallengeResult(node, ctx.signer, kind, INVALID, reason, "", b"", {}, -1, ctx.height)
    else:
        fields.check_keys(entry, {"node", "prompt", "salt", "temperature", "response"},
                          frozenset({"credibility", "served"}) if kind == "leader" else frozenset({"served"}))
        prompt = fields.free_text(entry, "prompt", MAX_PROMPT_CHARS)
        salt = fields.key32(entry, "salt")
        temperature = fields.integer(entry, "temperature", 0, MAX_TEMPERATURE)
        response = _response(entry.get("response"))
        credibility = fields.integer(entry, "credibility", 0, PPM) if kind == "leader" else -1
        if kind == "leader" and "credibility" not in entry:
            raise InvalidField("credibility", "the leader proposes a credibility per node")
        served = _served(entry["served"], response) if "served" in entry else None
        problem = _inconsistency(ctx, model_id, node, commitment, prompt, temperature, salt, response, since)
        if problem is None and served is not None:
            problem = _served_inconsistency(ctx, model_id, served)
        status, reason = VALID, ""
        if problem is not None:
            fault_kind, reason = problem
            status = FAULTY if fault_kind else INVALID
            if fault_kind:
                _fault(ctx, epoch.number, fault_kind, node, reason)
        result = ChallengeResult(node, ctx.signer, kind, status, reason, prompt, salt, response.to_record(),
                                 credibility, ctx.height, served.node if served is not None else b"")
    ctx.state.put_result(epoch.number, result)
    if result.status == INVALID:
        _add_report(ctx, epoch.number, node)


# -- attestations, reports, re-challenges -------------------------------------------------------


def attest(ctx: Context, body: dict[str, Any]) -> None:
    """A member's own credibility for submitted results: [[node, submitter, credibility ppm], ...]."""
    fields.check_keys(body, {"epoch", "scores"})
    ctx.require_member()
    number, _ = _current(ctx)
    _epoch_field(body, number)
    for raw in _entries(body, "scores"):
        if not isinstance(raw, list) or len(raw) != 3:
            raise InvalidField("scores", "entries must be [node, submitter, credibility]")
        item = {"node": raw[0], "submitter": raw[1], "credibility": raw[2]}
        node, submitter = fields.key32(item, "node"), fields.key32(item, "submitter")
        credibility = fields.integer(item, "credibility", 0, PPM)
        result = ctx.state.result(number, node, submitter)
        if result is None or result.status != VALID:
            raise UnknownEntity(
                f"no valid result of node {node.hex()} by {submitter.hex()} in epoch {number}")
        scores = ctx.state.attestations(number, node, submitter)
        if any(m == ctx.signer for m, _ in scores):
            raise AlreadyExists(f"signer already attested node {node.hex()}'s result by {submitter.hex()}")
        ctx.state.put_attestations(number, node, submitter, [*scores, [ctx.signer, credibility]])
    ctx.emit("attest", epoch=str(number), operator=ctx.signer.hex())


def _add_report(ctx: Context, epoch: int, node: bytes) -> None:
    reporters = ctx.state.reports(epoch, node)
    if ctx.signer in reporters:
        raise AlreadyExists(f"signer already reported node {node.hex()}")
    ctx.state.put_reports(epoch, node, [*reporters, ctx.signer])


def _planned_node(ctx: Context, body: dict[str, Any], field: str) -> tuple[int, bytes]:
    """The current epoch and the body's node, which a member may act on only if it is planned."""
    fields.check_keys(body, {"epoch", "node", field})
    ctx.require_member()
    number, _ = _current(ctx)
    _epoch_field(body, number)
    node = fields.key32(body, "node")
    if ctx.state.plan_entry(number, node) is None:
        raise UnknownEntity(f"node {node.hex()} is not in the plan of epoch {number}")
    return number, node


def report_invalid(ctx: Context, body: dict[str, Any]) -> None:
    """A member's report that a planned node gave no valid response."""
    number, node = _planned_node(ctx, body, "reason")
    fields.text(body, "reason", 256)
    _add_report(ctx, number, node)
    ctx.emit("report_invalid", epoch=str(number), node=node.hex())


def commit_rechallenge(ctx: Context, body: dict[str, Any]) -> None:
    """A member commits H(prompt || salt) of its own challenge to a planned node before sending it."""
    number, node = _planned_node(ctx, body, "commitment")
    commitment = fields.key32(body, "commitment")
    if ctx.state.rechallenge(number, node, ctx.signer) is not None:
        raise AlreadyExists(f"signer already re-challenges node {node.hex()} in epoch {number}")
    if ctx.state.commitment_used(number, commitment):
        raise AlreadyExists(f"commitment {commitment.hex()} repeats one of this epoch's")
    ctx.state.put_rechallenge(number, Rechallenge(node, ctx.signer, commitment, ctx.time))
    ctx.state.use_commitment(number, commitment, node)
    ctx.emit("commit_rechallenge", epoch=str(number), node=node.hex())


EPOCH_HANDLERS = {
    "submit-vrf": submit_vrf,
    "commit-plan": commit_plan,
    "submit-results": submit_results,
    "attest": attest,
    "report-invalid": report_invalid,
    "commit-rechallenge": commit_rechallenge,
}
