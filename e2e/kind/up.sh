#!/usr/bin/env bash
# The e2e suite on a kind cluster (needs Docker, kind, kubectl and internet access for kwok's manifests):
#   e2e/kind/up.sh            # creates the cluster, installs kwok, adds the simulated GPU nodes
#   PAGODA_E2E_KUBECONFIG=$(e2e/kind/up.sh | tail -1) make e2e
#   e2e/kind/down.sh
# The tests are the same: the `cluster` fixture uses the kubeconfig instead of starting its own cluster.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
name=${PAGODA_KIND_NAME:-pagoda-e2e}
kwok=${KWOK_VERSION:-v0.8.0}
kubeconfig=${PAGODA_KIND_KUBECONFIG:-$HOME/.cache/pagoda/kind-$name.kubeconfig}
mkdir -p "$(dirname "$kubeconfig")"
python=${PYTHON:-$repo/.venv/bin/python}

kind get clusters 2>/dev/null | grep -qx "$name" ||
    kind create cluster --name "$name" --config "$here/kind-config.yaml" --kubeconfig "$kubeconfig" >&2
kind get kubeconfig --name "$name" >"$kubeconfig"
export KUBECONFIG=$kubeconfig

# kwok in the cluster, managing nodes annotated kwok.x-k8s.io/node=fake, with the fast stages.
base=https://github.com/kubernetes-sigs/kwok/releases/download/$kwok
kubectl apply -f "$base/kwok.yaml" >&2
kubectl apply -f "$base/stage-fast.yaml" >&2
kubectl -n kube-system rollout status deployment/kwok-controller --timeout=120s >&2

# The simulated GPU nodes: the catalogue of the local cluster. Creating a Node keeps its status
# (allocatable nvidia.com/gpu); `create` is a no-op error for nodes that exist already.
PYTHONSAFEPATH=1 "$python" "$repo/e2e/harness/nodes.py" | kubectl create -f - >&2 || true
kubectl wait --for=condition=Ready node -l type=kwok --timeout=120s >&2
kubectl get nodes -L nvidia.com/gpu.product,nvidia.com/gpu.count >&2
echo "$kubeconfig"
