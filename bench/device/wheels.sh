#!/usr/bin/env bash
# Fetch, here, the wheels bench/device/run.sh installs on a machine with no network: the transformers and
# uvloop versions pyproject.toml pins, for that machine's Python 3.12 (its PyTorch is its own).
set -euo pipefail
cd "$(dirname "$0")/../.."
mapfile -t pins < <(grep -o '"\(transformers\|uvloop\)==[^"]*"' pyproject.toml | tr -d '"')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "${pins[@]}"
ls .whl
