"""The cost of whitewashing, in epochs: how long a cheating model node is listed (serving users, and
cheating on them) against how long it is kept off the list, when it comes back under a fresh key each
time it is punished (docs/threat-model.md, "Whitewashing").

The real Application runs in-process (tests/harness.py, tests/committee.py: a scripted committee of
4 members, epochs of 10 blocks) with the genesis parameters of the chain (reputation α 0.4, β 0.6,
W 5, γ 1/5, τ 0.4, threshold 0.4, initial 0.5) and `probation_epochs` as given. Each run has one
honest node (its own organisation) and one cheating operator. The cheater's key cheats (C(T) = 0.1)
in every epoch it starts on the node list, and answers like the honest node (C(T) = 0.8) in every
epoch it does not, to earn its way back. When its key has been scored and is untrusted at the start
of an epoch (punished), the operator follows its strategy:

- same key: keeps the key and waits until its window clears;
- same organisation, new key: takes the key out of service and registers a fresh one in its
  organisation (the old key is scored C(T) = 0 in the one epoch whose plan still names it);
- new organisation, new key: the same, in an organisation registered for it (organisations are free).

A key registered at the start of an epoch is first challenged in the next one (the plan of the
current epoch was committed before it). Per strategy and probation: the epochs (of `--epochs`) in
which the cheater's key started listed (serving users, cheating), on probation, or past probation but
untrusted; the keys it used (for the whitewashing strategies, one per cycle), the epochs listed and
off the list per key; and the epoch from which the honest new node is listed. Every count is read
from the chain's own state (node list and reputation records) at each epoch's start.

    .venv/bin/python bench/whitewashing.py [--epochs 30] [--probation 0,3,5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from committee import EPOCH_PARAMS, HONEST, Script, honest_epoch, listed  # noqa: E402
from harness import AppHarness, sqlite_url  # noqa: E402

from planetserve.chain.keys import KeySet  # noqa: E402
from planetserve.registry.params import PPM, Params  # noqa: E402

CHEAT, SILENT = 100_000, 0
STRATEGIES = ("same key", "same org, new key", "new org, new key")


@dataclass
class Outcome:
    listed: int = 0
    probation: int = 0
    untrusted: int = 0
    keys: int = 1
    honest_listed_from: int | None = None


class Operator:
    """The cheating operator: its organisation's owner key and its current node key."""

    def __init__(self, s: Script, strategy: str) -> None:
        self.s = s
        self.strategy = strategy
        self.owner = s.owner  # org1, the Script's organisation
        self.org_id = "org1"
        self.key = s.register_node(self.owner, self.org_id)
        self.retired: set[bytes] = set()
        self.cheating = False
        """Whether the current key started this epoch listed, so that it cheats in it."""

    def start_epoch(self, number: int, out: Outcome) -> None:
        """At the start of epoch `number`: whitewash if punished, then count where the key stands."""
        record = self.s.state.reputation(self.key)
        assert record is not None
        if not record.trusted and record.epochs > 0 and self.strategy != "same key":
            self.whitewash(number)
            out.keys += 1
            record = self.s.state.reputation(self.key)
            assert record is not None
        self.cheating = self.key in listed(self.s)
        if self.cheating:
            out.listed += 1
        elif record.probation > 0:
            out.probation += 1
        else:
            out.untrusted += 1

    def whitewash(self, number: int) -> None:
        s = self.s
        ok(s, s.tx(self.owner, "update-model-node", {"node_pubkey": self.key, "status": "inactive"}))
        self.retired.add(self.key)
        if self.strategy == "new org, new key":
            self.owner, self.org_id = KeySet.generate(), f"fresh-{number}"
            ok(s, s.tx(self.owner, "register-org", {"org_id": self.org_id, "name": self.org_id}))
        self.key = s.register_node(self.owner, self.org_id)

    def score(self, node: bytes) -> int:
        """The credibility of the operator's planned `node` this epoch."""
        if node in self.retired:
            return SILENT
        return CHEAT if self.cheating else HONEST


def ok(s: Script, tx: bytes) -> None:
    assert s.block(tx) == [(0, "ok")]


def run(params: Params, strategy: str, epochs: int) -> Outcome:
    with tempfile.TemporaryDirectory() as tmp:
        s = Script(AppHarness(sqlite_url(Path(tmp)), members=4, params=params), nodes=0)
        honest_owner = KeySet.generate()
        ok(s, s.tx(honest_owner, "register-org", {"org_id": "honest", "name": "honest"}))
        honest = s.register_node(honest_owner, "honest")
        cheater = Operator(s, strategy)
        out = Outcome()
        s.run_election_and_plan(1)
        for number in range(1, epochs + 1):
            if out.honest_listed_from is None and honest in listed(s):
                out.honest_listed_from = number
            cheater.start_epoch(number, out)
            scores = {n: HONEST if n == honest else cheater.score(n) for n in s.planned_nodes(number)}
            honest_epoch(s, number, scores)
        s.h.store.close()
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--probation", default="0,3,5", help="probation_epochs values, comma-separated")
    args = parser.parse_args()
    base = replace(EPOCH_PARAMS, probation_epochs=Params().probation_epochs)
    print(f"Whitewashing over {args.epochs} epochs: the cheater cheats (C 0.1) whenever it starts an epoch "
          f"listed, answers honestly (C 0.8) otherwise; reputation α {base.reputation_alpha_ppm / PPM:g}, "
          f"β {base.reputation_beta_ppm / PPM:g}, W {base.reputation_window}, "
          f"γ {base.reputation_gamma_ppm / PPM:g}, threshold {base.untrusted_threshold_ppm / PPM:g}, "
          f"initial {base.initial_reputation_ppm / PPM:g}")
    header = (f"{'probation':>9}  {'strategy':<19} {'listed':>6} {'probation':>9} {'untrusted':>9} "
              f"{'keys':>4} {'listed share':>12} {'listed/key':>10} {'off/key':>7}  honest node listed from")
    print(header)
    print("-" * len(header))
    for probation in (int(p) for p in args.probation.split(",")):
        params = replace(base, probation_epochs=probation)
        for strategy in STRATEGIES:
            out = run(params, strategy, args.epochs)
            off = args.epochs - out.listed
            print(f"{probation:>9}  {strategy:<19} {out.listed:>6} {out.probation:>9} {out.untrusted:>9} "
                  f"{out.keys:>4} {out.listed / args.epochs:>12.2f} {out.listed / out.keys:>10.2f} "
                  f"{off / out.keys:>7.2f}  epoch {out.honest_listed_from}", flush=True)


if __name__ == "__main__":
    main()
