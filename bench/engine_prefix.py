"""Built-in engine: what a prefix-cache hit saves, what continuous batching buys, and per-token costs.

Time to first token of a prompt sharing 75% of its tokens with one already served, against the same
prompt on a cold engine; decode throughput of b concurrent requests against the same requests one at
a time; then the per-token costs `measure_costs` gives a simulator. The model is a random Llama.

    .venv/bin/python bench/engine_prefix.py [--hidden 256] [--layers 4] [--lengths 256 512 1024]
"""

from __future__ import annotations

import argparse

import torch

from planetserve.node.engine.profile import decode_throughput, measure_costs, prefix_hit_ttft, random_llama


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--shared", type=float, default=0.75, help="fraction of the prompt already cached")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = random_llama(
        vocab_size=args.vocab, hidden_size=args.hidden, layers=args.layers, heads=args.heads,
        kv_heads=args.kv_heads, max_len=max(args.lengths) + args.new_tokens,
    )
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"random Llama: {params:.1f}M parameters, {args.layers} layers, hidden {args.hidden}, "
          f"{torch.get_num_threads()} torch threads, float32 on CPU\n")

    print(f"time to first token, {args.shared:.0%} of the prompt cached (median of {args.repeats})")
    print(f"{'prompt':>7} {'computed':>9} {'cold ms':>9} {'hit ms':>9} {'speedup':>8}")
    for row in prefix_hit_ttft(model, args.lengths, shared=args.shared, repeats=args.repeats):
        print(f"{row['prompt_tokens']:>7} {row['computed_on_hit']:>9} {row['cold_ms']:>9.1f} "
              f"{row['hit_ms']:>9.1f} {row['cold_ms'] / row['hit_ms']:>7.2f}x")

    print(f"\ndecode throughput, {args.new_tokens} new tokens per request")
    print(f"{'batch':>7} {'batched tok/s':>14} {'sequential tok/s':>17} {'ratio':>7}")
    for row in decode_throughput(model, args.batches, new_tokens=args.new_tokens):
        print(f"{row['batch']:>7} {row['batched_tok_s']:>14.0f} {row['sequential_tok_s']:>17.0f} "
              f"{row['batched_tok_s'] / row['sequential_tok_s']:>6.2f}x")

    costs = measure_costs(model, prompt_lens=args.lengths, batch_sizes=args.batches, repeats=args.repeats)
    print("\nper-token costs (measure_costs)")
    for length, ms in costs["prefill_ms_per_token"].items():
        print(f"  prefill, {length:>5}-token prompt: {ms:7.3f} ms/token")
    for batch in args.batches:
        print(f"  decode, batch {batch:>2}: {costs['decode_ms_per_step'][batch]:7.3f} ms/step, "
              f"{costs['decode_ms_per_token'][batch]:7.3f} ms/token")


if __name__ == "__main__":
    main()
