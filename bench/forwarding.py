"""Overlay forwarding in simulation (seed planetserve.md 5.4): latency, P99, TTFT and cache hit rate of
PlanetServe's forwarding against no forwarding, the HR-tree alone, and a centralized cache-aware router.

Groups of 8 and 16 model nodes (the paper's scale) serve the ToolUse, Coding, Long-doc QA and Mixed
workloads (`planetserve.workloads`) at per-node request rates from light to heavy, so both group sizes
see the same load per node. Every policy of one row serves the very same requests. The HR-tree-only
ablation (the paper's Fig. 15) runs on ToolUse. Costs are the derived A100 / Llama-3-8B table
(`bench/sim/costs.py`) unless --gpu, --costs or --calibrate say otherwise.

    .venv/bin/python bench/forwarding.py [--nodes 8,16] [--workloads tooluse,coding,longdoc,mixed]
        [--rates 1,2] [--duration 60] [--seed 0] [--jobs 1] [--json out.json]

Targets checked at the end: PlanetServe's mean latency at least 50 % below no forwarding under Mixed,
and its cache hit rate within 10 % of the centralized router's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.sim import (  # noqa: E402
    A100_LLAMA3_8B,
    Centralized,
    Cluster,
    CostModel,
    NoForwarding,
    Overlay,
    Prepared,
    Summary,
    fit_measured,
    summarize,
)
from bench.sim.costs import A6000_LLAMA3_8B  # noqa: E402
from planetserve.node.routing.balance import BalancePolicy
from planetserve.node.routing.cachesync import SyncConfig
from planetserve.workloads import MIXED_RATIO, generate  # noqa: E402

DEFAULT_RATES = {"tooluse": (1.0, 2.0), "coding": (1.0, 2.0), "longdoc": (0.4, 0.8), "mixed": (1.0, 1.5, 2.0)}
"""Requests per second per node: from light load to where no forwarding saturates (A100 table)."""
POLICIES = ("no-forwarding", "hr-tree", "planetserve", "centralized")
GPUS = {"a100": A100_LLAMA3_8B, "a6000": A6000_LLAMA3_8B}
LATENCY_TARGET = 0.5
HIT_TARGET = 0.9


@dataclass(frozen=True)
class Case:
    nodes: int
    workload: str
    rate: float
    """Per node."""
    policies: tuple[str, ...]


@dataclass(frozen=True)
class Row:
    case: Case
    requests: int
    mean_prompt: float
    results: tuple[Summary, ...]

    def get(self, policy: str) -> Summary | None:
        return next((s for s in self.results if s.policy == policy), None)


def make_policy(name: str, args: argparse.Namespace) -> NoForwarding | Overlay | Centralized:
    if name == "no-forwarding":
        return NoForwarding()
    if name == "centralized":
        return Centralized()
    config = SyncConfig(load_interval=args.load_interval)
    return Overlay(balance=name == "planetserve", config=config, seed=args.seed,
                   policy=BalancePolicy(max_queue_ratio=args.overload), min_depth=args.min_depth)


def run_case(case: Case, args: argparse.Namespace, costs: CostModel) -> Row:
    requests = generate(case.workload, rate=case.rate * case.nodes, duration=args.duration, seed=args.seed,
                        scale=args.scale, followup=args.followup, mix=args.mix)
    prepared = Prepared.of(requests, costs.block_size)
    results = tuple(
        summarize(Cluster(prepared, make_policy(p, args), costs, case.nodes, net_delay=args.net_delay,
                          warm=not args.cold, queue=args.queue).run())
        for p in case.policies
    )
    mean_prompt = sum(r.prompt_len for r in requests) / max(1, len(requests))
    return Row(case, len(requests), mean_prompt, results)


def cases(args: argparse.Namespace) -> list[Case]:
    out = []
    for nodes in args.nodes:
        for workload in args.workloads:
            policies = args.policies or tuple(
                p for p in POLICIES if p != "hr-tree" or workload == "tooluse")
            for rate in args.rates or DEFAULT_RATES[workload]:
                out.append(Case(nodes, workload, rate, policies))
    return out


def _change(new: float, old: float) -> str:
    return f"{100 * (new - old) / old:+.0f}%" if old else "n/a"


COLUMNS = ("mean s", "p99 s", "ttft s", "ttft99", "hit", "fwd", "imbal")


def print_tables(rows: list[Row]) -> None:
    head = f"{'workload':9} {'rate/node':>9} {'total':>6} {'reqs':>5} {'prompt':>6} {'policy':14}"
    head += "".join(f"{c:>8}" for c in COLUMNS) + "   lat vs none  ttft vs none  hit vs central"
    for nodes in sorted({r.case.nodes for r in rows}):
        print(f"\n== {nodes} model nodes ==\n{head}")
        for row in (r for r in rows if r.case.nodes == nodes):
            base, central = row.get("no-forwarding"), row.get("centralized")
            case = row.case
            lead = (f"{case.workload:9} {case.rate:9.2f} {case.rate * nodes:6.1f} {row.requests:5d} "
                    f"{row.mean_prompt:6.0f}")
            for s in row.results:
                values = (s.mean_latency, s.p99_latency, s.mean_ttft, s.p99_ttft, s.hit_rate, s.forwarded,
                          s.imbalance)
                line = f"{lead:39} {s.policy:14}" + "".join(f"{v:8.2f}" for v in values)
                if base is not None and s is not base:
                    line += f"   {_change(s.mean_latency, base.mean_latency):>11}"
                    line += f"  {_change(s.mean_ttft, base.mean_ttft):>12}"
                else:
                    line += " " * 28
                if central is not None and s is not central and central.hit_rate:
                    line += f"  {s.hit_rate / central.hit_rate:13.2f}x"
                print(line)
                lead = ""


def print_ablation(rows: list[Row]) -> None:
    steps = ("no-forwarding", "hr-tree", "planetserve")
    chosen = [r for r in rows if all(r.get(p) for p in steps)]
    if not chosen:
        return
    print("\n== Ablation (Fig. 15): no forwarding -> + HR-tree -> + load balancing (PlanetServe) ==")
    print(f"{'nodes':>5} {'workload':9} {'rate/node':>9}   {'mean s: none / HR-tree / +LB':31}  "
          "p99 s: none / HR-tree / +LB")
    for r in chosen:
        a, b, c = (r.get(p) for p in steps)
        assert a and b and c
        print(f"{r.case.nodes:5d} {r.case.workload:9} {r.case.rate:9.2f}   "
              f"{a.mean_latency:6.2f} / {b.mean_latency:6.2f} / {c.mean_latency:6.2f}{'':11}"
              f"{a.p99_latency:6.2f} / {b.p99_latency:6.2f} / {c.p99_latency:6.2f}")


def print_targets(rows: list[Row]) -> None:
    print("\n== Targets ==")
    for r in rows:
        ps, base = r.get("planetserve"), r.get("no-forwarding")
        if r.case.workload == "mixed" and ps and base:
            cut = 1 - ps.mean_latency / base.mean_latency
            print(f"mixed, {r.case.nodes} nodes, {r.case.rate:g}/node: PlanetServe mean latency "
                  f"{100 * cut:.0f}% below no forwarding (target >= {100 * LATENCY_TARGET:.0f}%): "
                  f"{'met' if cut >= LATENCY_TARGET else 'not met'}")
    ratios = [(ps.hit_rate / c.hit_rate, r) for r in rows
              if (ps := r.get("planetserve")) and (c := r.get("centralized")) and c.hit_rate]
    if ratios:
        worst, row = min(ratios, key=lambda x: x[0])
        print(f"cache hit rate, PlanetServe / centralized: worst {worst:.2f} ({row.case.workload}, "
              f"{row.case.nodes} nodes, {row.case.rate:g}/node) over {len(ratios)} cases "
              f"(target >= {HIT_TARGET:.2f}): {'met' if worst >= HIT_TARGET else 'not met'}")


def load_costs(args: argparse.Namespace) -> CostModel:
    costs = GPUS[args.gpu]
    if args.costs:
        costs = CostModel.from_json(args.costs)
    if args.calibrate:
        from planetserve.node.engine.profile import measure_costs, random_llama

        costs = fit_measured(measure_costs(random_llama(), prompt_lens=(128, 384, 768)), costs)
        print(f"measured cost table: {costs.to_json()}")
    if args.capacity:
        costs = replace(costs, max_seqs=args.capacity)
    return costs


def mix_ratio(text: str) -> dict[str, int]:
    parts = [int(x) for x in text.split(":")]
    if len(parts) != 3 or min(parts) < 0 or not sum(parts):
        raise argparse.ArgumentTypeError("--mix is tooluse:coding:longdoc, e.g. 3:6:1")
    return dict(zip(("tooluse", "coding", "longdoc"), parts, strict=True))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=lambda s: tuple(int(x) for x in s.split(",")), default=(8, 16))
    parser.add_argument("--workloads", type=lambda s: tuple(s.split(",")), default=tuple(DEFAULT_RATES))
    parser.add_argument("--rates", type=_floats, help="requests/s per node (default: per workload)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", type=lambda s: tuple(s.split(",")),
                        help=f"any of {','.join(POLICIES)} (default: all; hr-tree only on tooluse)")
    parser.add_argument("--mix", type=mix_ratio, help="Mixed's tooluse:coding:longdoc ratio (default 3:6:1)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="shrink every workload length (with --calibrate: the small engine's context)")
    parser.add_argument("--followup", type=float, default=0.0, help="chance a request continues a session")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="a100")
    parser.add_argument("--costs", type=Path, help="a cost table as JSON (CostModel fields)")
    parser.add_argument("--calibrate", action="store_true",
                        help="time the built-in engine (a small random Llama; needs torch) for the costs")
    parser.add_argument("--capacity", type=int, help="C: concurrent sequences per node (default 32)")
    parser.add_argument("--net-delay", type=float, default=0.02, help="one-way seconds between model nodes")
    parser.add_argument("--queue", choices=("outstanding", "waiting"), default="outstanding",
                        help="what a node reports as Q: running + waiting requests, or waiting only")
    parser.add_argument("--overload", type=float, default=2.0,
                        help="a holder is overloaded at Q >= this * C (Algorithm 2's threshold)")
    parser.add_argument("--load-interval", type=float, default=0.1, help="seconds between load reports")
    parser.add_argument("--min-depth", type=int, default=1, help="HR-tree match threshold, in chunks")
    parser.add_argument("--cold", action="store_true",
                        help="nodes start without a latency sample (L = 0) instead of an unloaded estimate")
    parser.add_argument("--jobs", type=int, default=1, help="cases run in parallel processes")
    parser.add_argument("--json", type=Path, help="write every summary here")
    args = parser.parse_args(argv)
    for name in (*args.workloads, *(args.policies or ())):
        if name not in (*DEFAULT_RATES, *POLICIES):
            parser.error(f"unknown workload or policy {name!r}")
    costs = load_costs(args)
    todo = cases(args)
    ratio = args.mix or MIXED_RATIO
    print(f"cost model: {costs.name}; C = {costs.max_seqs}, KV {costs.kv_capacity_tokens:,} tokens per node, "
          f"block {costs.block_size}; {args.duration:g} s of Poisson arrivals, seed {args.seed}; mixed "
          f"{ratio['tooluse']}:{ratio['coding']}:{ratio['longdoc']}; one-way delay "
          f"{1000 * args.net_delay:g} ms", flush=True)
    started = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(run_case, todo, [args] * len(todo), [costs] * len(todo)))
    else:
        rows = []
        for case in todo:
            rows.append(run_case(case, args, costs))
            print(f"  {case.nodes} nodes {case.workload} {case.rate:g}/node done "
                  f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    print_tables(rows)
    print_ablation(rows)
    print_targets(rows)
    print(f"\n{len(todo)} cases in {time.perf_counter() - started:.0f} s")
    if args.json:
        dump = [{"case": asdict(r.case), "requests": r.requests, "mean_prompt": r.mean_prompt,
                 "results": [asdict(s) for s in r.results]} for r in rows]
        args.json.write_text(json.dumps(dump, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
