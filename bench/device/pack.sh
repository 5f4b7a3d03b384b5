#!/usr/bin/env bash
# Fill .device/ here with what bench/device/run.sh needs on a GPU machine that reaches no network:
#   .device/wheels/  the packages the benchmarks import that the machine's image lacks (or holds at another
#                    version), at the versions .venv holds, built for that machine's Python 3.12; its own
#                    PyTorch, numpy, aiohttp and huggingface_hub are used;
#   .device/proto/   the CometBFT messages generated at `make setup` (for that protobuf);
#   .device/data/    a trained gt (models/gt), whose tokenizer the random-weight models speak.
# Then pass `carry: [".device"]` with the run.
#
#     bash bench/device/pack.sh [DATA_DIR]      # DATA_DIR holds models/gt (default: the models' data dir)
set -euo pipefail
cd "$(dirname "$0")/../.."
names='transformers|uvloop|cryptography|cffi|pycparser|pynacl|zfec|pyzmq|msgpack|protobuf'
mapfile -t pins < <(.venv/bin/python -m pip freeze 2>/dev/null | grep -iE "^($names)==")
rm -rf .device/wheels && mkdir -p .device/wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .device/wheels "${pins[@]}"
rm -rf .device/proto && cp -r .venv/planetserve-proto .device/proto
data=${1:-$(.venv/bin/python -c 'from planetserve.models import layout; print(layout.data_dir())')}
if [[ ! -f "$data/models/gt/model.safetensors" ]]; then
    echo "no trained gt in $data: train it with 'planetserve models train gt' (or pass the DATA_DIR that holds it)" >&2
    exit 1
fi
rm -rf .device/data && mkdir -p .device/data/models && cp -r "$data/models/gt" .device/data/models/
du -sh .device/wheels .device/proto .device/data
