#!/usr/bin/env bash
# Fetch the ONNX Runtime 1.30.0 CPU shared library from the onnxruntime-node
# npm package into deps/onnxruntime/. Every byte is checked against
# scripts/pins.sha256. Does nothing when the library is already in place.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

VERSION=1.30.0
DIR="$ROOT/deps/onnxruntime"
LIB="$DIR/libonnxruntime.so.$VERSION"

case "$(uname -m)" in
  x86_64 | amd64) ARCH=x64 ;;
  aarch64 | arm64) ARCH=arm64 ;;
  *) die "no ONNX Runtime build for $(uname -m)" ;;
esac
KEY="deps/onnxruntime/libonnxruntime.so.$VERSION:$ARCH"

if pinned "$LIB" "$KEY"; then
  log "onnxruntime $VERSION ($ARCH) already present"
else
  need tar
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  log "downloading onnxruntime-node@$VERSION"
  tgz=$(npm_pack "onnxruntime-node@$VERSION" "$tmp")
  verify "$tgz" "$(basename "$tgz")"
  member="package/bin/napi-v6/linux/$ARCH/libonnxruntime.so.1"
  tar -xzf "$tgz" -C "$tmp" "$member"
  verify "$tmp/$member" "$KEY"
  install_file "$tmp/$member" "$LIB"
  log "installed ${LIB#"$ROOT"/}"
fi
ln -sfn "libonnxruntime.so.$VERSION" "$DIR/libonnxruntime.so"
