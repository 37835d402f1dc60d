#!/usr/bin/env bash
# Builds the e2e metrics pipeline's two servers, Prometheus and prometheus-adapter, from the Go module
# proxy into a cache outside the clone, the way build.sh builds the control plane:
#   ${PAGODA_CACHE:-~/.cache/pagoda}/k8s/metrics-<versions>-<hash of this script>/bin/{prometheus,adapter}
# Each server is stamped on its own (steps.sh), so a failed run resumes where it stopped; the `.done`
# stamp is written last, so a second run builds nothing. The last line of stdout is the bin
# directory.
#
# Each module is fetched by exact version with `go mod download` and built in a writable copy of it
# (GOMODCACHE is read-only), its requirements resolved as its own go.mod pins them:
# - `go install sigs.k8s.io/prometheus-adapter/cmd/adapter@v0.12.0` fails here (the proxy answers 403 to
#   the module's @v/list);
# - Prometheus: Debian's 2.42 package is built without Kubernetes service discovery, which the pipeline
#   needs. This build keeps the Kubernetes, file and HTTP discovery only (Prometheus's documented way to
#   choose: plugins.yml generates plugins/plugins.go), which leaves out the cloud SDKs, and has no
#   embedded web UI (tag `builtinassets` off: the UI needs an npm build; the tests use the HTTP API).
set -euo pipefail

ADAPTER_VERSION=v0.12.0
PROMETHEUS_VERSION=3.5.0 # the LTS release: Go module github.com/prometheus/prometheus v0.305.0
PROMETHEUS_MODULE=v0.305.0
log() { echo "build-metrics.sh: $*" >&2; }
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source-path=SCRIPTDIR source=steps.sh
source "$here/steps.sh"

key=$(cat "$0" "$here/steps.sh" | sha256sum | cut -c1-12)
cache=${PAGODA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pagoda}/k8s/metrics-$PROMETHEUS_VERSION-$ADAPTER_VERSION-$key
if [[ -f $cache/.done ]]; then
    log "cached: $cache"
    echo "$cache/bin"
    exit 0
fi

export GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0
export GOFLAGS=${PAGODA_GOFLAGS:--p=2}
out=$cache/bin
mkdir -p "$out"
start=$SECONDS
work=$(mktemp -d)
trap 'chmod -R u+w "$work"; rm -rf "$work"' EXIT

# A writable copy of module $1 at version $2, in $work; prints its path.
module_copy() {
    local src dir=$work/${1##*/}
    src=$(go mod download -json "$1@$2" | python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])')
    mkdir -p "$dir"
    cp -r "$src/." "$dir/"
    chmod -R u+w "$dir"
    echo "$dir"
}

build_adapter() {
    local dir
    dir=$(module_copy sigs.k8s.io/prometheus-adapter "$ADAPTER_VERSION")
    (cd "$dir" && go build -mod=mod -trimpath -ldflags "-s -w" -o "$out/adapter" ./cmd/adapter)
}
step "prometheus-adapter-$ADAPTER_VERSION" build_adapter

build_prometheus() {
    local dir pv=github.com/prometheus/common/version
    dir=$(module_copy github.com/prometheus/prometheus "$PROMETHEUS_MODULE")
    printf '%s\n' "// Package plugins registers the discovery this build keeps (minimum.go: file, http)." \
        "package plugins" "" 'import _ "github.com/prometheus/prometheus/discovery/kubernetes"' \
        >"$dir/plugins/plugins.go"
    (cd "$dir" && go build -mod=mod -trimpath -o "$out/prometheus" \
        -ldflags "-s -w -X $pv.Version=$PROMETHEUS_VERSION -X $pv.Branch=HEAD -X $pv.Revision=$PROMETHEUS_MODULE" \
        ./cmd/prometheus)
}
step "prometheus-$PROMETHEUS_VERSION" build_prometheus

log "$(first_line "$out/prometheus" --version)"
# --help exits 2 (pflag); the flag list shows that the binary runs.
usage=$("$out/adapter" --help 2>&1 || true)
[[ $usage == *--prometheus-url* ]] || { log "the built adapter does not run: $usage"; exit 1; }
echo "prometheus=$PROMETHEUS_VERSION prometheus-adapter=$ADAPTER_VERSION seconds=$((SECONDS - start))" \
    >"$cache/.done"
log "built in $((SECONDS - start))s: $cache/bin ($(du -sh "$cache/bin" | cut -f1))"
echo "$cache/bin"
