#!/usr/bin/env bash
# Builds the real node's binaries into a cache outside the clone, the way build.sh builds the control
# plane: kubelet and kube-proxy at the same pinned Kubernetes version (wrapper module node/, generated
# by `kube/gen.sh ../node kubelet kube-proxy`), and the pause binary of the pod sandbox image (pause.c,
# static). Cache: ${PAGODA_CACHE:-~/.cache/pagoda}/k8s/node-<k8s version>-<hash of the inputs>/bin;
# each step is stamped on its own (steps.sh) and the `.done` stamp is written last, so a failed run
# resumes where it stopped and a second run builds nothing. The last line of stdout is the
# bin directory.
set -euo pipefail

K8S_VERSION=v1.36.3 # as in build.sh and node/go.mod
here=$(cd "$(dirname "$0")" && pwd)
log() { echo "build-node.sh: $*" >&2; }
# shellcheck source-path=SCRIPTDIR source=steps.sh
source "$here/steps.sh"

key=$(cat "$0" "$here"/steps.sh "$here"/node/go.mod "$here"/node/go.sum "$here"/node/pause.c | sha256sum | cut -c1-12)
cache=${PAGODA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pagoda}/k8s/node-$K8S_VERSION-$key
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

minor=$(echo "$K8S_VERSION" | cut -d. -f2)
ldf="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldf+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ldf+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done
build_node() {
    (cd "$here/node" && go build -mod=readonly -trimpath -ldflags "$ldf" -o "$out/" \
        k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy)
}
step "kubelet-$K8S_VERSION" build_node

build_pause() { gcc -static -Os -o "$out/pause" "$here/node/pause.c" && strip "$out/pause"; }
step pause build_pause

log "$(first_line "$out/kubelet" --version)"
echo "k8s=$K8S_VERSION seconds=$((SECONDS - start))" >"$cache/.done"
log "built in $((SECONDS - start))s: $cache/bin ($(du -sh "$cache/bin" | cut -f1))"
echo "$cache/bin"
