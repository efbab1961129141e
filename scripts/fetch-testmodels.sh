#!/usr/bin/env bash
# Copy the small test networks that ship in the onnxruntime_go module's
# test_data/ folder (version pinned by go.mod) into deps/testmodels/.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

MODULE=github.com/yalue/onnxruntime_go
DEST=deps/testmodels

# "name in test_data => name in deps/testmodels"
FILES=(
  "example_dynamic_axes.onnx=>example_dynamic_axes.onnx"
  "example_multitype.onnx=>example_multitype.onnx"
  "example_float16.onnx=>example_float16.onnx"
  "example_several_inputs_and_outputs.onnx=>example_several_inputs_and_outputs.onnx"
  "example ż 大 김.onnx=>example_unicode.onnx"
)

missing=()
for pair in "${FILES[@]}"; do
  key="$DEST/${pair#*=>}"
  pinned "$ROOT/$key" "$key" || missing+=("$pair")
done
if [ ${#missing[@]} -eq 0 ]; then
  log "test models already present"
  exit 0
fi

need go
cd "$ROOT"
log "downloading $MODULE (version from go.mod)"
go mod download "$MODULE"
src=$(go list -m -f '{{.Dir}}' "$MODULE")/test_data
[ -d "$src" ] || die "$src not found"
for pair in "${missing[@]}"; do
  key="$DEST/${pair#*=>}"
  verify "$src/${pair%%=>*}" "$key"
  install_file "$src/${pair%%=>*}" "$ROOT/$key"
  log "installed $key"
done
