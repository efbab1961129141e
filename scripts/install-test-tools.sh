#!/usr/bin/env bash
# Install the tools the tests run, when any is missing:
#   prometheus       /usr/bin/prometheus and promtool (the Prometheus e2e test)
#   chromium         /usr/bin/chromium     (the dashboard's browser test)
#   chromium-driver  /usr/bin/chromedriver
#   helm             .tools/bin/helm, pinned, built with `go install` through
#                    the Go module proxy (the deploy package renders the chart)
#   kube-apiserver,  .tools/bin/, built from Kubernetes' and etcd's own Go
#   etcd             modules at the versions tools/kube/go.mod pins
#                    (the deploy package applies the manifests to them)
#   CRDs             .tools/crds/: KServe's, KEDA's and prometheus-operator's
#                    CustomResourceDefinitions, from their Go modules, pinned
#   jaeger           .tools/bin/jaeger, pinned by tools/jaeger/go.mod and
#                    go.sum, built through the Go module proxy (the tracing
#                    e2e test's OTLP collector and query API)
# One apt run for the Debian packages; nothing happens when every binary is
# there at the right version.
# The packages' daemons are not started: the tests run their own Prometheus
# on a free port with a temporary data directory.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

HELM_VERSION=v3.21.4
BIN="$ROOT/.tools/bin"

# helm first: it needs only Go, so it installs even where apt cannot run.
# `helm version --template` prints the version the binary was built as.
if [ "$("$BIN/helm" version --template '{{.Version}}' 2>/dev/null)" = "$HELM_VERSION" ]; then
  log "helm $HELM_VERSION already installed"
else
  need go
  mkdir -p "$BIN"
  log "go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  # The version string is stamped by helm's own Makefile; go install leaves
  # it empty unless the linker sets it.
  GOBIN="$BIN" go install \
    -ldflags "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  got=$("$BIN/helm" version --template '{{.Version}}')
  [ "$got" = "$HELM_VERSION" ] || die "helm version says '$got', want $HELM_VERSION"
fi

# kube-apiserver and etcd: built from the tools module in tools/kube
# (its go.sum pins every module); rebuilt when that module changes. About
# ten minutes on two cores the first time.
KUBE_TOOLS="$ROOT/tools/kube"
# Kubernetes' own build stamps its version into component-base; without it
# the server says v0.0.0 and emulates no release.
kube_version=$(awk '$1 == "k8s.io/kubernetes" { print $2 }' "$KUBE_TOOLS/go.mod")
kube_minor=$(echo "$kube_version" | cut -d. -f2)
kube_ldflags="-X k8s.io/component-base/version.gitVersion=$kube_version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$kube_minor -X k8s.io/component-base/version.gitTreeState=clean"
kube_sum=$( (cat "$KUBE_TOOLS/go.mod" "$KUBE_TOOLS/go.sum" "$KUBE_TOOLS/etcd/main.go"; echo "$kube_ldflags") | sha256sum | cut -d' ' -f1)
if [ -x "$BIN/kube-apiserver" ] && [ -x "$BIN/etcd" ] && [ "$(cat "$BIN/.kube-tools.sum" 2>/dev/null)" = "$kube_sum" ]; then
  log "kube-apiserver and etcd already built"
else
  need go
  mkdir -p "$BIN"
  log "go build kube-apiserver $kube_version and etcd (tools/kube)"
  (cd "$KUBE_TOOLS" && go build -ldflags "$kube_ldflags" -o "$BIN/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver \
    && go build -o "$BIN/etcd" ./etcd)
  echo "$kube_sum" >"$BIN/.kube-tools.sum"
fi

# The CRDs the manifests use, each file checked against scripts/pins.sha256.
# module@version path-in-module
crds=(
  "github.com/kserve/kserve@v0.16.0 config/crd/full/serving.kserve.io_clusterservingruntimes.yaml"
  "github.com/kserve/kserve@v0.16.0 config/crd/full/serving.kserve.io_servingruntimes.yaml"
  "github.com/kserve/kserve@v0.16.0 config/crd/full/serving.kserve.io_inferenceservices.yaml"
  "github.com/kedacore/keda/v2@v2.21.0 config/crd/bases/keda.sh_scaledobjects.yaml"
  "github.com/prometheus-operator/prometheus-operator@v0.85.0 example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml"
  "github.com/prometheus-operator/prometheus-operator@v0.85.0 example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml"
)
for c in "${crds[@]}"; do
  read -r mod path <<<"$c"
  dest="$ROOT/.tools/crds/$(basename "$path")"
  key=".tools/crds/$(basename "$path")"
  if pinned "$dest" "$key"; then
    continue
  fi
  need go
  # Outside any module, so nothing is added to one.
  dir=$(cd "$(mktemp -d)" && go mod download -json "$mod" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [ -n "$dir" ] && [ -f "$dir/$path" ] || die "$mod has no $path"
  verify "$dir/$path" "$key"
  install_file "$dir/$path" "$dest"
  log "installed $key"
done

# jaeger: its go.mod has a replace directive, so `go install jaeger@version`
# refuses it; tools/jaeger is a module of its own that requires it as a tool
# and pins every dependency in its go.sum. `go version -m` reads the version
# the binary was built from.
JAEGER_VERSION=v1.76.0
jaeger_built() {
  [ -x "$BIN/jaeger" ] &&
    go version -m "$BIN/jaeger" 2>/dev/null | grep -Eq "^[[:space:]]+(mod|dep)[[:space:]]+github.com/jaegertracing/jaeger[[:space:]]+$JAEGER_VERSION([[:space:]]|\$)"
}
if command -v go >/dev/null 2>&1 && jaeger_built; then
  log "jaeger $JAEGER_VERSION already installed"
else
  need go
  mkdir -p "$BIN"
  log "go build jaeger $JAEGER_VERSION (tools/jaeger; several minutes the first time)"
  (cd "$ROOT/tools/jaeger" && go build -o "$BIN/jaeger" github.com/jaegertracing/jaeger/cmd/jaeger)
  jaeger_built || die "$BIN/jaeger is not jaeger $JAEGER_VERSION: $(go version -m "$BIN/jaeger" 2>&1 | grep jaegertracing/jaeger)"
fi

# binary -> the package that ships it.
bins=(prometheus promtool chromium chromedriver)
pkgs=(prometheus prometheus chromium chromium-driver)

missing=()
for i in "${!bins[@]}"; do
  if ! command -v "${bins[$i]}" >/dev/null 2>&1; then
    case " ${missing[*]-} " in
      *" ${pkgs[$i]} "*) ;;
      *) missing+=("${pkgs[$i]}") ;;
    esac
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  log "test tools already installed: ${bins[*]}"
  exit 0
fi

need apt-get
sudo=
[ "$(id -u)" = 0 ] || sudo=sudo

# Keep postinst scripts from starting daemons (prometheus would take :9090):
# invoke-rc.d and deb-systemd-invoke ask policy-rc.d, and 101 means "no".
# Docker images ship such a file already; add one only for this run.
policy=/usr/sbin/policy-rc.d
marker="# sloserve install-test-tools.sh"
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\n%s: no daemons started by package installs\nexit 101\n' "$marker" | $sudo tee "$policy" >/dev/null
  $sudo chmod 0755 "$policy"
  trap 'grep -qs "$marker" "$policy" && $sudo rm -f "$policy"' EXIT
fi

apt_install() {
  # Wait for another apt run (another engineer's setup) instead of failing.
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    -o DPkg::Lock::Timeout=600 "${missing[@]}" >/dev/null
}
log "apt-get install ${missing[*]}"
if ! apt_install; then
  log "apt-get update, then install again"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq -o DPkg::Lock::Timeout=600
  apt_install
fi

# On a host run by systemd the package enables its service for the next
# boot; the tests never want it, so a fresh install leaves it disabled.
case " ${missing[*]} " in
  *" prometheus "*)
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
      $sudo systemctl disable --now prometheus.service >/dev/null 2>&1 || true
    fi
    ;;
esac

for b in "${bins[@]}"; do
  command -v "$b" >/dev/null 2>&1 || die "'$b' is still missing after installing ${missing[*]}"
done
log "installed ${missing[*]}"
