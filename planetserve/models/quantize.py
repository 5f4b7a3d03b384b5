"""Weight-only quantization of gt, as a node serving a cheaper gt would do it.

Round-to-nearest, symmetric, one scale per output channel, on every Linear weight of the decoder
layers; embeddings (tied to the LM head) and norms stay float32. The dequantized weights are what is
saved, so the checkpoint loads through the plain transformers path and computes exactly what an
int-kernel engine with these scales would, up to float rounding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

METHOD = "rtn-symmetric-per-output-channel"


def fake_quantize(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize each row to integers in [-qmax, qmax] with its own scale, and return the dequantized rows."""
    qmax = 2 ** (bits - 1) - 1
    scale = weight.abs().amax(dim=1, keepdim=True) / qmax
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (weight / scale).round().clamp(-qmax, qmax) * scale


@torch.no_grad()
def quantize_model(model: nn.Module, bits: int) -> dict[str, Any]:
    """Quantize in place; returns the record kept in config.json and the stamp."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("model.layers."):
            module.weight.copy_(fake_quantize(module.weight, bits))
            names.append(name)
    return {
        "method": METHOD,
        "bits": bits,
        "qmax": 2 ** (bits - 1) - 1,
        "quantized_modules": len(names),
        "stored_as": "dequantized float32",
        "kept_float": "embed_tokens (tied lm_head), norms",
    }
