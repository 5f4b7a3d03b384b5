#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md ("On a GPU"), for a machine with one NVIDIA GPU and no network.
# Everything travels with the working tree: bench/device/pack.sh fills .device/ here (the wheels the
# machine's image lacks, and a trained gt whose tokenizer the random-weight models speak; the machine's own
# PyTorch is used), and the models are built from their shapes with random weights. Writes a results table
# (and JSON) under $OUT, or bench/out/device without it.
#
#     bash bench/device/run.sh        # on the GPU machine, with .device carried
#
# The steps run in order of what is least measured, each for at most its own limit and together for at
# most BUDGET seconds (470, so the whole stays under 8 minutes): a step that fails or runs out of time
# is reported and the next one runs.
# SHAPE (1b; empty serves gt itself), DURATION (20 s of arrivals per forwarding run) and ENGINE_SHAPES
# ("1b 8b") size it, for instance for a trial on a CPU; STEPS (all of them when empty) names the steps to run,
# for instance "forwarding-tooluse engine" to spend a short lease on what is still unmeasured.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out/device}
SHAPE=${SHAPE-1b}
DURATION=${DURATION:-20}
BUDGET=${BUDGET:-470}
ENGINE_SHAPES=${ENGINE_SHAPES:-1b 8b}
STEPS=${STEPS:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/.device/proto"
if compgen -G ".device/wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .device/wheels/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
if [[ -d .device/data ]]; then
    export PLANETSERVE_DATA="$PWD/.device/data"
fi
shaped=(${SHAPE:+--shape "$SHAPE"})
end=$((SECONDS + BUDGET))

step() {  # step NAME LIMIT COMMAND...: COMMAND for at most LIMIT seconds, or what the budget has left
    local name=$1 limit=$2 left=$((end - SECONDS)) started=$SECONDS rc
    shift 2
    if [[ -n $STEPS && " $STEPS " != *" $name "* ]]; then
        echo "== $name: not in STEPS"
        return
    fi
    if ((left < 30)); then
        echo "== $name: skipped, $left s of the budget left"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name, at most $limit s: $*"
    timeout -k 10 "$limit" "$@"
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - started)) s"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
    python3 -c 'import sys, torch, transformers, huggingface_hub, tokenizers, aiohttp, numpy
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      "huggingface_hub", huggingface_hub.__version__, "tokenizers", tokenizers.__version__,
      "aiohttp", aiohttp.__version__, "numpy", numpy.__version__)'
    # the overlay's cost per request and per streamed token at the shape's speed
    step overlay 60 python3 bench/overlay_cost.py "${shaped[@]}" --rounds 10 --tokens 32 \
        --json "$OUT/overlay_cost.json"
    # forwarding on one GPU: four nodes, each in a process of its own with its own copy of a random-weight
    # model (in one process they launch what one thread can); ToolUse at a rate the group serves, then
    # Mixed at the paper's stated 3:6:1 and at a 2:1:14 that averages its stated 9,959 tokens
    step forwarding-tooluse 150 python3 bench/forwarding_real.py "${shaped[@]}" --workload tooluse \
        --processes --scale 0.25 --rate 3 --duration "$DURATION" --json "$OUT/forwarding_tooluse.json"
    step forwarding-mixed 170 python3 bench/forwarding_real.py "${shaped[@]}" --workload mixed \
        --processes --scale 0.25 --rate 1.5 --duration "$DURATION" --json "$OUT/forwarding_mixed.json"
    step forwarding-mixed-2-1-14 140 python3 bench/forwarding_real.py "${shaped[@]}" --workload mixed \
        --processes --mix 2:1:14 --scale 0.25 --rate 0.75 --duration "$DURATION" \
        --json "$OUT/forwarding_mixed_2_1_14.json"
    # the engine alone at 1B and 8B: TTFT cold and with a prefix hit, batched decode, a long prompt's stall
    # shellcheck disable=SC2086
    step engine 240 python3 bench/engine_scale.py --shapes $ENGINE_SHAPES --json "$OUT/engine_scale.json"
} 2>&1 | tee "$OUT/results.txt"
