"""The vLLM logits processor's tensor work on a GPU (planetserve.node.engine.vllm_sampling and
planetserve.sampling; vLLM itself is not needed): is the batched noise on the device bit-equal to the per-row
specification on the same device, how far is it from the CPU's (the specification allows an ulp of the
float64 logarithm), does every row's argmax match `sample` on the CPU, and what does one `apply` cost in
time and memory at serving sizes (a 152k vocabulary, up to 256 sampled rows of float32 logits, as
vLLM's sampler holds them).

    python bench/vllm_sampling_gpu.py [--device cuda] [--vocab 152064] [--rows 1 8 64 256] [--chunks 22 24]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from planetserve import sampling
from planetserve.node.engine.vllm_sampling import XARG_SEED, XARG_TEMPERATURE, RowTable
from planetserve.sampling import SEED_LIMIT, gumbel_row, gumbel_rows, noised_logits, sample


class _Params:
    def __init__(self, temperature: float, seed: int) -> None:
        self.extra_args = {XARG_TEMPERATURE: temperature, XARG_SEED: seed}


class _Update:
    def __init__(self, rows: int, outputs: list[list[int]], rng: random.Random) -> None:
        self.batch_size, self.removed, self.moved = rows, [], []
        self.added = [(s, _Params(rng.choice([0.3, 0.7, 1.0, 1.5]), rng.randrange(SEED_LIMIT)), None,
                       outputs[s]) for s in range(rows)]


def exactness(device: str, vocab: int, rows: int) -> dict[str, object]:
    rng = random.Random(1)
    seeds = [rng.randrange(SEED_LIMIT) for _ in range(rows)]
    positions = [rng.randrange(8192) for _ in range(rows)]
    batched = gumbel_rows(seeds, positions, vocab, device)
    same_device = all(torch.equal(batched[r], gumbel_row(seeds[r], positions[r], vocab, device))
                      for r in range(rows))
    cpu = gumbel_rows(seeds, positions, vocab, "cpu")
    out: dict[str, object] = {"rows": rows, "vocab": vocab, "batched_equals_per_row_on_device": same_device,
                              "values_differing_from_cpu": int((batched.cpu() != cpu).sum()),
                              "max_abs_difference_from_cpu": (batched.cpu() - cpu).abs().max().item()}
    agree = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        generator = torch.Generator().manual_seed(2)
        logits = (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)
        temps = [rng.choice([0.0, 0.5, 0.7, 1.0, 1.3]) for _ in range(rows)]
        picked = noised_logits(logits.to(device), temps, seeds, positions).argmax(-1).tolist()
        expected = [sample(logits[r], temps[r], seeds[r], positions[r]) for r in range(rows)]
        agree[str(dtype)] = sum(p == e for p, e in zip(picked, expected, strict=True)) / rows
    out["argmax_agrees_with_cpu_sample"] = agree
    return out


def cost(device: str, vocab: int, rows: int, repeats: int = 20) -> dict[str, object]:
    rng = random.Random(rows)
    outputs = [[0] * rng.randrange(512) for _ in range(rows)]
    table = RowTable()
    table.update(_Update(rows, outputs, rng))
    logits = torch.randn(rows, vocab, device=device)
    work = logits.clone()
    table.apply(work)  # warm-up
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        work.copy_(logits)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        table.apply(work)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        for o in outputs:
            o.append(1)
    median = sorted(times)[len(times) // 2]
    out: dict[str, object] = {"rows": rows, "vocab": vocab, "median_ms": 1000 * median}
    if device.startswith("cuda"):
        out["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=152_064)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--chunks", type=int, nargs="+", default=[22, 24],
                        help="log2 of CHUNK_ELEMENTS to time (the module's default is 22)")
    args = parser.parse_args()
    report: dict[str, object] = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "exactness": exactness(args.device, 32_000, 64)}
    for chunk in args.chunks:
        sampling.CHUNK_ELEMENTS = 1 << chunk
        report[f"cost_chunk_2^{chunk}"] = [cost(args.device, args.vocab, rows) for rows in args.rows]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
