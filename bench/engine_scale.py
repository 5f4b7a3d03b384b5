"""The built-in engine at the sizes it is for: Llama shapes from Hugging Face configs (0.5B to 8B) with
random weights, built on the device (no download), served end to end through BuiltinEngine.

For each shape:
- time to first token of an uncached prompt and of one whose first 75% the prefix cache holds;
- decode throughput of b concurrent requests, against the same requests one at a time (small b only);
- what a long prompt's arrival costs the requests already decoding: the longest gap between their
  tokens while it is prefilled in chunks of 512 against in one forward (the chunked prefill).

On a GPU the model is bf16 with SDPA attention; on a CPU float32 at reduced counts (`--quick`).

    python bench/engine_scale.py [--device cuda] [--shapes 1b 8b] [--json FILE] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import describe  # noqa: E402
from planetserve.node.engine.profile import (  # noqa: E402
    SHAPES,
    decode_throughput,
    params,
    prefill_stall,
    prefix_hit_ttft,
    sized_llama,
)

CHUNK = 512


def plan(device: str, quick: bool) -> dict[str, object]:
    """What to measure: a GPU takes serving-size prompts and batches, a CPU a tenth of the work."""
    if device == "cuda" and not quick:
        return {"prompts": (512, 2048, 4096), "batches": (1, 8, 32), "new_tokens": 64, "sequential_up_to": 8,
                "long": 4096, "running": 8}
    return {"prompts": (128, 512), "batches": (1, 4), "new_tokens": 16, "sequential_up_to": 4,
            "long": 1024, "running": 2}


def measure(shape: str, device: str, quick: bool) -> dict[str, object]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    steps = plan(device, quick)
    t0 = time.perf_counter()
    model = sized_llama(shape, device=device, dtype=dtype)
    built = time.perf_counter() - t0
    ttft = prefix_hit_ttft(model, steps["prompts"], repeats=3)
    decode = decode_throughput(model, steps["batches"], prompt_len=128, new_tokens=steps["new_tokens"],
                               sequential_up_to=steps["sequential_up_to"])
    stalls = [prefill_stall(model, long_len=steps["long"], chunk=chunk, running=steps["running"])
              for chunk in (CHUNK, steps["long"])]
    result = {"shape": shape, "params": params(model), "dtype": str(dtype).removeprefix("torch."),
              "build_s": built, "ttft": ttft, "decode": decode, "stall": stalls}
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def report(result: dict[str, object]) -> None:
    print(f"\n## {result['shape']}: {result['params'] / 1e9:.2f}B parameters, {result['dtype']}, "
          f"built in {result['build_s']:.1f} s")
    print(f"{'prompt':>8} {'cold TTFT ms':>13} {'75% hit TTFT ms':>16} {'hit/cold':>9}")
    for row in result["ttft"]:
        print(f"{row['prompt_tokens']:>8} {row['cold_ms']:>13.1f} {row['hit_ms']:>16.1f} "
              f"{row['hit_ms'] / row['cold_ms']:>9.2f}")
    print(f"{'batch':>8} {'batched tok/s':>14} {'one at a time':>14} {'ratio':>7}")
    for row in result["decode"]:
        ratio = row["batched_tok_s"] / row["sequential_tok_s"]
        print(f"{row['batch']:>8} {row['batched_tok_s']:>14.1f} {row['sequential_tok_s']:>14.1f} "
              f"{ratio:>7.2f}")
    chunked, whole = result["stall"]
    gain = whole["longest_gap_ms"] / max(chunked["longest_gap_ms"], 1e-9)
    print(f"long prompt of {chunked['long_tokens']} tokens arriving: longest gap of a running request "
          f"{chunked['longest_gap_ms']:.1f} ms chunked ({chunked['chunk']}) vs {whole['longest_gap_ms']:.1f} "
          f"ms in one forward ({gain:.1f}x); its own TTFT {chunked['long_ttft_ms']:.0f} vs "
          f"{whole['long_ttft_ms']:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None)
    parser.add_argument("--quick", action="store_true", help="CPU-sized counts on any device")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    shapes = args.shapes or (["1b", "8b"] if args.device == "cuda" else ["0.5b"])
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    machine = describe()
    print(f"# built-in engine at real sizes, random weights, on {where} (torch {torch.__version__}); "
          f"machine: {machine}")
    results = []
    for shape in shapes:
        results.append(measure(shape, args.device, args.quick))
        report(results[-1])
    if args.json:
        args.json.write_text(json.dumps({"device": where, "machine": machine, "torch": torch.__version__,
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
