"""What decoding a transaction costs the app, with the container bound (`tx.max_containers`, as
`tx.decode` passes it to `codec.unpack`) and without it, side by side in one process, rounds interleaved:

- junk: a heartbeat whose body is 15,800 empty lists (16 KB), the old CheckTx flood's; the bound refuses
  it after its first max_containers(size) containers, where the decoder alone builds and re-encodes all;
- densest junk: as many empty lists as the bound admits for the byte limit, padded to it (what a flood
  can still send; both decode it whole);
- register-user: valid registrations (`tx_throughput.planetserve_txs`, each of its own fresh key), the
  common transaction, whose random keys and signature hold bytes that could start a container.

    .venv/bin/python bench/tx_decode.py [--seconds 0.5] [--users 2000]   (five rounds each way)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from planetserve.chain import tx as txlib
from planetserve.chain.keys import KeySet
from planetserve.registry import codec
from planetserve.registry.params import Params

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.tx_throughput import planetserve_txs  # noqa: E402

CHAIN = "bench"
MAX_TX = Params().max_tx_bytes
ROUNDS = 5


def cases(keys: KeySet, users: int) -> dict[str, list[bytes]]:
    lists = txlib.max_containers(MAX_TX) - 3  # the envelope, the body, the list of lists
    probe = txlib.build(keys, CHAIN, "heartbeat", {"junk": [[]] * lists, "pad": bytes(1_000)}, 1)
    dense = txlib.build(keys, CHAIN, "heartbeat",
                        {"junk": [[]] * lists, "pad": bytes(1_000 + MAX_TX - len(probe))}, 1)
    return {"junk (15,800 lists)": [txlib.build(keys, CHAIN, "heartbeat", {"junk": [[]] * 15_800}, 1)],
            "densest junk": [dense], "register-user": planetserve_txs(users, CHAIN)}


def bounded(raw: bytes) -> None:
    with contextlib.suppress(codec.LimitExceeded):
        codec.unpack(raw, max_size=MAX_TX, max_containers=txlib.max_containers(len(raw)))


def unbounded(raw: bytes) -> None:
    """Wrapped as `bounded` is, so the two differ by the bound alone."""
    with contextlib.suppress(codec.LimitExceeded):
        codec.unpack(raw, max_size=MAX_TX)


def mean_us(fn: Callable[[bytes], None], raws: list[bytes], seconds: float) -> float:
    """Microseconds per decode over passes through `raws` for at least `seconds` (a microsecond is too
    short to time one decode at a time)."""
    done, t0 = 0, time.perf_counter()
    while (spent := time.perf_counter() - t0) < seconds:
        for raw in raws:
            fn(raw)
        done += len(raws)
    return spent / done * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=0.5, help="time per round of each way")
    parser.add_argument("--users", type=int, default=2_000, help="distinct register-user transactions")
    args = parser.parse_args()
    print(f"{'transaction':22} {'bytes':>6} {'containers':>10}  {'bound':>5}  {'decoder alone us':>16} "
          f"{'with the bound us':>17}  {'alone / bound':>13}")
    for name, raws in cases(KeySet.generate(), args.users).items():
        raw = raws[0]
        held = _containers(codec.unpack(raw, max_size=MAX_TX))
        alone, with_bound = [], []
        for _ in range(ROUNDS):  # interleaved; the median round of each
            alone.append(mean_us(unbounded, raws, args.seconds))
            with_bound.append(mean_us(bounded, raws, args.seconds))
        a, b = statistics.median(alone), statistics.median(with_bound)
        print(f"{name:22} {len(raw):6} {held:10}  {txlib.max_containers(len(raw)):5}  {a:16.1f} {b:17.1f}  "
              f"{a / b:12.2f}x")


def _containers(value: object) -> int:
    if isinstance(value, list):
        return 1 + sum(map(_containers, value))
    if isinstance(value, dict):
        return 1 + sum(map(_containers, value.values()))
    return 0


if __name__ == "__main__":
    main()
