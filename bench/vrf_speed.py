"""ECVRF (RFC 9381, edwards25519-SHA512-TAI) speed: public_key, prove, verify and proof_to_hash.

Leader election needs, per epoch, one prove by each committee member and one verify of each member's
proof by every validator. The last line sets that verify cost against an epoch's length on one core.
Each operation gets a fresh random key and alpha per iteration (prove and verify take the same ones).

    .venv/bin/python bench/vrf_speed.py [--iterations 200] [--members 4] [--epoch-blocks 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from planetserve.chain import vrf


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--members", type=int, default=4, help="committee size")
    parser.add_argument("--epoch-blocks", type=int, default=100)
    parser.add_argument("--block-seconds", type=float, default=1.0)
    args = parser.parse_args()

    cases = []
    for _ in range(args.iterations):
        secret, alpha = os.urandom(32), os.urandom(32)
        cases.append((secret, vrf.public_key(secret), alpha, vrf.prove(secret, alpha)))
    samples: dict[str, list[float]] = {"public_key": [], "prove": [], "verify": [], "proof_to_hash": []}
    for secret, public, alpha, pi in cases:
        samples["public_key"].append(timed(lambda s=secret: vrf.public_key(s)))
        samples["prove"].append(timed(lambda s=secret, a=alpha: vrf.prove(s, a)))
        samples["verify"].append(timed(lambda y=public, p=pi, a=alpha: vrf.verify(y, p, a)))
        samples["proof_to_hash"].append(timed(lambda p=pi: vrf.proof_to_hash(p)))

    print(f"{'operation':14} {'iterations':>10} {'mean ms':>9} {'p95 ms':>9} {'ops/s':>9}")
    for name, times in samples.items():
        mean = statistics.fmean(times)
        p95 = statistics.quantiles(times, n=20)[-1] if len(times) > 1 else times[0]
        print(f"{name:14} {len(times):>10} {mean * 1000:9.3f} {p95 * 1000:9.3f} {1 / mean:9.0f}")

    verify_ms = statistics.fmean(samples["verify"]) * 1000 * args.members
    epoch_s = args.epoch_blocks * args.block_seconds
    print(
        f"a {args.members}-member election costs {verify_ms:.2f} ms of verify per validator per epoch; "
        f"at an epoch of {args.epoch_blocks} blocks of {args.block_seconds:g} s that is "
        f"{verify_ms / 10 / epoch_s:.4f}% of one core (each member also proves once: "
        f"{statistics.fmean(samples['prove']) * 1000:.2f} ms)"
    )


if __name__ == "__main__":
    main()
