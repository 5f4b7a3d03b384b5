"""The protocol's sampling over a batch of rows at once: what a batched engine (vLLM's logits processor,
`vllm_processor.py`) writes into its logits so that its own greedy argmax picks, row by row, exactly
the token `planetserve.sampling.sample` picks.

`gumbel_rows` is `planetserve.sampling.gumbel_row` for many (seed, position) pairs in one pass: the
same 64-bit integer steps on a [rows, vocab] tensor and the same float64 logarithms, so each row holds
the same bits as `gumbel_row` on the same device. `noise_rows_` turns rows of a batch of logits into
logits / T + g in the logits' own dtype, in place, leaving rows at temperature 0 as they are (plain
argmax); `noised_logits` does it on a copy.

No vLLM here: this module needs only torch, and the tests check it on CPU against the per-row
specification.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from planetserve.sampling import _fmix32, position_key

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
                  positions: Sequence[int]) -> torch.Tensor:
    """A new [B, V] tensor of the logits' dtype and device whose row-wise argmax is, for every row b,
    `sample(logits[b], temperatures[b], seeds[b], positions[b])` (`noise_rows_` on a copy)."""
    out = logits.clone()
    noise_rows_(out, range(out.shape[0]) if out.dim() == 2 else [], temperatures, seeds, positions)
    return out


def noise_rows_(logits: torch.Tensor, rows: Sequence[int], temperatures: Sequence[float],
                seeds: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """In place, rows[i] of `logits` ([B, V]) gets temperatures[i], seeds[i] and positions[i]: its argmax
    becomes `sample(row, temperature, seed, position)`; returns `logits`.

    A row at temperature 0 stays as it is. Any other row becomes logits / T + g, computed in float64
    as `sample` computes it and rounded to the logits' dtype. Rounding can make another token tie with
    the float64 winner, or pass it, when the two lie within a unit in the last place of that dtype
    (about 1e-6 of the value in float32, 1e-3 in float16 and 1e-2 in bfloat16); in those rows the
    winner alone is lifted just above the row's maximum, so that the argmax stays the specification's.
    Rows are worked through CHUNK_ELEMENTS at a time, so the memory this takes does not grow with the
    batch.
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
    sampled = [i for i, t in enumerate(temperatures) if t > 0]
    if not sampled or vocab == 0:
        return logits
    step = max(1, CHUNK_ELEMENTS // vocab)
    for start in range(0, len(sampled), step):
        chunk = sampled[start:start + step]
        index = torch.tensor([rows[i] for i in chunk], dtype=torch.long, device=logits.device)
        temps = torch.tensor([float(temperatures[i]) for i in chunk], dtype=torch.float64,
                             device=logits.device).view(-1, 1)
        scores = logits.index_select(0, index).double().div_(temps)
        scores += gumbel_rows([seeds[i] for i in chunk], [positions[i] for i in chunk], vocab, logits.device)
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
