#!/usr/bin/env bash
# The operators' tools the tests run for real, each installed once and cached:
#   scripts/tools.sh promtool|prometheus|otelcol|helm|kustomize|compose-check|all
# prints the path of each named tool on stdout (building it first when it is missing).
#   promtool       from Debian's `prometheus` package (apt-get download, unpacked)
#   prometheus     the Prometheus server from the same package (scrapes in the monitor test)
#   otelcol        an OpenTelemetry Collector built with the OpenTelemetry Collector Builder from
#                  scripts/tools/otelcol-builder.yaml
#   helm           helm built from its Go module
#   kustomize      kustomize built from its Go module
#   compose-check  scripts/tools/compose-check: compose-go's loader, `docker compose config`'s code
# Go builds go to $HAMI_USAGE_TOOLS (default ~/.cache/hami-usage-tools), shared by every checkout
# on the machine, keyed by version and input hash; a lock keeps parallel runs from building twice.
# They run under `nice` and with GOFLAGS=-p=2: a build shares the machine with the tests.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${HAMI_USAGE_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/hami-usage-tools}"
OTELCOL_VERSION=0.135.0
HELM_VERSION=3.19.0
HELM_K8S_MINOR=34
KUSTOMIZE_VERSION=5.5.0
# Debian bookworm's prometheus (2.42); the version is part of the cache key only.
PROMETHEUS_DEB=2.42.0

say() { echo "tools.sh: $*" >&2; }

need_go() {
    command -v go >/dev/null || { say "Go is needed to build $1 (https://go.dev/dl/)"; exit 2; }
}

hash_of() { cat "$@" | sha1sum | cut -c1-12; }

# build NAME KEY FUNCTION: run FUNCTION OUT (a fresh folder) unless $TOOLS/NAME-KEY/NAME exists.
build() {
    local name=$1 key=$2 fn=$3 dir="$TOOLS/$1-$2"
    if [[ ! -x "$dir/$name" ]]; then
        mkdir -p "$TOOLS"
        exec 9>"$TOOLS/.$name.lock"
        flock 9
        if [[ ! -x "$dir/$name" ]]; then
            [[ $name == promtool || $name == prometheus ]] || need_go "$name"
            say "building $name ($key) into $dir: a few minutes, once"
            rm -rf "$dir.tmp"
            mkdir -p "$dir.tmp"
            "$fn" "$dir.tmp" >&2
            rm -rf "$dir"
            mv "$dir.tmp" "$dir"
        fi
        exec 9>&-
    fi
    echo "$dir/$name"
}

# GOSUMDB: the checksum database is not reachable from every build machine (only the module proxy
# is), so modules are verified against the go.sum files where there is one (compose-check) and
# otherwise trusted as the proxy serves them at the pinned versions.
gobuild() { GOFLAGS="${GOFLAGS:-} -p=2 -trimpath" GOSUMDB="${GOSUMDB_TOOLS:-off}" nice -n 10 "$@"; }

build_otelcol() {
    local out=$1
    gobuild env GOBIN="$out/bin" go install "go.opentelemetry.io/collector/cmd/builder@v$OTELCOL_VERSION"
    sed "s|OUTPUT_PATH|$out/src|" "$ROOT/scripts/tools/otelcol-builder.yaml" >"$out/builder.yaml"
    gobuild "$out/bin/builder" --config "$out/builder.yaml"
    mv "$out/src/otelcol-hami-usage" "$out/otelcol"
    rm -rf "$out/src" "$out/bin"
}

# The -X flags are what helm's Makefile sets: its version, and the Kubernetes version `helm
# template` and `helm lint` assume without --kube-version (that of its client-go, 1.34).
build_helm() {
    local x="-X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION"
    local k
    for k in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
        x+=" -X $k.k8sVersionMajor=1 -X $k.k8sVersionMinor=$HELM_K8S_MINOR"
    done
    gobuild env GOBIN="$1" go install -ldflags "-s -w $x" "helm.sh/helm/v3/cmd/helm@v$HELM_VERSION"
}

build_kustomize() {
    gobuild env GOBIN="$1" go install "sigs.k8s.io/kustomize/kustomize/v5@v$KUSTOMIZE_VERSION"
}

build_compose_check() {
    (cd "$ROOT/scripts/tools/compose-check" && gobuild go build -o "$1/compose-check" .)
}

# A binary of Debian's `prometheus` package, unpacked without installing it: the package would
# set up (and, without systemd, start) a Prometheus server.
unpack_prometheus_deb() {
    (cd "$1" && apt-get download prometheus >&2 \
        || { apt-get update -qq >&2 && apt-get download prometheus >&2; })
    dpkg-deb -x "$1"/prometheus_*.deb "$1/deb"
    mv "$1/deb/usr/bin/$2" "$1/$2"
    rm -rf "$1/deb" "$1"/prometheus_*.deb
}

build_promtool() { unpack_prometheus_deb "$1" promtool; }

build_prometheus() { unpack_prometheus_deb "$1" prometheus; }

tool() {
    case "$1" in
        promtool) build promtool "$PROMETHEUS_DEB" build_promtool ;;
        prometheus) build prometheus "$PROMETHEUS_DEB" build_prometheus ;;
        otelcol) build otelcol "$OTELCOL_VERSION-$(hash_of "$ROOT/scripts/tools/otelcol-builder.yaml")" build_otelcol ;;
        helm) build helm "$HELM_VERSION-k8s1.$HELM_K8S_MINOR" build_helm ;;
        kustomize) build kustomize "$KUSTOMIZE_VERSION" build_kustomize ;;
        compose-check)
            build compose-check "$(hash_of "$ROOT"/scripts/tools/compose-check/{go.mod,go.sum,main.go})" \
                build_compose_check
            ;;
        all) for t in promtool prometheus otelcol helm kustomize compose-check; do tool "$t"; done ;;
        *) say "unknown tool $1 (promtool, prometheus, otelcol, helm, kustomize, compose-check, all)"; exit 2 ;;
    esac
}

[[ $# -gt 0 ]] || { say "usage: tools.sh promtool|prometheus|otelcol|helm|kustomize|compose-check|all ..."; exit 2; }
for name in "$@"; do tool "$name"; done
