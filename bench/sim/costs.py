"""The engine cost model: how long one continuous-batching iteration takes.

An iteration decodes one token for every running sequence and computes a chunk of prompt tokens for
the sequences still in prefill (vLLM's chunked prefill, up to `token_budget` tokens in all):

    t = step + decode_seq * D + kv_token * (context tokens the D decodes read)
          + prefill_token * P + prefill_pair * (query, earlier key) pairs of the P prefill tokens

`A100_LLAMA3_8B` derives these from Llama-3-8B in bf16 on one A100-80GB SXM (the paper's high-end
node class): 16 GB of weights read per step at ~2 TB/s is 8 ms, plus ~2 ms of launch and sampling
overhead; a token costs 2 * 8e9 FLOPs, 94 us at 170 TFLOP/s achieved (55 % of peak), which is also
the compute a decoded token adds; attention costs 4 * 4096 * 32 FLOPs per (query, key) pair, 3.1 ns; a
token's KV is 2 * 32 layers * 8 heads * 128 * 2 B = 128 KiB, 73 ns to read at 1.8 TB/s; 90 % of 80 GB
less weights and activations leaves ~53 GB of KV, 400k tokens. This gives ~10.6k prefill tokens/s and
~95 decode tokens/s for one sequence, close to published vLLM numbers for that pair.

`A6000_LLAMA3_8B`, the paper's mid-tier node, the same way: 768 GB/s (21 ms of weights per step, 23 ms
with overhead, 187 ns per KV token), 155 TFLOP/s dense bf16 at 55 % (188 us per token, 6.2 ns per
pair), 90 % of 48 GB less weights and activations, 190k tokens of KV.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class CostModel:
    name: str
    step_s: float
    decode_seq_s: float
    kv_token_s: float
    prefill_token_s: float
    prefill_pair_s: float
    kv_capacity_tokens: int
    max_seqs: int = 32
    """C: sequences a node runs concurrently; more wait in its queue (Q)."""
    token_budget: int = 8192
    block_size: int = 16

    def iteration(self, decodes: int, decode_context: float, prefill_tokens: int,
                  prefill_pairs: float) -> float:
        return (self.step_s + self.decode_seq_s * decodes + self.kv_token_s * decode_context
                + self.prefill_token_s * prefill_tokens + self.prefill_pair_s * prefill_pairs)

    def prefill_seconds(self, start: int, tokens: int) -> float:
        """Compute of prompt tokens [start, start + tokens) alone, without the fixed step cost."""
        return self.prefill_token_s * tokens + self.prefill_pair_s * chunk_pairs(start, tokens)

    @property
    def capacity_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, path: Path) -> CostModel:
        return cls(**json.loads(path.read_text()))


def chunk_pairs(start: int, tokens: int) -> float:
    """(query, key) pairs of causal attention for tokens at positions start .. start + tokens - 1."""
    return tokens * start + tokens * (tokens + 1) / 2


A100_LLAMA3_8B = CostModel(
    name="A100-80GB, Llama-3-8B bf16 (derived)",
    step_s=0.010,
    decode_seq_s=94e-6,
    kv_token_s=73e-9,
    prefill_token_s=94e-6,
    prefill_pair_s=3.1e-9,
    kv_capacity_tokens=400_000,
)

A6000_LLAMA3_8B = CostModel(
    name="RTX A6000 48GB, Llama-3-8B bf16 (derived)",
    step_s=0.023,
    decode_seq_s=188e-6,
    kv_token_s=187e-9,
    prefill_token_s=188e-6,
    prefill_pair_s=6.2e-9,
    kv_capacity_tokens=190_000,
)


def fit_measured(costs: dict[str, dict[int, float]], base: CostModel) -> CostModel:
    """A cost model from `planetserve.node.engine.profile.measure_costs` (milliseconds): a decode step
    over b sequences is step + b * per-sequence (least squares over the batch sizes); an uncached prompt
    of L tokens is step + L * per-token (+ L^2/2 * per-pair, fitted only from three lengths on). The
    context is one length there, so reading it stays inside those terms and kv_token_s is 0; capacity,
    C and the block size stay those of `base`."""
    batch = costs["decode_ms_per_step"]
    step, per_seq = np.polynomial.polynomial.polyfit(list(batch), list(batch.values()), 1)
    step = max(float(step), 0.0)
    lengths = np.array(list(costs["prefill_ms_per_token"]), dtype=float)
    total = np.array(list(costs["prefill_ms_per_token"].values())) * lengths - step
    features = [lengths, lengths**2 / 2] if len(lengths) >= 3 else [lengths]
    fitted = np.linalg.lstsq(np.column_stack(features), total, rcond=None)[0]
    per_token = max(float(fitted[0]), 1e-6)
    per_pair = max(float(fitted[1]), 0.0) if len(fitted) > 1 else 0.0
    return replace(base, name="measured built-in engine", step_s=step / 1000,
                   decode_seq_s=max(float(per_seq), 0.0) / 1000, kv_token_s=0.0,
                   prefill_token_s=per_token / 1000, prefill_pair_s=per_pair / 1000)
