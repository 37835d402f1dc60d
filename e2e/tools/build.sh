#!/usr/bin/env bash
# Builds the pinned Kubernetes control plane (kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl), etcd, kwok and helm from the Go module proxy into a cache outside the clone:
#   ${PAGODA_CACHE:-~/.cache/pagoda}/k8s/<k8s version>-<hash of the inputs>/bin
# Each binary is stamped on its own (steps.sh): an interrupted or failed build resumes where it stopped.
# The `.done` stamp is written last; a second run finds it and builds nothing. The last line of stdout is
# always the bin directory.
#
# PAGODA_K8S_BIN (or KUBEBUILDER_ASSETS, envtest's convention) pointing at a directory that already holds
# the binaries skips the build: that directory is printed instead.
set -euo pipefail

K8S_VERSION=v1.36.3
ETCD_VERSION=v3.6.16 # pinned in etcd/go.mod; here for the cache key and the README
KWOK_VERSION=v0.8.0
HELM_VERSION=v3.22.0
NEEDED=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok helm)

here=$(cd "$(dirname "$0")" && pwd)
log() { echo "build.sh: $*" >&2; }
# shellcheck source-path=SCRIPTDIR source=steps.sh
source "$here/steps.sh"

# A user-provided set of binaries wins. KUBEBUILDER_ASSETS (envtest) usually holds only etcd,
# kube-apiserver and kubectl: accept it only when the whole set is there.
for var in PAGODA_K8S_BIN KUBEBUILDER_ASSETS; do
    dir=${!var:-}
    [[ -n "$dir" ]] || continue
    missing=()
    for b in "${NEEDED[@]}"; do [[ -x "$dir/$b" ]] || missing+=("$b"); done
    if ((${#missing[@]} == 0)); then
        log "using $var=$dir"
        echo "$dir"
        exit 0
    fi
    if [[ $var == PAGODA_K8S_BIN ]]; then
        log "PAGODA_K8S_BIN=$dir lacks: ${missing[*]}"
        exit 1
    fi
    log "KUBEBUILDER_ASSETS=$dir lacks ${missing[*]}; building the full set instead"
done

key=$(cat "$0" "$here"/steps.sh "$here"/kube/go.mod "$here"/kube/go.sum "$here"/etcd/go.mod "$here"/etcd/go.sum \
    "$here"/etcd/main.go | sha256sum | cut -c1-12)
cache=${PAGODA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pagoda}/k8s/$K8S_VERSION-$key
if [[ -f $cache/.done ]]; then
    log "cached: $cache"
    echo "$cache/bin"
    exit 0
fi

avail_kb=$(df -Pk "$(go env GOCACHE 2>/dev/null || echo "$HOME")" 2>/dev/null | awk 'NR==2{print $4}' || echo 0)
if ((avail_kb > 0 && avail_kb < 6 * 1024 * 1024)); then
    log "only $((avail_kb / 1024)) MiB free: the first build needs about 6 GiB (module and build caches)"
    exit 1
fi

export GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0
export GOFLAGS=${PAGODA_GOFLAGS:--p=2}
out=$cache/bin
mkdir -p "$out"
start=$SECONDS

minor=$(echo "$K8S_VERSION" | cut -d. -f2)
ldf="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldf+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ldf+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done
build_kube() {
    (cd "$here/kube" && go build -mod=readonly -trimpath -ldflags "$ldf" -o "$out/" \
        k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
        k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl)
}
step "kube-$K8S_VERSION" build_kube

build_etcd() { (cd "$here/etcd" && go build -mod=readonly -trimpath -ldflags "-s -w" -o "$out/etcd" .); }
step "etcd-$ETCD_VERSION" build_etcd

kv=${K8S_VERSION#v}
build_kwok() {
    local kwok_src f s
    GOBIN=$out go install -trimpath \
        -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v} -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=$kv" \
        "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
    # The bare kwok binary has no built-in stages (kwokctl embeds them): keep kwok's own default stages
    # next to the binaries, read from the module that was just downloaded.
    kwok_src=$(go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" |
        python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])')
    mkdir -p "$cache/kwok-stages"
    for s in node/fast node/heartbeat-with-lease pod/fast; do
        for f in "$kwok_src/kustomize/stage/$s"/*.yaml; do
            [[ $(basename "$f") == kustomization.yaml ]] && continue
            cp "$f" "$cache/kwok-stages/${s//\//-}-$(basename "$f")"
        done
    done
    chmod -R u+w "$cache/kwok-stages"
}
step "kwok-$KWOK_VERSION" build_kwok

hl="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for p in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    hl+=" -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$minor"
done
build_helm() { GOBIN=$out go install -trimpath -ldflags "$hl" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"; }
step "helm-$HELM_VERSION" build_helm

log "$(first_line "$out/kube-apiserver" --version)"
log "$(first_line "$out/etcd" --version)"
log "$(first_line "$out/helm" version --short)"
echo "k8s=$K8S_VERSION etcd=$ETCD_VERSION kwok=$KWOK_VERSION helm=$HELM_VERSION seconds=$((SECONDS - start))" \
    >"$cache/.done"
log "built in $((SECONDS - start))s: $cache/bin ($(du -sh "$cache/bin" | cut -f1))"
echo "$cache/bin"
