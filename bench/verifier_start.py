"""How long a verifier daemon takes to start, step by step, with the corpus cache empty (a first start)
and filled (every later one: a restart, which for an epoch's leader must come back within its plan
window), every round a fresh process as a restart is, the two kinds alternating.

The steps are `build_daemon`'s, less the ledger (which needs a network; 0.1-0.2 s in the network test):
the imports, the reference models (transformers and the checkpoint), and the workload generator's
warm-up, which builds the corpus its prompts come from.

    .venv/bin/python bench/verifier_start.py [--data-dir localnet/build] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from planetserve.models import DATA_ENV

STEPS = ("imports", "models", "workload", "total")
ROW = "{:<22} {:>9} {:>9} {:>9} {:>9}"


def one_start(data_dir: str) -> dict[str, float]:
    """The steps of one start in this process (run in a fresh one)."""
    began = time.monotonic()
    from planetserve.verifier.config import VerifierConfig
    from planetserve.verifier.runner import challenge_source, reference_models

    imported = time.monotonic()
    config = VerifierConfig(keys="unused: no ledger is opened", data_dir=data_dir)
    references = reference_models(config)
    loaded = time.monotonic()
    with tempfile.TemporaryDirectory() as home:
        challenge_source(config, Path(home), references)
    done = time.monotonic()
    return {"imports": imported - began, "models": loaded - imported, "workload": done - loaded,
            "total": done - began}


def run(data_dir: str, cache: Path) -> dict[str, float]:
    env = {**os.environ, DATA_ENV: str(cache)}  # the corpus cache is the data directory's
    out = subprocess.run([sys.executable, __file__, "--one", "--data-dir", data_dir], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="localnet/build",
                        help="where the model family is (train it with `planetserve models train --only gt`)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_start(args.data_dir)))
        return
    if not (Path(args.data_dir) / "models" / "gt").is_dir():
        sys.exit(f"no gt model under {args.data_dir}/models: run "
                 f"`.venv/bin/planetserve models train --only gt --data-dir {args.data_dir}` first")
    samples: dict[str, list[dict[str, float]]] = {"empty cache": [], "filled cache": []}
    with tempfile.TemporaryDirectory() as directory:
        filled = Path(directory) / "filled"
        run(args.data_dir, filled)  # fills it
        for i in range(args.rounds):
            with tempfile.TemporaryDirectory() as empty:
                samples["empty cache"].append(run(args.data_dir, Path(empty)))
            samples["filled cache"].append(run(args.data_dir, filled))
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"median seconds over {args.rounds} starts, each in a fresh process, the two kinds alternating")
    print(ROW.format("corpus cache", *STEPS))
    medians = {name: {step: statistics.median(s[step] for s in runs) for step in STEPS}
               for name, runs in samples.items()}
    for name, values in medians.items():
        print(ROW.format(name, *(f"{values[step]:.2f}" for step in STEPS)))
    cold, warm = medians["empty cache"], medians["filled cache"]
    print(f"filled against empty: workload {cold['workload'] / warm['workload']:.1f}x faster, "
          f"the whole start {cold['total'] / warm['total']:.2f}x faster")


if __name__ == "__main__":
    main()
