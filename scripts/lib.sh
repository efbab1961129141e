# shellcheck shell=bash
# Helpers shared by the scripts in this folder. Source it, do not run it.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PINS="$ROOT/scripts/pins.sha256"

# Go may not be on PATH in a fresh shell.
if ! command -v go >/dev/null 2>&1 && [ -x /usr/local/go/bin/go ]; then
  PATH="/usr/local/go/bin:$PATH"
fi

log() { echo "==> $*" >&2; }
die() { echo "error: $*" >&2; exit 1; }

need() {
  local c
  for c in "$@"; do
    command -v "$c" >/dev/null 2>&1 || die "'$c' is required but not installed"
  done
}

# pin KEY: the sha256 pinned for KEY in pins.sha256.
pin() {
  local sum
  sum=$(awk -v k="$1" '$1 !~ /^#/ && $2 == k { print $1 }' "$PINS")
  [ -n "$sum" ] || die "no sha256 pin for '$1' in $PINS"
  echo "$sum"
}

sha() { sha256sum "$1" | cut -d' ' -f1; }

# pinned FILE KEY: true when FILE exists and matches the pin for KEY.
pinned() { [ -f "$1" ] && [ "$(sha "$1")" = "$(pin "$2")" ]; }

# verify FILE KEY: fail loudly unless FILE matches the pin for KEY.
verify() {
  local want got
  want=$(pin "$2")
  got=$(sha "$1")
  [ "$got" = "$want" ] || die "sha256 mismatch for $1 ($2): got $got, want $want"
}

# npm_pack SPEC DIR: download the npm tarball of SPEC into DIR (no install
# scripts run) and print its path.
npm_pack() {
  local name
  need npm
  name=$(cd "$2" && npm pack --ignore-scripts --silent "$1" | tail -n 1)
  [ -f "$2/$name" ] || die "npm pack $1 produced no tarball"
  echo "$2/$name"
}

# install_file SRC DEST: copy SRC to DEST atomically, mode 0644.
install_file() {
  mkdir -p "$(dirname "$2")"
  install -m 0644 "$1" "$2.tmp.$$"
  mv -f "$2.tmp.$$" "$2"
}
