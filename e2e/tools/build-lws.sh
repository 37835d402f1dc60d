#!/usr/bin/env bash
# Builds what a model over several pods needs in the e2e cluster, from the Go module proxy, into a cache
# outside the clone, the way build-metrics.sh builds the metrics pipeline:
#   ${PAGODA_CACHE:-~/.cache/pagoda}/k8s/lws-<versions>-<hash of this script>/
#     bin/lws-controller   LeaderWorkerSet's controller manager (sigs.k8s.io/lws cmd/, with its webhooks)
#     bin/coredns          CoreDNS with the kubernetes, forward, errors, log and bind plugins only
#     manifests/           LWS's CRD and webhook configurations, as its module ships them
# Each binary is stamped on its own (steps.sh), so a failed run resumes where it stopped; the `.done`
# stamp is written last, so a second run builds nothing. The last line of stdout is the cache directory.
#
# Why CoreDNS: LWS gives every pod of a group its leader's DNS name (LWS_LEADER_ADDRESS,
# <group>.<lws>.<namespace>, a record of the headless Service LWS makes), which the workers resolve to
# reach rank 0. The cluster has no DNS until a test needs one (harness/lws.py starts it).
#
# Both modules are fetched by exact version with `go mod download` (the proxy answers 403 to `@v/list`
# of sigs.k8s.io/lws) and built in a writable copy, their requirements resolved as their go.mod pins them.
# CoreDNS's own main imports every plugin (cloud SDKs among them); a main of our own imports five.
set -euo pipefail

LWS_VERSION=v0.9.0 # the newest the proxy serves here (v0.9.1 and v0.10.0: 403); Kubernetes libraries 0.36
COREDNS_VERSION=v1.13.1
log() { echo "build-lws.sh: $*" >&2; }
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source-path=SCRIPTDIR source=steps.sh
source "$here/steps.sh"

key=$(cat "$0" "$here/steps.sh" | sha256sum | cut -c1-12)
cache=${PAGODA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pagoda}/k8s/lws-$LWS_VERSION-coredns-$COREDNS_VERSION-$key
if [[ -f $cache/.done ]]; then
    log "cached: $cache"
    echo "$cache"
    exit 0
fi

export GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0
export GOFLAGS=${PAGODA_GOFLAGS:--p=2}
out=$cache/bin
mkdir -p "$out" "$cache/manifests"
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

build_lws() {
    local dir v=sigs.k8s.io/lws/pkg/version
    dir=$(module_copy sigs.k8s.io/lws "$LWS_VERSION")
    (cd "$dir" && go build -mod=mod -trimpath -o "$out/lws-controller" \
        -ldflags "-s -w -X $v.GitVersion=$LWS_VERSION -X $v.BuildDate=2000-01-01T00:00:00Z" ./cmd)
    # The CRDs as the module ships them (their conversion webhook patch is left out: v1 is the only
    # version), and the webhook configurations (pointed at the host by harness/lws.py). The manager runs a
    # DisaggregatedSet controller too, and exits when its CRD is missing (its cache never syncs).
    cp "$dir/config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" "$cache/manifests/crd.yaml"
    cp "$dir/config/crd/bases/disaggregatedset.x-k8s.io_disaggregatedsets.yaml" \
        "$cache/manifests/disaggregatedset-crd.yaml"
    cp "$dir/config/webhook/manifests.yaml" "$cache/manifests/webhooks.yaml"
}
step "lws-$LWS_VERSION" build_lws

build_coredns() {
    local dir
    dir=$(module_copy github.com/coredns/coredns "$COREDNS_VERSION")
    mkdir -p "$dir/cmd/pagoda-coredns"
    printf '%s\n' "// Command pagoda-coredns is CoreDNS with the plugins the e2e cluster uses." "package main" "" \
        "import (" '	"github.com/coredns/coredns/coremain"' \
        '	_ "github.com/coredns/coredns/plugin/bind"' '	_ "github.com/coredns/coredns/plugin/errors"' \
        '	_ "github.com/coredns/coredns/plugin/forward"' '	_ "github.com/coredns/coredns/plugin/kubernetes"' \
        '	_ "github.com/coredns/coredns/plugin/log"' ")" "" "func main() { coremain.Run() }" \
        >"$dir/cmd/pagoda-coredns/main.go"
    (cd "$dir" && go build -mod=mod -trimpath -ldflags "-s -w" -o "$out/coredns" ./cmd/pagoda-coredns)
}
step "coredns-$COREDNS_VERSION" build_coredns

log "$(first_line "$out/lws-controller" --version)"
log "$(first_line "$out/coredns" -version)"
echo "lws=$LWS_VERSION coredns=$COREDNS_VERSION seconds=$((SECONDS - start))" >"$cache/.done"
log "built in $((SECONDS - start))s: $cache ($(du -sh "$cache" | cut -f1))"
echo "$cache"
