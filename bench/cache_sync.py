"""Cache-state sync cost: pushed deltas with periodic snapshots vs broadcasting the full tree (paper A6,
fig. 19-20).

Workload: each of N model nodes serves `--rate` requests/s; each request stores a new prompt (one of 8
system prompts of 512 tokens, then a unique question of 64-512 tokens; the chunk plan has the Sentry's
L for the 512-token system prompts, then 64-token chunks). A node's cache holds `--capacity` prompts and
evicts the oldest when full (the engine drops the question: the chunk after the system prompt and all
below it), so in steady state every node inserts and evicts `--rate` prompts/s. Caches start full.

    delta  the protocol's defaults: a delta every 100 ms when there is news, a snapshot every 5 s
    full   every node broadcasts its whole tree every 100 ms (the same freshness), applied with the same
           reverse-index replace

Per node and second of simulated time: messages and encoded bytes (one copy of each broadcast), bytes
sent (unicast to N-1 peers), the CPU of building and encoding its messages (sender), and the CPU of
decoding and applying what its N-1 peers send (receiver). Every node sends; node 0 receives everything,
and stands for the others, whose receive work is the same. Handling the engine's own cache events costs
the same in both modes and is not counted. The last column checks that node 0's view of every peer
equals that peer's own state once the last batch is out.

    .venv/bin/python bench/cache_sync.py [--nodes 8,16,50] [--rate 20] [--capacity 200] [--seconds 10]
"""

from __future__ import annotations

import argparse
import random
import time
from collections import deque
from dataclasses import dataclass

from planetserve.node.routing.balance import LoadReport
from planetserve.node.routing.cachesync import CacheSync, SyncConfig
from planetserve.node.routing.sentry import Sentry, SentryConfig

KEY = b"bench-group-key-0123456789abcdef"
STEP = 0.05
SYSTEM_LEN = 512
EPS = 1e-6  # simulated times are sums of 0.05: intervals a hair shorter fire on the intended step


@dataclass
class Result:
    nodes: int
    mode: str
    messages: float
    encoded: float
    sent: float
    sender_ms: float
    receiver_ms: float
    converged: bool


def config(mode: str) -> SyncConfig:
    if mode == "delta":
        return SyncConfig(batch_interval=0.1 - EPS, snapshot_interval=5.0 - EPS)
    return SyncConfig(batch_interval=1e9, snapshot_interval=0.1 - EPS)  # snapshots only


class Workload:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.systems = [self.tokens(SYSTEM_LEN) for _ in range(8)]

    def tokens(self, n: int) -> list[int]:
        return self.rng.choices(range(50_000), k=n)

    def prompt(self) -> list[int]:
        return self.rng.choice(self.systems) + self.tokens(self.rng.randrange(64, 513))


def simulate(n: int, mode: str, seconds: float, rate: float, capacity: int, seed: int) -> Result:
    work = Workload(seed)
    plan = SentryConfig().plan_for([SYSTEM_LEN], version=1, origin="bench")
    nodes = []
    for i in range(n):
        sentry = Sentry(f"n{i}")
        sentry.adopt(plan)
        nodes.append(CacheSync(f"n{i}", KEY, sentry=sentry, config=config(mode), incarnation=i + 1))
        nodes[-1].load = LoadReport(0.5, 2, 8)
    receiver = nodes[0]
    for node in nodes[1:]:
        receiver.add_peer(node.node_id, now=0.0, trusted=True)
    held: list[deque[list[int]]] = [deque() for _ in nodes]
    for node, cache in zip(nodes, held, strict=True):
        for _ in range(capacity):
            prompt = work.prompt()
            node.stored(prompt)
            cache.append(prompt[: SYSTEM_LEN + 1])

    def deliver(node: CacheSync, now: float, measure: bool) -> tuple[int, int, float, float]:
        t0 = time.process_time()
        messages = node.poll(now)
        send_cpu = time.process_time() - t0
        recv_cpu = 0.0
        if node is not receiver:
            t0 = time.process_time()
            for data in messages:
                receiver.receive(node.node_id, data, now)
            recv_cpu = time.process_time() - t0
        return len(messages), sum(map(len, messages)), send_cpu if measure else 0.0, recv_cpu

    for node in nodes:  # start-up snapshots, not measured
        deliver(node, 0.0, False)
    steps = round(seconds / STEP)
    messages = encoded = 0
    sender_cpu = receiver_cpu = 0.0
    due = 0.0
    for k in range(1, steps + 1):
        now = k * STEP
        due += rate * STEP
        arrivals = int(due)
        due -= arrivals
        for node, cache in zip(nodes, held, strict=True):
            for _ in range(arrivals):
                prompt = work.prompt()
                node.stored(prompt)
                cache.append(prompt[: SYSTEM_LEN + 1])
                node.removed(cache.popleft())
            count, size, send_cpu, recv_cpu = deliver(node, now, True)
            messages += count
            encoded += size
            sender_cpu += send_cpu
            receiver_cpu += recv_cpu
    for node in nodes:  # let the last batches out
        deliver(node, steps * STEP + 0.1, False)
    converged = all(receiver.tree.paths(node.node_id) == set(node.local.paths()) for node in nodes[1:])
    per = n * seconds
    return Result(n, mode, messages / per, encoded / per, encoded / per * (n - 1), sender_cpu / per * 1000,
                  receiver_cpu / seconds * 1000, converged)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="8,16,50")
    parser.add_argument("--rate", type=float, default=20.0, help="requests (insertions and evictions) per "
                        "node per second")
    parser.add_argument("--capacity", type=int, default=200, help="prompts each node's cache holds")
    parser.add_argument("--seconds", type=float, default=10.0, help="simulated seconds for delta mode "
                        "(full mode runs a fifth of it: its cost is the same every 100 ms)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    print(f"{args.rate:g} insertions + {args.rate:g} evictions per node per second; {args.capacity} cached "
          "prompts per node; per node per second:")
    print(f"{'nodes':>5} {'mode':>5} {'msgs':>6} {'encoded B':>10} {'sent B':>11} {'sender ms':>10} "
          f"{'receiver ms':>12} {'total ms':>9} {'views ok':>9}")
    for n in (int(x) for x in args.nodes.split(",")):
        results = {}
        for mode, seconds in (("delta", args.seconds), ("full", args.seconds / 5)):
            r = results[mode] = simulate(n, mode, seconds, args.rate, args.capacity, args.seed)
            ok = "yes" if r.converged else "NO"
            print(f"{n:>5} {mode:>5} {r.messages:6.1f} {r.encoded:10.0f} {r.sent:11.0f} {r.sender_ms:10.2f} "
                  f"{r.receiver_ms:12.2f} {r.sender_ms + r.receiver_ms:9.2f} {ok:>9}")
        d, f = results["delta"], results["full"]
        total = (f.sender_ms + f.receiver_ms) / (d.sender_ms + d.receiver_ms)
        print(f"{n:>5} {'full/delta':>11}: bytes x{f.sent / d.sent:.1f}, sender CPU "
              f"x{f.sender_ms / d.sender_ms:.1f}, receiver CPU x{f.receiver_ms / d.receiver_ms:.1f}, "
              f"total CPU x{total:.1f}")


if __name__ == "__main__":
    main()
