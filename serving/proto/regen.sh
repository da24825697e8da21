#!/usr/bin/env bash
# Regenerates the committed Python stubs from pagedjax.proto and kv_transfer.proto. Run from anywhere.
# Compiling with the repo root as the include path makes the stubs import each other as
# `serving.proto.pagedjax_pb2`, so no import fix-up is needed.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-.venv/bin/python}"
"$PY" -c "import grpc_tools" 2>/dev/null || {
  echo "grpc_tools not installed: this needs the proto extra (pip install -e '.[proto]')" >&2
  exit 1
}
"$PY" -m grpc_tools.protoc -I . \
  --python_out=. --grpc_python_out=. --pyi_out=. \
  serving/proto/pagedjax.proto serving/proto/kv_transfer.proto
