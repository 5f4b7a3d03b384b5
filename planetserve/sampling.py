"""Verifiable sampling: the protocol's Gumbel noise, which makes a sampled answer reproducible by anyone
who holds the model and the request's seed.

A node answering at temperature T > 0 picks token i as

    argmax over the vocabulary v of  logit_i(v) / T + g(seed, i, v)

which is an exact sample of softmax(logit_i / T) (the Gumbel-max trick) when g is standard Gumbel
noise. Here g is a fixed function of (seed, i, v), so the verifier, recomputing the reference's logits
in one pass, checks every token as it checks a greedy one: temperature 0 is the case with no noise.
The noise is keyed by token id, never by rank, so near-ties between engines cannot swap it.

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
below any tolerance a verifier applies.
"""

from __future__ import annotations

import hashlib
import math

import torch
from transformers import LogitsProcessor

DOMAIN = b"planetserve/gumbel/v1"
SEED_LIMIT = 1 << 64
"""Seeds are unsigned 64-bit integers."""
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
    k0, k1 = position_key(seed, position)
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=device)
    h = _fmix32(_fmix32(tokens ^ k0) ^ k1)
    return -torch.log(-torch.log((h.double() + 0.5) * 2.0**-32))


def sample(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    """The token an honest engine emits from one position's logits ([vocab]): the argmax at temperature
    0, else argmax(logits / T + g). float64, so the engine's own precision decides, not this step's."""
    if temperature == 0:
        return int(logits.argmax())
    noise = gumbel_row(seed, position, logits.shape[-1], logits.device)
    return int((logits.double() / temperature + noise).argmax())


def shortfalls(logprobs: torch.Tensor, tokens: torch.Tensor, temperature: float, seed: int) -> torch.Tensor:
    """Per response position i, how far (in nats of the reference's log-probabilities) token i falls short
    of what an honest engine holding the reference would have emitted there:

        max_v (l_i(v) + T g(seed, i, v)) - (l_i(t_i) + T g(seed, i, t_i))

    with l_i the reference's log-probabilities at i ([n, vocab]) and t_i the response's tokens ([n]).
    It is 0 for the honest choice and, at temperature 0, the greedy shortfall top_i - l_i(t_i). It is
    measured in the logits' own units (the noise scaled by T, not the logits divided by T), so one
    tolerance absorbs numeric differences between engines at every temperature."""
    scores = logprobs.double()
    if temperature > 0 and len(tokens):
        vocab, device = scores.shape[-1], scores.device
        noise = torch.stack([gumbel_row(seed, i, vocab, device) for i in range(len(tokens))])
        scores = scores + temperature * noise
    picked = scores.gather(-1, tokens.long().view(-1, 1))[:, 0]
    return scores.max(-1).values - picked


class GumbelProcessor(LogitsProcessor):
    """transformers' greedy search made this sampler: logits / T + g(seed, position, token) at every step,
    so `generate(do_sample=False, logits_processor=[...])` emits what an honest engine emits, with the
    KV cache (for answers made outside a serving engine: benchmarks, reference answers)."""

    def __init__(self, temperature: float, seed: int, prompt_len: int) -> None:
        if temperature <= 0:
            raise ValueError("greedy decoding needs no noise")
        self.temperature, self.seed, self.prompt_len = temperature, seed, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        noise = gumbel_row(self.seed, input_ids.shape[1] - self.prompt_len, scores.shape[-1], scores.device)
        return (scores.double() / self.temperature + noise).to(scores.dtype)


def to_seed(value: int) -> int:
    """An OpenAI `seed` (a signed 64-bit integer) as the protocol's unsigned one, two's complement."""
    return value % SEED_LIMIT
