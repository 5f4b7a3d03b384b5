"""What an epoch's evidence decides: each challenged node's credibility C(T) and the faults of the
leader and members (seed planetserve.md 3.4 and 4.4), as a pure function of what the chain stored.

Per node of the plan, in key order:
- The candidate results are the leader's, if valid, then valid re-challenges in submitter order.
  Those whose attesting members hold more than 2/3 of the power are attested, each worth the median
  of its attested credibilities.
  Each attested answer also carries the median of the attested counts of its deviating tokens.
- Every attested answer counts against the node that computed it: the challenged node, or the group
  peer whose own signature (`served_by`) shows it computed the answer for the challenged node. A node
  that computed any attested answer this epoch, for its own challenges or as a serving peer, gets as
  C(T) the product of them all (`product`): an honest answer scores 1 under the calibrated rule
  (every token is the honest choice under its signed seed), so an honest node keeps 1 however many it
  answers, and any deviating answer lowers C(T) however many clean ones come with it (a node that cheats
  on some requests only is caught on those). A forward shows the serving peer's model, so a fast peer
  that serves its group's challenges with a cheaper model is caught on them, and an honest node that
  forwarded to it is scored on what it computed itself (members re-challenge a node whose leader
  result was forwarded). A planned node that computed none answers for what it returned: C(T) is the
  product of its attested results, so a forward never hides it. A verdict also counts the tokens those
  answers had checked and how many deviated, which accumulate across epochs (registry/evidence.py).
- A node that members holding more than 1/3 of the power reported as giving no valid response is cut
  (C(T) = 0), whatever it answered: the leader's own "invalid" claim counts as its report, unless it says its
  challenge did not open (`UNOPENED`, the planner's doing, not the node's). A node told
  its challenge by a colluding member answers that one and could drop every other request, users' and
  re-challenges alike; reports from members whose power cannot all be faulty show it served no one.
  Its answers' checked and deviating tokens still count toward its evidence.
- Otherwise, without an attested result, its reputation does not change this epoch.
A serving peer that is not planned gets the product of what it computed, after every planned node. A
node gets at most one C(T) per epoch.
Faults: a leader that submitted nothing for a committed plan withheld its results; one that left a
node out skipped it; one whose proposed credibility strays beyond the tolerance from the median
deviated. A member whose attestation strays beyond the tolerance from the median deviated too.
A leader that claimed no valid response where members holding more than 2/3 of the power got valid
responses on re-challenge made an unconfirmed report: recorded, but not counted toward its removal
(`UNCOUNTED`). A valid result submitted before the epoch's closing windows that went unattested was
withheld by every member that did not attest it and whose validator was not absent from the epoch: a
member colluding with a node could otherwise keep the node's cheap answer from counting, whenever
another member is away, at no cost (more than 2/3 of the power must attest).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planetserve.registry import rules
from planetserve.registry.epochs import INVALID, UNOPENED, VALID, ChallengeResult
from planetserve.registry.params import PPM
from planetserve.registry.reputation import median

UNCOUNTED = frozenset({"unconfirmed-report"})
"""Findings recorded for people to weigh but not counted toward a member's removal, because a node can
cause them: the leader's challenges come first in the epoch and members' re-challenges after, so a node
can answer the leader late or badly and the members well, and the leader's claim is not its provable
fault. Counted, a few such nodes in every plan took each leader's power in turn."""


@dataclass(frozen=True)
class Evidence:
    leader: bytes
    plan_nodes: list[bytes]
    results: dict[bytes, list[ChallengeResult]]
    attestations: dict[tuple[bytes, bytes], list[tuple[bytes, int, int]]]
    """(node, submitter) → (member, credibility ppm, deviating tokens) per attestation."""
    reports: dict[bytes, tuple[bytes, ...]]
    power: dict[bytes, int]
    tolerance: int
    attest_before: int
    """Results submitted below this height left every member time to attest them
    (`Schedule.attest_before`)."""
    absent: frozenset[bytes]
    """Members whose validators missed the epoch (their `missed-blocks` fault says so already)."""


@dataclass(frozen=True)
class Verdict:
    node: bytes
    credibility: int
    source: str
    checked: int = 0
    """Tokens of the answers behind C(T)."""
    deviations: int = 0
    """Of those, the tokens beyond the verifiers' tolerance (attested medians, summed)."""

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


@dataclass(frozen=True)
class Scored:
    """An attested answer: what it is worth (the medians of its attestations) and its length."""

    credibility: int
    deviations: int
    tokens: int


def _scores(ev: Evidence, node: bytes, submitter: bytes) -> list[tuple[bytes, int, int]]:
    """The attestations of `submitter`'s result for `node` by members that hold power."""
    return [s for s in ev.attestations.get((node, submitter), []) if s[0] in ev.power]


def _attested(ev: Evidence, node: bytes, total: int, findings: list[Finding]
              ) -> list[tuple[ChallengeResult, Scored]]:
    """The node's candidate results that members holding more than 2/3 of the power attested, each with
    the median of its attestations; an attestation or a leader's proposal far from it is a finding."""
    attested = []
    for result in _candidates(ev.results.get(node, [])):
        scores = _scores(ev, node, result.submitter)
        if not rules.supermajority(_power([s[0] for s in scores], ev.power), total):
            continue
        value = median([c for _, c, _ in scores])
        tokens = len(result.response.get("token_ids", ()))
        deviations = min(tokens, median([d for _, _, d in scores]))
        for member, credibility, _ in scores:
            if abs(credibility - value) > ev.tolerance:
                findings.append(Finding(member, "deviating-attestation", node,
                                        f"attested {credibility} ppm against the median {value}"))
        if result.kind == "leader" and abs(result.credibility - value) > ev.tolerance:
            findings.append(Finding(ev.leader, "deviating-credibility", node,
                                    f"proposed {result.credibility} ppm against the median {value}"))
        attested.append((result, Scored(value, deviations, tokens)))
    return attested


def to_pipelines(verdicts: list[Verdict], pipelines: dict[bytes, tuple[bytes, ...]]) -> list[Verdict]:
    """A pipeline entry's verdict is also each later stage's (they computed the answer together),
    unless that node got its own verdict; in the order of the verdicts, each node once."""
    scored = {v.node for v in verdicts}
    out = list(verdicts)
    for verdict in verdicts:
        for node in pipelines.get(verdict.node, ()):
            if node not in scored:
                out.append(replace(verdict, node=node))
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
    computed: dict[bytes, list[Scored]] = {}
    for node in ev.plan_nodes:
        for result, answer in attested[node]:
            computed.setdefault(result.served_by or node, []).append(answer)
    for node in ev.plan_nodes:
        node_results = ev.results.get(node, [])
        own = next((r for r in node_results if r.kind == "leader"), None)
        if own is None and leader_submitted:
            findings.append(Finding(ev.leader, "skipped-node", node, "planned node left out of the results"))
        verdict = _verdict(node, attested[node], computed)
        reporters = set(ev.reports.get(node, ()))
        claimed = own is not None and own.status == INVALID and own.reason != UNOPENED
        if claimed:
            reporters.add(ev.leader)
        if 3 * _power(reporters, ev.power) > total:
            verdict = (Verdict(node, 0, "invalid-reports") if verdict is None
                       else replace(verdict, credibility=0, source="invalid-reports"))
        if verdict is not None:
            verdicts.append(verdict)
            scored.add(verdict.node)
        if claimed:
            answered = {r.submitter for r in node_results if r.kind == "rechallenge" and r.status == VALID}
            if rules.supermajority(_power(answered, ev.power), total):
                findings.append(Finding(ev.leader, "unconfirmed-report", node,
                                        "members holding more than 2/3 of the power got valid responses"))
    serving = [_combined(peer, answers, "served") for peer, answers in computed.items() if peer not in scored]
    return verdicts + serving, findings + _withheld(ev, total)


def _withheld(ev: Evidence, total: int) -> list[Finding]:
    """One `withheld-attestation` finding per present member that left unattested any of the valid
    results submitted in time that members holding more than 2/3 of the power did not attest."""
    unattested = 0
    missing: dict[bytes, int] = {}
    for node in ev.plan_nodes:
        for result in _candidates(ev.results.get(node, [])):
            attesters = {member for member, *_ in _scores(ev, node, result.submitter)}
            if result.height >= ev.attest_before or rules.supermajority(_power(attesters, ev.power), total):
                continue
            unattested += 1
            for member in ev.power.keys() - attesters - ev.absent:
                missing[member] = missing.get(member, 0) + 1
    return [Finding(member, "withheld-attestation", b"",
                    f"did not attest {missing[member]} of the {unattested} valid results submitted in time "
                    "that went unattested") for member in sorted(missing)]


def _verdict(node: bytes, attested: list[tuple[ChallengeResult, Scored]],
             computed: dict[bytes, list[Scored]]) -> Verdict | None:
    """Every attested answer the node computed; without one, its attested (forwarded) results, since it
    answers for what it returned; without those, none."""
    if node in computed:
        return _combined(node, computed[node], "computed")
    if attested:
        return _combined(node, [answer for _, answer in attested], "returned")
    return None


def _combined(node: bytes, answers: list[Scored], source: str) -> Verdict:
    return Verdict(node, product([a.credibility for a in answers]), source, sum(a.tokens for a in answers),
                   sum(a.deviations for a in answers))


def product(values: list[int]) -> int:
    """The product of credibilities in ppm, in value order, flooring at each step (integers, one order on
    every validator)."""
    if not values:
        raise ValueError("product of no values")
    result = PPM
    for value in sorted(values):
        result = result * value // PPM
    return result
