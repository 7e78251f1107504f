#!/usr/bin/env bash
# Regenerate the Python code for protos/fedloom/v1/*.proto, with mypy-protobuf stubs.
# Usage: protos/generate.sh [OUT_DIR]   (default: protos/, i.e. in place)
# Needs grpcio-tools matching the declared protobuf range (pip install fedloom[dev]).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here}
mkdir -p "$out/fedloom/v1"
"${PYTHON:-python3}" -m grpc_tools.protoc -I "$here" \
  --python_out="$out" --grpc_python_out="$out" \
  --mypy_out="$out" --mypy_grpc_out="$out" \
  "$here"/fedloom/v1/*.proto
# protoc writes absolute imports by proto path (`from fedloom.v1 import fleet_pb2`);
# the modules live in fedloom.protos.fedloom.v1, so make them relative.
for f in "$out"/fedloom/v1/*_pb2*.py "$out"/fedloom/v1/*_pb2*.pyi; do
  sed -i -E 's/^from fedloom\.v1 import /from . import /; s/^import fedloom\.v1\.([a-z_0-9]+)$/from . import \1/' "$f"
done
