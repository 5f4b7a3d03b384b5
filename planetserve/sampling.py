"""Verifiable sampling: the protocol's Gumbel noise, which makes a sampled answer reproducible by anyone
who holds the model and the request's seed.

A node answering at temperature T > 0 picks token i as

    argmax over the vocabulary v of  logit_i(v) / T + g(seed, i, v)

which is an exact sample of softmax(logit_i / T) (the Gumbel-max trick) when g is standard Gumbel
noise. Here g is a fixed function of (seed, i, v), so the verifier, recomputing the reference's logits
in one pass, checks every token as it checks a greedy one: temperature 0 is the case with no noise.
The noise is keyed by token id, never by rank, so near-ties between engines cannot swap it.

With nucleus truncation (OpenAI's `top_p` = P < 1) the argmax runs over the nucleus only: the tokens
in descending order of softmax(logit_i / T) (ties by ascending id), each kept while the probability of
those before it is below P, so the likeliest always is (`nucleus`). The verifier cannot know an
engine's nucleus to the last ulp, so it bounds it (`shortfalls`).

The specification (docs/architecture.md, "Verifiable sampling", with test vectors):

1. key = BLAKE2b-64(DOMAIN || seed as 8 bytes little-endian || i as 8 bytes little-endian), read as
   two 32-bit little-endian words k0, k1; seed in [0, 2**64), i the index of the token in the response
   (0 for the first generated token).
2. h(v) = fmix32(fmix32(v XOR k0) XOR k1), with fmix32 MurmurHash3's 32-bit finaliser; v is the token
   id. For a fixed key h is a bijection of token ids, so no two tokens share a draw.
3. u = (h + 0.5) / 2**32, in (0, 1); g = -ln(-ln u), in float64.

Step 1 is a scalar per position; steps 2 and 3 vectorise over the vocabulary with 64-bit integer
tensors whose products never overflow (the multiplier is applied in 16-bit halves), so CPU and GPU
compute the same bits, and float64 logarithms that differ between platforms by an ulp at most, far
below any tolerance a verifier applies. `gumbel_rows` and `noise_rows_` do it for many rows at once, as
a batched engine does (vLLM's logits processor, node/engine/vllm_sampling.py; `GumbelProcessor` for
transformers' generate), keeping each row's float64 winner when the logits' own dtype would round it
into a tie.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from transformers import LogitsProcessor

from planetserve.registry.epochs import SEED_LIMIT

DOMAIN = b"planetserve/gumbel/v1"
VECTORS = (
    (0, 0, 0, 1.8071832573863638),
    (0, 0, 1, 0.6966424621228506),
    (1, 0, 12345, -0.978035467627998),
    (42, 7, 1, 2.33903857875884),
    (SEED_LIMIT - 1, 1000, 12345, 2.6106529602381046),
)
"""The specification's test vectors (seed, position, token, g), as docs/architecture.md lists them: any
implementation of the noise, on any device, must reproduce them."""
MASK32 = 0xFFFFFFFF
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35


def position_key(seed: int, position: int) -> tuple[int, int]:
    """(k0, k1): the two 32-bit words keying the noise of one response position."""
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"a seed must lie in [0, 2**64), got {seed}")
    if not 0 <= position < SEED_LIMIT:
        raise ValueError(f"a position must lie in [0, 2**64), got {position}")
    digest = hashlib.blake2b(DOMAIN + seed.to_bytes(8, "little") + position.to_bytes(8, "little"),
                             digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def fmix32(x: int) -> int:
    """MurmurHash3's 32-bit finaliser, on a Python int."""
    x ^= x >> 16
    x = (x * _C1) & MASK32
    x ^= x >> 13
    x = (x * _C2) & MASK32
    return x ^ (x >> 16)


def gumbel(seed: int, position: int, token: int) -> float:
    """The noise of one token at one position: the specification, one value at a time."""
    k0, k1 = position_key(seed, position)
    h = fmix32(fmix32(token ^ k0) ^ k1)
    return -math.log(-math.log((h + 0.5) / 2**32))


def _times(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for x in [0, 2**32), without any intermediate above 2**49."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _times(x, _C1)
    x = x ^ (x >> 13)
    x = _times(x, _C2)
    return x ^ (x >> 16)


def gumbel_row(seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The noise of every token id in [0, vocab_size) at one position, float64 on `device`."""
    return gumbel_rows([seed], [position], vocab_size, device)[0]


# -- many rows at once: what a batched engine (vLLM's logits processor, node/engine/vllm_sampling.py) --
# -- writes into its logits, and what transformers' generate does with GumbelProcessor ------------------

CHUNK_ELEMENTS = 1 << 22
"""At most this many (row, token) pairs are hashed at once (each int64 temporary is then 32 MiB), so a
large batch over a large vocabulary does not claim gigabytes of GPU memory next to a serving engine's
own allocation. On an H100 (bench/vllm_sampling_gpu.py) 256 rows of a 152k vocabulary took 14 ms and
160 MiB at most this way; 2^24 saved a tenth of the time for four times the memory."""


def gumbel_rows(seeds: Sequence[int], positions: Sequence[int], vocab_size: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(seeds), vocab_size] float64 noise: row r is gumbel_row(seeds[r], positions[r], vocab_size)."""
    if len(seeds) != len(positions):
        raise ValueError(f"{len(seeds)} seeds for {len(positions)} positions")
    keys = [position_key(seed, position) for seed, position in zip(seeds, positions, strict=True)]
    k0 = torch.tensor([k[0] for k in keys], dtype=torch.int64, device=device).view(-1, 1)
    k1 = torch.tensor([k[1] for k in keys], dtype=torch.int64, device=device).view(-1, 1)
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=device)
    h = _fmix32(_fmix32(tokens ^ k0) ^ k1)
    return -torch.log(-torch.log((h.double() + 0.5) * 2.0**-32))


def noised_logits(logits: torch.Tensor, temperatures: Sequence[float], seeds: Sequence[int],
                  positions: Sequence[int], top_ps: Sequence[float] | None = None) -> torch.Tensor:
    """A new [B, V] tensor of the logits' dtype and device whose row-wise argmax is, for every row b,
    `sample(logits[b], temperatures[b], seeds[b], positions[b], top_ps[b])` (`noise_rows_` on a copy)."""
    out = logits.clone()
    noise_rows_(out, range(out.shape[0]) if out.dim() == 2 else [], temperatures, seeds, positions, top_ps)
    return out


def noise_rows_(logits: torch.Tensor, rows: Sequence[int], temperatures: Sequence[float],
                seeds: Sequence[int], positions: Sequence[int], top_ps: Sequence[float] | None = None
                ) -> torch.Tensor:
    """In place, rows[i] of `logits` ([B, V]) gets temperatures[i], seeds[i], positions[i] and top_ps[i]
    (all 1 when None): its argmax becomes `sample(row, temperature, seed, position, top_p)`; returns
    `logits`.

    A row at temperature 0 stays as it is. Any other row becomes logits / T + g, computed in float64
    as `sample` computes it and rounded to the logits' dtype, and -inf outside its nucleus. Rounding
    can make another token tie with the float64 winner, or pass it, when the two lie within a unit in
    the last place of that dtype (about 1e-6 of the value in float32, 1e-3 in float16 and 1e-2 in
    bfloat16); in those rows the winner alone is lifted just above the row's maximum, so that the
    argmax stays the specification's. Rows are worked through CHUNK_ELEMENTS at a time, so the memory
    this takes does not grow with the batch.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    count, vocab = logits.shape
    if not len(rows) == len(temperatures) == len(seeds) == len(positions):
        raise ValueError(f"{len(rows)} rows of logits need as many temperatures, seeds and positions; got "
                         f"{len(temperatures)}, {len(seeds)}, {len(positions)}")
    if any(not 0 <= r < count for r in rows):
        raise ValueError(f"rows must lie in [0, {count})")
    for t in temperatures:
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"a temperature must be finite and at least 0, got {t!r}")
    top_ps = [1.0] * len(rows) if top_ps is None else top_ps
    if len(top_ps) != len(rows):
        raise ValueError(f"{len(rows)} rows of logits need as many top_ps; got {len(top_ps)}")
    for top_p in top_ps:
        check_top_p(top_p)
    sampled = [i for i, t in enumerate(temperatures) if t > 0]
    if not sampled or vocab == 0:
        return logits
    step = max(1, CHUNK_ELEMENTS // vocab)
    for start in range(0, len(sampled), step):
        chunk = sampled[start:start + step]
        index = torch.tensor([rows[i] for i in chunk], dtype=torch.long, device=logits.device)
        temps = torch.tensor([float(temperatures[i]) for i in chunk], dtype=torch.float64,
                             device=logits.device).view(-1, 1)
        scaled = logits.index_select(0, index).double().div_(temps)
        scores = scaled + gumbel_rows([seeds[i] for i in chunk], [positions[i] for i in chunk], vocab,
                                      logits.device)
        if any(top_ps[i] < 1 for i in chunk):
            bounds = torch.tensor([float(top_ps[i]) for i in chunk], dtype=torch.float64,
                                  device=logits.device).view(-1, 1)
            scores.masked_fill_(~nucleus(scaled, bounds), -math.inf)
        logits.index_copy_(0, index, _keep_winner(scores, logits.dtype))
    return logits


def _keep_winner(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`scores` (float64) in `dtype`, with each row's float64 argmax the strict first maximum."""
    winners = scores.argmax(-1, keepdim=True)
    cast = scores.to(dtype)
    if dtype == torch.float64:
        return cast
    top = cast.max(-1, keepdim=True).values.double()
    # two units in the last place of the top value (one of 1 below magnitude 1) round up past it
    lifted = (top + 2 * torch.finfo(dtype).eps * top.abs().clamp(min=1.0)).to(dtype)
    kept = torch.where(cast.argmax(-1, keepdim=True) == winners, cast.gather(-1, winners), lifted)
    return cast.scatter_(-1, winners, kept)


def check_top_p(top_p: float) -> None:
    if not (math.isfinite(top_p) and 0 <= top_p <= 1):
        raise ValueError(f"top_p must lie in [0, 1], got {top_p!r}")


def nucleus(scaled: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """A boolean mask of the nucleus of each row of `scaled` (logits / T, [..., vocab]): its tokens in
    descending order of probability (ties by ascending id), each kept while the probability of those
    before it is below `top_p` (a number, or one per row as a [..., 1] tensor); the likeliest always.
    All of the vocabulary where top_p >= 1."""
    if not isinstance(top_p, torch.Tensor):
        if top_p >= 1:
            return torch.ones_like(scaled, dtype=torch.bool)
        top_p = torch.tensor(top_p, dtype=torch.float64, device=scaled.device)
    bound = top_p.double().masked_fill(top_p >= 1, math.inf)
    probs = scaled.double().softmax(-1)
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    kept = (ordered.cumsum(-1) - ordered) < bound
    kept[..., 0] = True
    return torch.zeros_like(kept).scatter_(-1, order, kept)


def sample(logits: torch.Tensor, temperature: float, seed: int, position: int, top_p: float = 1.0) -> int:
    """The token an honest engine emits from one position's logits ([vocab]): the argmax at temperature
    0, else argmax(logits / T + g) over the nucleus of `top_p`. float64, so the engine's own precision
    decides, not this step's."""
    if temperature == 0:
        return int(logits.argmax())
    check_top_p(top_p)
    scaled = logits.double() / temperature
    noised = scaled + gumbel_row(seed, position, logits.shape[-1], logits.device)
    return int(noised.masked_fill_(~nucleus(scaled, top_p), -math.inf).argmax())


def shortfalls(logprobs: torch.Tensor, tokens: torch.Tensor, temperature: float, seed: int,
               top_p: float = 1.0, margin: float = 0.0) -> torch.Tensor:
    """Per response position i, how far (in nats of the reference's log-probabilities) token i falls short
    of what an honest engine holding the reference would have emitted there:

        max_v (l_i(v) + T g(seed, i, v)) - (l_i(t_i) + T g(seed, i, t_i))

    with l_i the reference's log-probabilities at i ([n, vocab]) and t_i the response's tokens ([n]).
    It is 0 for the honest choice and, at temperature 0, the greedy shortfall top_i - l_i(t_i). It is
    measured in the logits' own units (the noise scaled by T, not the logits divided by T), so one
    tolerance absorbs numeric differences between engines at every temperature. Positions are worked
    through CHUNK_ELEMENTS noise values at a time, so a long answer over a large vocabulary does not
    hold its whole noise at once.

    Under a nucleus (top_p < 1, T > 0) an honest engine whose log-probabilities lie within margin / 2
    of the reference's has a nucleus between two the reference can bound (`_nucleus_bounds`): the max
    runs over the tokens surely in it, and a token that cannot be in it falls short by infinity. An
    honest answer then falls short by at most `margin`, the verifier's tolerance."""
    check_top_p(top_p)
    count, vocab = logprobs.shape
    index = tokens.long().view(-1, 1)
    step = max(1, CHUNK_ELEMENTS // max(1, vocab))
    out = []
    for start in range(0, count, step):
        scores = logprobs[start:start + step].double()
        if temperature == 0:
            out.append(scores.max(-1).values - scores.gather(-1, index[start:start + step])[:, 0])
            continue
        positions = range(start, min(count, start + step))
        noised = scores + temperature * gumbel_rows([seed] * len(positions), positions, vocab, scores.device)
        own = noised.gather(-1, index[start:start + step])[:, 0]
        if top_p >= 1:
            out.append(noised.max(-1).values - own)
            continue
        sure, maybe = _nucleus_bounds(scores, temperature, top_p, margin)
        short = (noised.masked_fill(~sure, -math.inf).max(-1).values - own).clamp(min=0)
        out.append(short.masked_fill(~maybe.gather(-1, index[start:start + step])[:, 0], math.inf))
    return torch.cat(out) if out else logprobs.new_zeros(0, dtype=torch.float64)


def _nucleus_bounds(logprobs: torch.Tensor, temperature: float, top_p: float, margin: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sure, maybe): masks of the tokens in, and of those possibly in, the nucleus of every engine
    whose log-probabilities ([n, vocab], float64) each lie within margin / 2 of these. Such an engine
    orders two tokens as these do unless they lie within `margin`, and its tempered probabilities are
    these times a factor within exp(+-margin / T); so the probability it puts before token v is at
    least that of the tokens above v by more than the margin, shrunk by that factor, and at most that
    of all other tokens within the margin below v or above, grown by it. A token with nothing within
    the margin above it may be an engine's likeliest, and one with no other within the margin of it
    is."""
    tempered = (logprobs / temperature).softmax(-1)
    ascending, order = logprobs.sort(-1)
    tail = tempered.gather(-1, order).flip(-1).cumsum(-1).flip(-1)
    tail = torch.cat([tail, tail.new_zeros(tail.shape[0], 1)], dim=-1)
    factor = math.exp(margin / temperature)
    clearly_above = tail.gather(-1, torch.searchsorted(ascending, logprobs + margin, right=True))
    maybe = (clearly_above / factor < top_p) | (clearly_above == 0)
    near_or_above = tail.gather(-1, torch.searchsorted(ascending, logprobs - margin)) - tempered
    sure = (near_or_above * factor < top_p) | (near_or_above <= 0)
    return sure, maybe


class GumbelProcessor(LogitsProcessor):
    """transformers' greedy search made this sampler: logits / T + g(seed, position, token) at every step,
    so `generate(do_sample=False, logits_processor=[...])` emits what an honest engine emits, with the
    KV cache (for answers made outside a serving engine: benchmarks, reference answers)."""

    def __init__(self, temperature: float, seed: int, prompt_len: int, top_p: float = 1.0) -> None:
        if temperature <= 0:
            raise ValueError("greedy decoding needs no noise")
        check_top_p(top_p)
        self.temperature, self.seed, self.prompt_len, self.top_p = temperature, seed, prompt_len, top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = scores.shape[0]
        return noised_logits(scores, [self.temperature] * rows, [self.seed] * rows,
                             [input_ids.shape[1] - self.prompt_len] * rows, [self.top_p] * rows)


