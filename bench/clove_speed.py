"""(n, k) S-IDA clove speed against the paper's section 5.2 (ToolBench prompts of about 7k tokens:
preparation 0.273 ms mean, 0.280 P50; decryption 0.302 ms mean, 0.309 P50).

The paper's prompt size is taken as 7,206 tokens x 4 bytes per token of English text = 28,824 bytes;
1 KiB and 256 KiB bracket it. Every iteration splits a fresh random message.

- prepare: split (encrypt, disperse, share the key) and encode all n cloves to bytes, as the senders
  do (`split_encoded`; `split` then `encode` in a module without it).
- recover: decode k cloves from bytes, feed them to a long-lived Reassembler, which joins and decrypts.
  "first k" gets cloves 1..k (the systematic fragments: no erasure decoding); "lost 1" gets 2..n,
  so the Reed-Solomon decoder runs, the worst case for one lost path at (4, 3).

With `--baseline REV` the S-IDA module of that commit (read from git) is timed too, in the same run,
its iterations interleaved with the current module's, and the table gains its rows and the ratio.

    .venv/bin/python bench/clove_speed.py [--iterations 2000] [--n 4] [--k 3] [--baseline REV]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path

from machine import describe

from planetserve.node.overlay import sida

MODULE_PATH = "planetserve/node/overlay/sida.py"

TOOLUSE_TOKENS = 7206
BYTES_PER_TOKEN = 4
TOOLUSE_BYTES = TOOLUSE_TOKENS * BYTES_PER_TOKEN
SIZES = {"1 KiB": 1024, f"ToolUse {TOOLUSE_BYTES:,} B": TOOLUSE_BYTES, "256 KiB": 256 * 1024}
PAPER_MS = {"prepare": 0.273, "recover": 0.302}
TARGET_SPEEDUP = 5.0
ROW = "{:<21} {:>8} {:<26} {:>8} {:>8} {:>8} {:>9}"


def baseline_module(rev: str, directory: Path) -> types.ModuleType:
    """The S-IDA module as it was at commit `rev` (written into `directory`), loaded under its own name
    beside the current one."""
    root = Path(__file__).resolve().parent.parent
    shown = subprocess.run(["git", "show", f"{rev}:{MODULE_PATH}"], cwd=root, check=True,
                           capture_output=True, text=True)
    path = directory / f"sida_{rev}.py"
    path.write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up while a class is made
    spec.loader.exec_module(module)
    return module


def prepare(impl: types.ModuleType, message: bytes, n: int, k: int) -> list[bytes]:
    """What a sender does: the n cloves' wire bytes (`split_encoded` where the module has it)."""
    if hasattr(impl, "split_encoded"):
        return impl.split_encoded(message, n, k)
    return [impl.encode(c) for c in impl.split(message, n, k)]


def recover(reassembler: sida.Reassembler, raw: Sequence[bytes]) -> bytes | None:
    result = None
    for data in raw:
        result = reassembler.add(data)
    return result


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    value = fn()
    return (time.perf_counter() - t0) * 1e3, value


def measure(impls: dict[str, types.ModuleType], size: int, n: int, k: int, iterations: int,
            warmup: int) -> dict[str, dict[str, list[float]]]:
    """Per-iteration milliseconds of preparation and of both recovery cases, for each implementation,
    their iterations interleaved."""
    reassemblers = {name: impl.Reassembler() for name, impl in impls.items()}
    samples = {name: {"prepare": [], "recover first k": [], "recover lost 1": []} for name in impls}
    for i in range(warmup + iterations):
        message = os.urandom(size)
        for name, impl in impls.items():
            ms, raw = timed(lambda m=message, s=impl: prepare(s, m, n, k))
            first_ms, first = timed(lambda r=raw, a=reassemblers[name]: recover(a, r[:k]))
            again = prepare(impl, message, n, k)
            lost_ms, lost = timed(lambda r=again, a=reassemblers[name]: recover(a, r[n - k :]))
            assert first == message and lost == message
            if i >= warmup:
                samples[name]["prepare"].append(ms)
                samples[name]["recover first k"].append(first_ms)
                samples[name]["recover lost 1"].append(lost_ms)
    return samples


def stats(values: list[float]) -> tuple[float, float, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return statistics.fmean(values), cuts[49], cuts[98]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--n", type=int, default=sida.DEFAULT_N)
    parser.add_argument("--k", type=int, default=sida.DEFAULT_K)
    parser.add_argument("--baseline", metavar="REV", help="also time the S-IDA module of this commit")
    args = parser.parse_args()

    impls = {"current": sida}
    if args.baseline:
        with tempfile.TemporaryDirectory() as directory:  # the module is loaded once read
            impls[args.baseline] = baseline_module(args.baseline, Path(directory))
    print(f"machine: {describe()}")
    print(f"(n, k) = ({args.n}, {args.k}), {args.iterations} iterations after {args.warmup} warm-up")
    print(ROW.format("message", "clove B", "operation", "mean ms", "P50 ms", "P99 ms", "vs paper"))
    worst = float("inf")
    means: dict[tuple[str, str], float] = {}
    for label, size in SIZES.items():
        clove_bytes = len(prepare(sida, bytes(size), args.n, args.k)[0])
        measured = measure(impls, size, args.n, args.k, args.iterations, args.warmup)
        for name, operations in measured.items():
            for operation, values in operations.items():
                mean, p50, p99 = stats(values)
                ratio = ""
                if size == TOOLUSE_BYTES:
                    speedup = PAPER_MS[operation.split()[0]] / mean
                    means[(name, operation)] = mean
                    if name == "current":
                        worst = min(worst, speedup)
                    ratio = f"{speedup:.1f}x"
                shown = operation if name == "current" else f"{operation} ({name})"
                print(ROW.format(label, clove_bytes, shown, f"{mean:.4f}", f"{p50:.4f}", f"{p99:.4f}", ratio))
    verdict = "met" if worst >= TARGET_SPEEDUP else "NOT met"
    print(
        f"paper (ToolUse): prepare {PAPER_MS['prepare']} ms mean, recover {PAPER_MS['recover']} ms mean; "
        f"slowest speedup {worst:.1f}x, target {TARGET_SPEEDUP:.0f}x {verdict}"
    )
    if args.baseline:
        print("ToolUse, current against " + args.baseline + ": " + ", ".join(
            f"{op} {means[(args.baseline, op)] / means[('current', op)]:.2f}x faster"
            for op in ("prepare", "recover first k", "recover lost 1")))


if __name__ == "__main__":
    main()
