#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md ("On a GPU"), for a machine with one NVIDIA GPU and no network.
# Everything travels with the working tree: the pinned transformers and uvloop as wheels in .whl/ (fetch
# them here with bench/device/wheels.sh; the machine's own PyTorch is used), and the models are built from
# their shapes with random weights. Writes a results table (and JSON) under $OUT, or bench/out/device without it.
#
#     bash bench/device/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
    python3 bench/engine_scale.py --device cuda --shapes 1b 8b --json "$OUT/engine_scale.json"
    # forwarding on one GPU: four nodes sharing a random-weight 1B model, ToolUse and Mixed
    python3 bench/forwarding_real.py --shape 1b --workload tooluse --scale 0.25 --rate 8 --duration 40 \
        --json "$OUT/forwarding_tooluse.json"
    python3 bench/forwarding_real.py --shape 1b --workload mixed --scale 0.25 --rate 4 --duration 40 \
        --json "$OUT/forwarding_mixed.json"
    # the overlay's cost per request and per streamed token at the 1B shape's speed
    python3 bench/overlay_cost.py --shape 1b --rounds 10 --tokens 32 --json "$OUT/overlay_cost.json"
} 2>&1 | tee "$OUT/results.txt"
