"""What an epoch's evidence decides: each challenged node's credibility C(T) and the faults of the
leader and members (seed planetserve.md 3.4 and 4.4), as a pure function of what the chain stored.

Per node of the plan, in key order:
- The candidate results are the leader's, if valid, then valid re-challenges in submitter order.
  Those whose attesting members hold more than 2/3 of the power are attested; the first attested one
  the node computed itself (no `served_by`) gives C(T), the median of its attested credibilities, and
  only without one does the first attested forwarded one. A forward shows the serving peer's model,
  not the node's; members re-challenge a node whose leader result was forwarded, so a node that sends
  its challenges to honest peers is still scored on its own answers when it serves any.
- Without such a result, the node is cut (C(T) = 0) only when members holding more than 1/3 of the
  power reported no valid response from it; the leader's own "invalid" claim counts as its report.
- Otherwise its reputation does not change this epoch.
The node a challenge addressed answers for its answer, whoever computed it: C(T) is the challenged
node's, so a forward never hides it. When it forwarded the challenge within its group, the serving
node's own signature rides along and the serving node is credited with the same C(T) too, unless it
got one of its own this epoch (it is planned itself, or served an earlier challenge). A node gets at
most one C(T) per epoch: planned nodes in plan order first, then serving nodes in plan order.
Faults: a leader that submitted nothing for a committed plan withheld its results; one that left a
node out skipped it; one whose proposed credibility strays beyond the tolerance from the median
deviated; one that claimed an invalid response where members holding more than 2/3 of the power
got valid responses on re-challenge reported falsely. A member whose attestation strays beyond the
tolerance from the median deviated too.
"""

from __future__ import annotations

from dataclasses import dataclass

from planetserve.registry import rules
from planetserve.registry.epochs import INVALID, VALID, ChallengeResult
from planetserve.registry.reputation import median


@dataclass(frozen=True)
class Evidence:
    leader: bytes
    plan_nodes: list[bytes]
    results: dict[bytes, list[ChallengeResult]]
    attestations: dict[tuple[bytes, bytes], list[tuple[bytes, int]]]
    reports: dict[bytes, tuple[bytes, ...]]
    power: dict[bytes, int]
    tolerance: int


@dataclass(frozen=True)
class Verdict:
    node: bytes
    credibility: int
    source: str
    served_by: bytes = b""
    """The group peer that computed the scored response, when the node forwarded its challenge."""

    @property
    def scored(self) -> bool:
        """C(T) came from an attested response, not from reports of no valid response."""
        return self.source != "invalid-reports"


@dataclass(frozen=True)
class Finding:
    operator: bytes
    kind: str
    node: bytes
    detail: str


def _power(members: set[bytes] | list[bytes], power: dict[bytes, int]) -> int:
    return sum(power.get(m, 0) for m in set(members))


def _candidates(node_results: list[ChallengeResult]) -> list[ChallengeResult]:
    leader = [r for r in node_results if r.kind == "leader" and r.status == VALID]
    others = sorted((r for r in node_results if r.kind == "rechallenge" and r.status == VALID),
                    key=lambda r: r.submitter)
    return leader + others


def _scored(ev: Evidence, node: bytes, total: int, findings: list[Finding]) -> Verdict | None:
    attested = []
    for result in _candidates(ev.results.get(node, [])):
        scores = [(m, c) for m, c in ev.attestations.get((node, result.submitter), []) if m in ev.power]
        if rules.supermajority(_power([m for m, _ in scores], ev.power), total):
            attested.append((result, scores))
    if not attested:
        return None
    own = [(result, scores) for result, scores in attested if not result.served_by]
    chosen = (own or attested)[0][0]
    verdict = None
    for result, scores in attested:
        if result is not chosen and result.kind != "leader":
            continue
        value = median([c for _, c in scores])
        for member, credibility in scores:
            if abs(credibility - value) > ev.tolerance:
                findings.append(Finding(member, "deviating-attestation", node,
                                        f"attested {credibility} ppm against the median {value}"))
        if result.kind == "leader" and abs(result.credibility - value) > ev.tolerance:
            findings.append(Finding(ev.leader, "deviating-credibility", node,
                                    f"proposed {result.credibility} ppm against the median {value}"))
        if result is chosen:
            verdict = Verdict(node, value, f"{result.kind}:{result.submitter.hex()}", result.served_by)
    return verdict


def to_pipelines(verdicts: list[Verdict], pipelines: dict[bytes, tuple[bytes, ...]]) -> list[Verdict]:
    """A pipeline entry's verdict is also each later stage's (they computed the answer together),
    unless that node got its own verdict; in the order of the verdicts, each node once."""
    scored = {v.node for v in verdicts}
    out = list(verdicts)
    for verdict in verdicts:
        for node in pipelines.get(verdict.node, ()):
            if node not in scored:
                out.append(Verdict(node, verdict.credibility, verdict.source))
                scored.add(node)
    return out


def decide(ev: Evidence) -> tuple[list[Verdict], list[Finding]]:
    total = sum(ev.power.values())
    verdicts: list[Verdict] = []
    scored: set[bytes] = set()
    findings: list[Finding] = []
    leader_submitted = any(r.kind == "leader" for rs in ev.results.values() for r in rs)
    if ev.plan_nodes and not leader_submitted:
        findings.append(Finding(ev.leader, "withheld-results", b"",
                                f"no results for any of the {len(ev.plan_nodes)} planned challenges"))
    for node in ev.plan_nodes:
        node_results = ev.results.get(node, [])
        own = next((r for r in node_results if r.kind == "leader"), None)
        if own is None and leader_submitted:
            findings.append(Finding(ev.leader, "skipped-node", node, "planned node left out of the results"))
        verdict = _scored(ev, node, total, findings)
        if verdict is None:
            reporters = set(ev.reports.get(node, ()))
            if own is not None and own.status == INVALID:
                reporters.add(ev.leader)
            if 3 * _power(reporters, ev.power) > total:
                verdict = Verdict(node, 0, "invalid-reports")
        if verdict is not None:
            verdicts.append(verdict)
            scored.add(verdict.node)
        if own is not None and own.status == INVALID:
            answered = {r.submitter for r in node_results if r.kind == "rechallenge" and r.status == VALID}
            if rules.supermajority(_power(answered, ev.power), total):
                findings.append(Finding(ev.leader, "false-invalid-report", node,
                                        "members holding more than 2/3 of the power got valid responses"))
    return verdicts + _serving_peers(verdicts, scored), findings


def _serving_peers(verdicts: list[Verdict], scored: set[bytes]) -> list[Verdict]:
    """The serving peers' credit: each forwarded verdict's C(T) for the peer that computed it, in plan
    order, for peers without a C(T) of their own."""
    out = []
    for verdict in verdicts:
        if verdict.served_by and verdict.served_by not in scored:
            out.append(Verdict(verdict.served_by, verdict.credibility, verdict.source + ":served"))
            scored.add(verdict.served_by)
    return out
