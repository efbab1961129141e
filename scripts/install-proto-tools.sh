#!/usr/bin/env bash
# Install the pinned protobuf toolchain used by `make proto`:
#   protoc 3.21.12 from Debian bookworm (apt), plus the well-known types;
#   protoc-gen-go and protoc-gen-go-grpc into .tools/bin.
# Skips whatever is already installed at the right version.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

PROTOC_DEB=3.21.12-3
PROTOC_VERSION=3.21.12
GEN_GO=v1.36.12
GEN_GO_GRPC=v1.5.1
BIN="$ROOT/.tools/bin"

protoc_ok() {
  command -v protoc >/dev/null 2>&1 &&
    [ "$(protoc --version)" = "libprotoc $PROTOC_VERSION" ] &&
    [ -f /usr/include/google/protobuf/descriptor.proto ] # well-known types
}

if protoc_ok; then
  log "protoc $PROTOC_VERSION already installed"
else
  need apt-get
  sudo=
  [ "$(id -u)" = 0 ] || sudo=sudo
  pkgs=(protobuf-compiler="$PROTOC_DEB" libprotobuf-dev="$PROTOC_DEB")
  # Refresh the package lists only when they do not know the pinned version.
  if ! apt-cache show "${pkgs[0]}" >/dev/null 2>&1; then
    log "apt-get update"
    $sudo apt-get update -qq
  fi
  log "apt-get install ${pkgs[*]}"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
  protoc_ok || die "protoc --version says '$(protoc --version 2>&1)', want libprotoc $PROTOC_VERSION"
fi

need go
mkdir -p "$BIN"
if [ "$("$BIN/protoc-gen-go" --version 2>/dev/null)" = "protoc-gen-go $GEN_GO" ]; then
  log "protoc-gen-go $GEN_GO already installed"
else
  log "go install protoc-gen-go@$GEN_GO"
  GOBIN="$BIN" go install "google.golang.org/protobuf/cmd/protoc-gen-go@$GEN_GO"
fi
if [ "$("$BIN/protoc-gen-go-grpc" --version 2>/dev/null)" = "protoc-gen-go-grpc ${GEN_GO_GRPC#v}" ]; then
  log "protoc-gen-go-grpc $GEN_GO_GRPC already installed"
else
  log "go install protoc-gen-go-grpc@$GEN_GO_GRPC"
  GOBIN="$BIN" go install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$GEN_GO_GRPC"
fi
