"""What an epoch's evidence decides: each challenged node's credibility C(T) and the faults of the
leader and members (seed planetserve.md 3.4 and 4.4), as a pure function of what the chain stored.

Per node of the plan, in key order:
- The candidate results are the leader's, if valid, then valid re-challenges in submitter order.
  Those whose attesting members hold more than 2/3 of the power are attested, each worth the median
  of its attested credibilities.
- Every attested answer counts against the node that computed it: the challenged node, or the group
  peer whose own signature (`served_by`) shows it computed the answer for the challenged node. A node
  that computed any attested answer this epoch, for its own challenges or as a serving peer, gets as
  C(T) the median of them all, each weighted by its number of tokens (an answer that a model ends at
  once says little, a long one much): a forward shows the serving peer's model, so a fast peer that serves
  its group's challenges with a cheaper model is caught on them, and an honest node that forwarded to
  it is scored on what it computed itself (members re-challenge a node whose leader result was
  forwarded). A planned node that computed none answers for what it returned: C(T) is the weighted
  median of its attested results, so a forward never hides it.
- Without an attested result, the node is cut (C(T) = 0) only when members holding more than 1/3 of
  the power reported no valid response from it; the leader's own "invalid" claim counts as its report.
- Otherwise its reputation does not change this epoch.
A serving peer that is not planned gets the weighted median of what it computed, after every planned node. A
node gets at most one C(T) per epoch.
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


def _attested(ev: Evidence, node: bytes, total: int, findings: list[Finding]
              ) -> list[tuple[ChallengeResult, int]]:
    """The node's candidate results that members holding more than 2/3 of the power attested, each with
    the median of its attestations; an attestation or a leader's proposal far from it is a finding."""
    attested = []
    for result in _candidates(ev.results.get(node, [])):
        scores = [(m, c) for m, c in ev.attestations.get((node, result.submitter), []) if m in ev.power]
        if not rules.supermajority(_power([m for m, _ in scores], ev.power), total):
            continue
        value = median([c for _, c in scores])
        for member, credibility in scores:
            if abs(credibility - value) > ev.tolerance:
                findings.append(Finding(member, "deviating-attestation", node,
                                        f"attested {credibility} ppm against the median {value}"))
        if result.kind == "leader" and abs(result.credibility - value) > ev.tolerance:
            findings.append(Finding(ev.leader, "deviating-credibility", node,
                                    f"proposed {result.credibility} ppm against the median {value}"))
        attested.append((result, value))
    return attested


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
    attested = {node: _attested(ev, node, total, findings) for node in ev.plan_nodes}
    computed: dict[bytes, list[tuple[int, int]]] = {}
    for node in ev.plan_nodes:
        for result, value in attested[node]:
            computed.setdefault(result.served_by or node, []).append((value, _tokens(result)))
    for node in ev.plan_nodes:
        node_results = ev.results.get(node, [])
        own = next((r for r in node_results if r.kind == "leader"), None)
        if own is None and leader_submitted:
            findings.append(Finding(ev.leader, "skipped-node", node, "planned node left out of the results"))
        verdict = _verdict(node, attested[node], computed)
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
    serving = [Verdict(peer, weighted_median(values), "served") for peer, values in computed.items()
               if peer not in scored]
    return verdicts + serving, findings


def _verdict(node: bytes, attested: list[tuple[ChallengeResult, int]],
             computed: dict[bytes, list[tuple[int, int]]]) -> Verdict | None:
    """The weighted median of every attested answer the node computed; without one, that of its
    attested (forwarded) results, since it answers for what it returned; without those, none."""
    if node in computed:
        return Verdict(node, weighted_median(computed[node]), "computed")
    if attested:
        return Verdict(node, weighted_median([(value, _tokens(r)) for r, value in attested]), "returned")
    return None


def _tokens(result: ChallengeResult) -> int:
    """An answer's weight as evidence: its number of tokens (at least 1)."""
    return max(1, len(result.response.get("token_ids", ())))


def weighted_median(values: list[tuple[int, int]]) -> int:
    """The lower weighted median of (value, weight) pairs: the least value whose cumulative weight, in
    value order, reaches half the total (integers; ties in value order)."""
    total = sum(weight for _, weight in values)
    cumulative = 0
    for value, weight in sorted(values):
        cumulative += weight
        if 2 * cumulative >= total:
            return value
    raise ValueError("weighted median of no values")
