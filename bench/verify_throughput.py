"""Verification throughput of one verifier with the built-in scoring engine: verifications per minute,
the one-pass engine (batched, and one response at a time) against the paper's Algorithm 3 on the same
model in the same run, every response 100 tokens.

- gt: the family's reference model (trained; `planetserve models train` builds it), answering chat
  questions by sampling at temperature 1 (the protocol's seeded sampler, answer i under seed i) with stop
  tokens held off until 100 tokens.
- random Llama: a few hundred million parameters from `LlamaConfig`, RANDOM WEIGHTS, scored for speed only
  (its credibilities mean nothing); random prompt and response ids.

A verification here is scoring one response (`Scorer.score`); the checks before it (signature,
detokenisation, prompt tokenisation) are timed separately on gt. The paper's anchor (section 5.5) is
20.72 verifications/min on an A100 (40 GB) and 45.04 on a GH200 for an 8B model: a comparison across
hardware and model size, not like for like. The one-pass engine's target is at least 20x Algorithm 3,
judged one response at a time (batching only widens the gap).

    .venv/bin/python bench/verify_throughput.py [--quick] [--responses 32] [--batch 16] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList

from planetserve.chain.challenge import sign_response
from planetserve.chain.keys import KeySet
from planetserve.models import LoadedModel, load
from planetserve.node.engine.base import GenerationRequest
from planetserve.node.engine.builtin import BuiltinEngine
from planetserve.node.engine.profile import params
from planetserve.sampling import GumbelProcessor
from planetserve.verifier import Algorithm3Scorer, Answer, Decoding, OnePassScorer, Pair, ReferenceModel

RESPONSE_TOKENS = 100
TARGET_SPEEDUP = 20.0
PAPER_PER_MIN = {"A100": 20.72, "GH200": 45.04}
TOPICS = ["json.dumps", "os.path.join", "str.split", "re.compile", "math.sqrt", "random.shuffle",
          "collections.Counter", "itertools.chain", "functools.lru_cache", "pathlib.Path.glob",
          "subprocess.run", "datetime.datetime.strptime", "heapq.heappush", "shutil.copytree",
          "logging.getLogger", "argparse.ArgumentParser.add_argument"]
ROW = "{:<14} {:<12} {:>5} {:>6} {:>9} {:>10} {:>12}"


def gt_batch(loaded: LoadedModel, count: int) -> tuple[list[Pair], list[Answer]]:
    """Chat prompts and gt's own sampled 100-token answers, also as signed answers for the checks."""
    reference = ReferenceModel.from_loaded(loaded)
    keys = KeySet.generate()
    pairs, answers = [], []
    for i in range(count):
        prompt = loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What does {TOPICS[i % len(TOPICS)]}() do?"}], tokenize=False,
            add_generation_prompt=True)
        ids = reference.prompt_ids(prompt)
        noise = LogitsProcessorList([GumbelProcessor(1.0, i, len(ids))])
        out = loaded.model.generate(
            torch.tensor([ids], device=loaded.model.device), do_sample=False, logits_processor=noise,
            min_new_tokens=RESPONSE_TOKENS, max_new_tokens=RESPONSE_TOKENS,
            eos_token_id=list(loaded.stop_token_ids), pad_token_id=loaded.tokenizer.pad_token_id)
        response = out[0, len(ids):].tolist()
        pairs.append((ids, response))
        text = loaded.tokenizer.decode(response, skip_special_tokens=True)
        signed = sign_response(keys, prompt, response, text, loaded.model_id, 0, "bench:0", 1000, i)
        answers.append(Answer(signed, prompt))
    return pairs, answers


def random_llama(args: argparse.Namespace, device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=4096)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def random_batch(vocab: int, prompt_tokens: int, count: int) -> list[Pair]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(vocab, (prompt_tokens,), generator=generator).tolist(),
             torch.randint(vocab, (RESPONSE_TOKENS,), generator=generator).tolist()) for _ in range(count)]


def rate(score: Callable[[Sequence[Pair]], list[list[float]]], pairs: list[Pair], batch: int
         ) -> tuple[float, list[list[float]]]:
    """Seconds for scoring `pairs` in chunks of `batch`, and the scores; an untimed warm-up first scores the
    first chunk's first few tokens. (Scores come back as Python floats, so the device is done at the end.)"""
    score([(p, r[:4]) for p, r in pairs[:batch]])
    t0 = time.perf_counter()
    scores = [s for i in range(0, len(pairs), batch) for s in score(pairs[i:i + batch])]
    return time.perf_counter() - t0, scores


def generation_seconds(model: torch.nn.Module, pairs: list[Pair], batch: int, device: str) -> float:
    """Seconds the built-in serving engine takes to generate every response's length after its prompt at
    temperature 1 (the protocol's sampling), `batch` sequences decoding together: the node's side."""
    async def generate() -> float:
        engine = BuiltinEngine(model, "bench", max_batch=batch, device=device,
                               max_model_len=max(len(p) + len(r) for p, r in pairs))
        try:
            async def one(i: int, prompt: Sequence[int], response: Sequence[int]) -> None:
                request = GenerationRequest(tuple(prompt), len(response), 1.0, i)
                async for _ in engine.generate(request):
                    pass
            t0 = time.perf_counter()
            await asyncio.gather(*(one(i, p, r) for i, (p, r) in enumerate(pairs)))
            return time.perf_counter() - t0
        finally:
            await engine.close()

    return asyncio.run(generate())


def checking_seconds(model: torch.nn.Module, pairs: list[Pair], batch: int) -> float:
    """Seconds the one-pass engine takes to check every token of the responses as sampled at temperature 1
    (log-probabilities and shortfalls under each seed: the whole distribution at every position)."""
    scorer = OnePassScorer(model, max_batch_tokens=1 << 30, max_scored_tokens=1 << 30)
    scorer.score_choices(pairs[:1], [Decoding(1.0, 0)])
    t0 = time.perf_counter()
    for i in range(0, len(pairs), batch):
        chunk = pairs[i:i + batch]
        scorer.score_choices(chunk, [Decoding(1.0, i + k) for k in range(len(chunk))])
    return time.perf_counter() - t0


def run(label: str, model: torch.nn.Module, pairs: list[Pair], args: argparse.Namespace) -> float:
    """Print the rows of one model and the node's cost per generated token against the verifier's per
    checked token; return the one-at-a-time one-pass speedup over Algorithm 3."""
    one_pass = OnePassScorer(model, max_batch_tokens=1 << 30, max_scored_tokens=1 << 30)
    alg3_seconds, alg3_scores = rate(Algorithm3Scorer(model).score, pairs[: args.alg3_responses], 1)
    alg3_rate = 60 * len(alg3_scores) / alg3_seconds
    rates, batched = [], []
    for batch, subset in ((args.batch, pairs), (1, pairs[: args.single_responses])):
        seconds, scores = rate(one_pass.score, subset, batch)
        batched = batched or scores
        rates.append(60 * len(subset) / seconds)
        print(ROW.format(label, "one-pass", batch, len(subset), f"{seconds:.2f}", f"{rates[-1]:,.1f}",
                         f"{rates[-1] / alg3_rate:.1f}x"))
    print(ROW.format(label, "Algorithm 3", 1, len(alg3_scores), f"{alg3_seconds:.2f}", f"{alg3_rate:,.1f}",
                     "1.0x"))
    diff = max(abs(a - b) for one, alg3 in zip(batched, alg3_scores, strict=False)
               for a, b in zip(one, alg3, strict=True))
    print(f"{'':<14} max |one-pass - Algorithm 3| log-prob over {len(alg3_scores)} responses: {diff:.1e}")
    tokens = sum(len(r) for _, r in pairs)
    generating = generation_seconds(model, pairs, args.batch, args.device)
    checking = checking_seconds(model, pairs, args.batch)
    print(f"{'':<14} node generates {tokens} tokens in {generating:.2f} s "
          f"({1e3 * generating / tokens:.2f} ms per token, batch {args.batch}); the verifier checks them in "
          f"{checking:.2f} s ({1e3 * checking / tokens:.2f} ms per token): checking is "
          f"{generating / checking:.1f}x faster")
    return rates[-1] / alg3_rate


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer responses and a smaller random Llama")
    parser.add_argument("--data-dir", default=None, help="the family's data directory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--responses", type=int, default=32, help="responses scored by the batched one-pass")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--single-responses", type=int, default=8, help="scored by one-pass one at a time")
    parser.add_argument("--alg3-responses", type=int, default=2, help="scored by Algorithm 3")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="random Llama prompt length")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.quick:
        args.responses, args.batch, args.single_responses, args.alg3_responses = 8, 8, 2, 1
        args.hidden, args.ffn, args.layers, args.heads, args.kv_heads = 512, 2048, 8, 8, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16

    gt = load("gt", args.data_dir, device=args.device)
    pairs, answers = gt_batch(gt, args.responses)
    reference = ReferenceModel.from_loaded(gt)
    t0 = time.perf_counter()
    checked = [reference.check(a) for a in answers]
    check_ms = (time.perf_counter() - t0) * 1e3 / len(answers)
    assert all(isinstance(c, tuple) for c in checked), "gt's own answers must pass the checks"
    llama = random_llama(args, args.device, dtype)
    prompt_lengths = [len(p) for p, _ in pairs]

    print(f"device {args.device}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
          f"responses of {RESPONSE_TOKENS} tokens")
    print(f"gt: {params(gt.model):,} parameters, float32, chat prompts of {min(prompt_lengths)}-"
          f"{max(prompt_lengths)} tokens (median {statistics.median(prompt_lengths):.0f})")
    print(f"random Llama: {params(llama):,} parameters (RANDOM WEIGHTS, speed only), {args.layers} layers, "
          f"hidden {args.hidden}, FFN {args.ffn}, {args.heads}/{args.kv_heads} heads, vocab {args.vocab}, "
          f"{str(dtype).removeprefix('torch.')}, prompts of {args.prompt_tokens} tokens\n")
    print(ROW.format("model", "engine", "batch", "scored", "seconds", "verif/min", "vs Alg. 3"))
    speedups = {"gt": run("gt", gt.model, pairs, args)}
    speedups["random Llama"] = run("random Llama", llama,
                                   random_batch(args.vocab, args.prompt_tokens, args.responses), args)
    print(f"\nchecks before scoring (signature, detokenisation, prompt tokenisation): {check_ms:.2f} ms per "
          f"response on gt")
    for label, speedup in speedups.items():
        verdict = "met" if speedup >= TARGET_SPEEDUP else "NOT met"
        print(f"{label}: one-pass one at a time is {speedup:.1f}x Algorithm 3, "
              f"target {TARGET_SPEEDUP:.0f}x {verdict}")
    print("paper (section 5.5, an 8B model, other hardware): "
          + ", ".join(f"{v} verifications/min on {k}" for k, v in PAPER_PER_MIN.items()))


if __name__ == "__main__":
    main()
