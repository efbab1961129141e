#!/usr/bin/env bash
# Assemble a CUDA build of ONNX Runtime 1.30.0 in deps/onnxruntime-gpu/ for a
# machine with an NVIDIA GPU (`make setup-gpu`). It is what onnxruntime-node's
# own install step does for linux/x64: the core library from the npm package
# (the one `make setup` pins, which has the CUDA provider bridge compiled in)
# beside the CUDA provider libraries of the same release, which are too large
# for npm and come from the Microsoft.ML.OnnxRuntime.Gpu.Linux package on
# nuget.org. They need CUDA 12 and cuDNN 9 on the machine (checked at the end).
#
# Our development and CI machines reach neither nuget.org nor a GPU, so this
# script has not run here and the NuGet package has no pin yet: without one
# it stops after the download and prints the package's sha256; check it
# against nuget.org and add it to scripts/pins.sha256, or accept it for this
# machine with ACCEPT_UNPINNED=1.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

VERSION=1.30.0
PKG=microsoft.ml.onnxruntime.gpu.linux
URL=${SLOSERVE_NUGET_URL:-https://api.nuget.org/v3-flatcontainer}/$PKG/$VERSION/$PKG.$VERSION.nupkg
DIR="$ROOT/deps/onnxruntime-gpu"
CORE="$ROOT/deps/onnxruntime/libonnxruntime.so.$VERSION"
PROVIDERS=(libonnxruntime_providers_shared.so libonnxruntime_providers_cuda.so)

[ "$(uname -m)" = x86_64 ] || die "the CUDA build of ONNX Runtime $VERSION is published for linux x86_64 only, not $(uname -m)"

# The core library: the pinned CPU fetch, shared with `make setup`.
"$ROOT/scripts/fetch-onnxruntime.sh"

have=1
for p in "${PROVIDERS[@]}"; do [ -f "$DIR/$p" ] || have=0; done
if [ "$have" = 1 ]; then
  log "CUDA provider libraries $VERSION already present in ${DIR#"$ROOT"/}"
else
  need curl unzip
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  log "downloading $PKG $VERSION from nuget.org"
  curl -fsSL --retry 3 -o "$tmp/gpu.nupkg" "$URL" || die "could not download $URL"
  key="$PKG.$VERSION.nupkg"
  if awk -v k="$key" '$1 !~ /^#/ && $2 == k { f = 1 } END { exit !f }' "$PINS"; then
    verify "$tmp/gpu.nupkg" "$key"
  elif [ "${ACCEPT_UNPINNED:-}" = 1 ]; then
    log "no pin for $key; accepted unpinned (ACCEPT_UNPINNED=1): sha256 $(sha "$tmp/gpu.nupkg")"
  else
    die "no pin for $key in scripts/pins.sha256. The download's sha256 is $(sha "$tmp/gpu.nupkg"): check it against nuget.org, then add the line '$(sha "$tmp/gpu.nupkg") $key' to scripts/pins.sha256, or rerun with ACCEPT_UNPINNED=1"
  fi
  for p in "${PROVIDERS[@]}"; do
    unzip -q -o -j "$tmp/gpu.nupkg" "runtimes/linux-x64/native/$p" -d "$tmp/native" ||
      die "$p is not in $key"
    install_file "$tmp/native/$p" "$DIR/$p"
  done
fi
# ONNX Runtime loads provider libraries from the folder of the core library.
install_file "$CORE" "$DIR/libonnxruntime.so.$VERSION"
ln -sfn "libonnxruntime.so.$VERSION" "$DIR/libonnxruntime.so"

missing=$(cd "$DIR" && LD_LIBRARY_PATH="$DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd libonnxruntime_providers_cuda.so 2>/dev/null | awk '/not found/ { print $1 }' | sort -u | tr '\n' ' ')
if [ -n "$missing" ]; then
  log "installed in ${DIR#"$ROOT"/}, but the CUDA provider cannot load here: missing $missing(CUDA 12 and cuDNN 9 are needed)"
  exit 3
fi
log "installed in ${DIR#"$ROOT"/}: SLOSERVE_ONNXRUNTIME_LIBRARY=$DIR/libonnxruntime.so.$VERSION"
