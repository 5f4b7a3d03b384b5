#!/usr/bin/env bash
# Idempotent set-up: virtual environment, the package with its dev extras, the pinned CometBFT
# binary, and the ABCI protobuf classes generated from that same CometBFT module's .proto files.
set -euo pipefail
cd "$(dirname "$0")/.."

COMETBFT_VERSION="v0.38.26"
VENV="$(pwd)/${VENV:-.venv}"
PY="$VENV/bin/python"
STAMP_DIR="$VENV/.planetserve-setup"

step() { printf '\033[1m==> %s\033[0m\n' "$*"; }

if [ ! -x "$PY" ]; then
  step "creating $VENV"
  python3 -m venv "$VENV"
fi
mkdir -p "$STAMP_DIR"

deps_sum=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$STAMP_DIR/deps" 2>/dev/null)" != "$deps_sum" ]; then
  step "installing planetserve[dev] into $VENV"
  "$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
  echo "$deps_sum" > "$STAMP_DIR/deps"
fi

if [ "$("$VENV/bin/cometbft" version 2>/dev/null)" != "${COMETBFT_VERSION#v}" ]; then
  step "installing cometbft $COMETBFT_VERSION with go install"
  GOBIN="$(cd "$VENV/bin" && pwd)" go install "github.com/cometbft/cometbft/cmd/cometbft@$COMETBFT_VERSION"
fi

proto_out="$VENV/planetserve-proto"
proto_key="$COMETBFT_VERSION $(sha256sum scripts/setup.sh | cut -d' ' -f1)"
if [ "$(cat "$STAMP_DIR/proto" 2>/dev/null)" != "$proto_key" ]; then
  step "generating protobuf classes from cometbft $COMETBFT_VERSION"
  module_dir() { go mod download -json "$1" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["Dir"])'; }
  cmt_dir=$(module_dir "github.com/cometbft/cometbft@$COMETBFT_VERSION")
  gogo_version=$(awk '$1=="github.com/cosmos/gogoproto" {print $2; exit}' "$cmt_dir/go.mod")
  gogo_dir=$(module_dir "github.com/cosmos/gogoproto@$gogo_version")
  grpc_include=$("$PY" -c 'import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')
  rm -rf "$proto_out"
  mkdir -p "$proto_out"
  protos=$(cd "$cmt_dir/proto" && find tendermint -name '*.proto' | sort)
  (cd "$cmt_dir/proto" && "$PY" -m grpc_tools.protoc -I. -I"$gogo_dir" -I"$grpc_include" \
      --python_out="$proto_out" $protos)
  (cd "$gogo_dir" && "$PY" -m grpc_tools.protoc -I. -I"$grpc_include" \
      --python_out="$proto_out" gogoproto/gogo.proto)
  find "$proto_out" -type d -exec touch {}/__init__.py \;
  rm -f "$proto_out/__init__.py"
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$proto_out" > "$site/planetserve-proto.pth"
  echo "$proto_key" > "$STAMP_DIR/proto"
fi
