#!/usr/bin/env bash
# Deletes the kind cluster made by e2e/kind/up.sh.
set -euo pipefail
name=${PAGODA_KIND_NAME:-pagoda-e2e}
kind delete cluster --name "$name"
rm -f "${PAGODA_KIND_KUBECONFIG:-$HOME/.cache/pagoda/kind-$name.kubeconfig}"
