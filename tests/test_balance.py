"""F_LB, the latency EWMA and Algorithm 2 (seed planetserve.md 3.3)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planetserve.node.routing.balance import (
    ALPHA,
    BalancePolicy,
    LatencyEWMA,
    LoadReport,
    Reason,
    checked,
    effective_loads,
    rank_key,
    route,
)
from planetserve.node.routing.hrtree import NodeTable


@dataclass
class Node:
    node_id: str
    trusted: bool = True
    load: LoadReport | None = None


def node(node_id: str, latency: float, queued: int, capacity: int = 4, trusted: bool = True) -> Node:
    return Node(node_id, trusted, LoadReport(latency, queued, capacity))


def test_ewma_is_the_rtt_estimator_with_alpha_one_eighth() -> None:
    assert ALPHA == 1 / 8
    ewma = LatencyEWMA()
    assert ewma.observe(2.0) == 2.0  # the first sample is the estimate
    assert ewma.observe(10.0) == pytest.approx(7 / 8 * 2.0 + 1 / 8 * 10.0)
    for _ in range(200):
        ewma.observe(1.0)
    assert ewma.value == pytest.approx(1.0)
    with pytest.raises(ValueError, match="latency sample must be a finite non-negative number, got nan"):
        ewma.observe(float("nan"))
    with pytest.raises(ValueError, match="latency sample must be a finite non-negative number, got -1.0"):
        ewma.observe(-1.0)


def test_lb_factor_is_latency_times_queue_over_capacity() -> None:
    assert LoadReport(0.5, 6, 4).lb_factor == pytest.approx(0.75)
    assert LoadReport(0.5, 0, 4).lb_factor == 0
    with pytest.raises(ValueError, match=r"need queued >= 0 and capacity >= 1, got 1, 0"):
        LoadReport(0.5, 1, 0)
    with pytest.raises(ValueError, match="latency must be a finite non-negative number, got inf"):
        LoadReport(float("inf"), 1, 1)


def test_idle_nodes_tie_on_f_lb_and_the_faster_one_wins() -> None:
    nodes = [node("slow", 3.0, 0), node("fast", 0.4, 0), node("busy", 0.1, 2)]
    decision = route("self", nodes)
    assert decision.reason is Reason.MISS
    assert decision.target == "fast"
    assert decision.forward


def test_full_tie_keeps_the_request_then_orders_by_node_id() -> None:
    assert route("m", [node("z", 1.0, 0), node("m", 1.0, 0), node("a", 1.0, 0)]).target == "m"
    assert route("self", [node("z", 1.0, 0), node("a", 1.0, 0)]).target == "a"
    assert rank_key(LoadReport(1.0, 0, 1), "x", "x") < rank_key(LoadReport(1.0, 0, 1), "a", "x")


def test_miss_goes_to_least_f_lb_among_trusted() -> None:
    nodes = [node("self", 1.0, 3), node("a", 1.0, 2), node("b", 1.0, 3, capacity=8), node("c", 0.1, 0, trusted=False)]
    decision = route("self", nodes)
    assert decision == route("self", nodes)  # pure
    assert (decision.target, decision.reason, decision.forward) == ("b", Reason.MISS, True)


def test_hit_under_threshold_goes_to_least_loaded_holder() -> None:
    nodes = [node("self", 0.1, 0), node("h1", 1.0, 2), node("h2", 1.0, 1)]
    decision = route("self", nodes, holders={"h1", "h2"})
    assert (decision.target, decision.reason) == ("h2", Reason.HIT)  # not self, though self is idle


def test_hit_over_threshold_falls_back_to_least_loaded_overall() -> None:
    nodes = [node("self", 1.0, 3), node("h", 0.5, 8), node("idle", 2.0, 0)]
    decision = route("self", nodes, holders={"h"})
    assert (decision.target, decision.reason) == ("idle", Reason.HIT_OVERLOADED)
    assert "holder h overloaded" in decision.detail
    busy = [node("self", 1.0, 3), node("h", 0.5, 4), node("idle", 2.0, 0)]
    assert route("self", busy, holders={"h"}).reason is Reason.HIT  # every slot busy, nothing waiting
    strict = route("self", busy, holders={"h"}, policy=BalancePolicy(max_queue_ratio=1.0))
    assert (strict.target, strict.reason) == ("idle", Reason.HIT_OVERLOADED)


def test_hit_on_self_serves_locally() -> None:
    decision = route("self", [node("self", 1.0, 1), node("a", 1.0, 0)], holders={"self"})
    assert (decision.target, decision.reason, decision.forward) == ("self", Reason.HIT, False)


def test_untrusted_holders_are_ignored() -> None:
    nodes = [node("self", 1.0, 2), node("bad", 0.0, 0, trusted=False), node("ok", 1.0, 1)]
    decision = route("self", nodes, holders={"bad"})
    assert (decision.target, decision.reason) == ("ok", Reason.MISS)
    assert "no trusted holder" in decision.detail


def test_a_node_without_a_latency_sample_ranks_at_the_mean_latency() -> None:
    # with L = 0 the new node would win every ranking while it holds requests; at the mean it does not
    nodes = [node("self", 1.0, 2), node("new", 0.0, 2), node("a", 0.5, 1)]
    assert route("self", nodes).target == "a"
    assert route("self", [node("self", 1.0, 2), node("new", 0.0, 0)]).target == "new"  # idle wins
    assert route("self", [node("self", 0.0, 1), node("new", 0.0, 0)]).target == "self"  # no samples: a tie


def test_a_node_without_a_latency_sample_of_its_own_serves_what_it_receives() -> None:
    """Ranked at the group's mean it would forward every miss to an idle peer, and a prefix every
    request shares would send it every hit: it would never be scored on an answer of its own. Its
    first sample ends the rule."""
    group = [node("new", 0.0, 1), node("idle", 0.5, 0)]
    for holders in (set(), {"idle"}):
        decision = route("new", group, holders=holders)
        assert (decision.target, decision.reason, decision.forward) == ("new", Reason.NEW_NODE, False)
    assert route("new", [node("new", 0.5, 1), node("idle", 0.5, 0)]).target == "idle"
    assert route("new", [node("new", 0.5, 1), node("idle", 0.5, 0)], holders={"idle"}).target == "idle"


def test_nodes_without_a_load_report_are_not_candidates() -> None:
    assert route("self", [Node("ghost"), node("a", 1.0, 1)]).target == "a"


def test_no_candidates_serves_locally() -> None:
    decision = route("self", [node("x", 0.1, 0, trusted=False)])
    assert (decision.target, decision.reason, decision.forward) == ("self", Reason.NO_CANDIDATES, False)


def test_a_forwarded_request_is_served_locally() -> None:
    nodes = [node("self", 9.0, 40), node("a", 0.1, 0)]
    decision = route("self", nodes, holders={"a"}, forwarded=True, affinity="a")
    assert (decision.target, decision.reason, decision.forward) == ("self", Reason.ALREADY_FORWARDED, False)


def test_session_affinity() -> None:
    nodes = [node("self", 0.1, 0), node("sticky", 2.0, 3), node("holder", 0.1, 0)]
    decision = route("self", nodes, holders={"holder"}, affinity="sticky")
    assert (decision.target, decision.reason, decision.forward) == ("sticky", Reason.AFFINITY, True)
    assert route("self", nodes, affinity="self").reason is Reason.AFFINITY

    overloaded = [node("self", 0.1, 0), node("sticky", 2.0, 8), node("holder", 0.1, 0)]
    decision = route("self", overloaded, holders={"holder"}, affinity="sticky")
    assert (decision.target, decision.reason) == ("holder", Reason.HIT)
    assert "affinity sticky overloaded" in decision.detail

    untrusted = [node("self", 0.1, 0), node("sticky", 0.1, 0, trusted=False)]
    decision = route("self", untrusted, affinity="sticky")
    assert (decision.target, decision.reason) == ("self", Reason.MISS)
    assert "not a trusted candidate" in decision.detail
    assert route("self", untrusted, affinity="gone").target == "self"


def test_node_table_entries_are_candidates() -> None:
    table = NodeTable()
    table.upsert("self", trusted=True, load=LoadReport(1.0, 3, 4))
    table.upsert("peer", trusted=True, load=LoadReport(1.0, 0, 4), address="10.0.0.2:7000")
    table.upsert("rogue", trusted=False, load=LoadReport(0.0, 0, 4))
    assert route("self", table).target == "peer"


loads = st.builds(LoadReport, st.floats(0, 10), st.integers(0, 20), st.integers(1, 8))
candidates = st.lists(st.builds(Node, st.sampled_from("abcdefgh"), st.booleans(), st.none() | loads),
                      max_size=8, unique_by=lambda n: n.node_id)


@given(candidates, st.sets(st.sampled_from("abcdefgh")), st.none() | st.sampled_from("abcdefgh"),
       st.booleans())
def test_only_trusted_nodes_or_self_are_ever_chosen(nodes: list[Node], holders: set[str],
                                                    affinity: str | None, forwarded: bool) -> None:
    decision = route("a", nodes, holders=holders, affinity=affinity, forwarded=forwarded)
    eligible = {n.node_id: n for n in nodes if n.trusted and n.load is not None}
    assert decision.forward == (decision.target != "a")
    if forwarded:
        assert not decision.forward
    if decision.forward:
        assert decision.target in eligible
    if eligible and decision.reason is Reason.MISS:
        loads = effective_loads({n.node_id: n.load for n in eligible.values()})
        assert decision.target == min(loads, key=lambda n: rank_key(loads[n], n, "a"))


def test_a_peer_cannot_report_itself_lighter_than_the_deciding_node_sees_it() -> None:
    """A liar reporting an idle, instant, huge node draws a miss while nothing is in flight there; once a
    request is, the honest idle node wins. Our own entry is taken as we measure it."""
    liar, honest, me = node("liar", 0.001, 0, capacity=64), node("honest", 0.5, 0), node("me", 0.9, 1)
    assert route("me", [liar, honest, me]).target == "liar"
    seen = checked([liar, honest, me], "me", inflight={"liar": 1, "me": 5}, latency={"honest": 0.2},
                   capacity={"liar": 2, "honest": 4})
    loads = {s.node_id: s.load for s in seen}
    assert loads["liar"] == LoadReport(0.001, 1, 2)  # Q raised to what is in flight, C to the registered 2
    assert loads["honest"] == LoadReport(0.5, 0, 4)  # reported L above what we saw stays
    assert loads["me"] == me.load
    assert route("me", seen).target == "honest"
    later = checked([liar, honest], "me", inflight={}, latency={"liar": 3.0}, capacity={})
    assert {s.node_id: s.load for s in later}["liar"] == LoadReport(3.0, 0, 64)
    assert checked([Node("new")], "me", inflight={"new": 2}, latency={}, capacity={})[0].load is None
