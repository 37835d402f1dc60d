"""The Kubernetes objects of one InferenceService, as pure functions returning dicts.

No API calls and no owner references here: reconcile.py adopts and applies what these return. The
contract with the pod is only the container's args and env (`pagoda serve --help`).
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pagoda.operator import router
from pagoda.operator.gpus import GPU_TOLERATION, PRODUCT, RESOURCE
from pagoda.operator.model_mounts import (
    adapter_path,
    adapter_volumes,
    container_security,
    model_path,
    model_volumes,
)
from pagoda.operator.profile import Decision
from pagoda.operator.spec import OperatorConfig, ServiceSpec

HTTP_PORT = 8000  # OpenAI API, /v1/health/*, /metrics
GRPC_PORT = 8001
METRICS_PORT = 9090  # a Service port named for scrapers; the server serves /metrics on HTTP_PORT
# The server's metric names (service/metrics.py; tests/test_operator_manifests.py holds them together).
QUEUE_METRIC = "pagoda_requests_waiting"
KV_CACHE_METRIC = "pagoda_kv_cache_usage_ratio"
DCGM_METRIC = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
KERNEL_CACHE_DIR = "/var/cache/pagoda/triton"
HOME_CACHE_DIR = "/home/pagoda/.cache"  # HF_HOME, XDG caches: writable under a read-only root
GIB = 1024**3
_WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}
SHUTDOWN_MARGIN_SECONDS = 15  # closing the servers after the drain
# A deleted pod leaves the Service's endpoints while the kubelet already stops it: kube-proxy (and
# ingress controllers) route new requests to it for a second or more, which a draining server refuses
# with 503 (1 of 16 requests in a rolling update on the e2e real node). Waiting before SIGTERM lets the
# endpoint update land first, as Kubernetes' own docs recommend.
PRESTOP_SLEEP_SECONDS = 5
ANNOTATION_PROFILE = "serving.pagoda.dev/profile"
# LeaderWorkerSet (sigs.k8s.io/lws): a model over several pods. LWS labels every pod of a group with its
# index in the group (the leader's is 0) and gives each container its leader's DNS name and its own index.
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
# Its name: the service's + this. LWS makes a headless Service of its own name for the leaders' DNS
# names, and finds the InferenceService's Service there if they share one (then no pod gets a DNS record,
# and the workers never find their leader).
LWS_SUFFIX = "-group"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
# Rank 0's rendezvous on the leader (torch's TCPStore): one port every pod of a group agrees on. A pod has
# its own network namespace, so a fixed port collides with nothing (29500 is torch.distributed's default).
MASTER_PORT = 29500


def selector_labels(spec: ServiceSpec) -> dict[str, str]:
    """Two labels, never changed after creation (a Deployment's selector is immutable)."""
    return {"app.kubernetes.io/name": "pagoda-server", "app.kubernetes.io/instance": spec.name}


def labels(spec: ServiceSpec) -> dict[str, str]:
    return selector_labels(spec) | {
        "app.kubernetes.io/component": "inference-server",
        "app.kubernetes.io/part-of": "pagoda",
        "app.kubernetes.io/managed-by": "pagoda-operator",
    }


def _meta(spec: ServiceSpec) -> dict[str, Any]:
    return {"name": spec.name, "namespace": spec.namespace, "labels": labels(spec)}


def _quantity(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def server_args(
    spec: ServiceSpec, decision: Decision, config: OperatorConfig, role: Role = "server"
) -> list[str]:
    """The profile and engine settings as `pagoda serve` flags: reserved.OPERATOR_FLAGS, then extraArgs.

    A group's pods (role leader or worker) also get their place in it: the pipeline's depth, the number
    of pods, the pod's rank (the leader 0, a worker its LWS index, which the kubelet expands from the
    environment LWS gives it), rank 0's address and port; a worker runs headless (no API).
    """
    engine = spec.engine
    args = [
        "--model", model_path(spec),
        "--served-model-name", spec.model_name,
        "--precision", str(decision.precision),
        "--tensor-parallel-size", str(decision.tensor_parallel_size),
    ]  # fmt: skip
    if role != "server":
        rank = "0" if role == "leader" else f"$({WORKER_INDEX_ENV})"
        args += [
            "--pipeline-parallel-size", str(decision.pipeline_parallel_size),
            "--nnodes", str(decision.num_nodes),
            "--node-rank", rank,
            "--master-addr", f"$({LEADER_ADDRESS_ENV})",
            "--master-port", str(MASTER_PORT),
        ]  # fmt: skip
    args += [
        "--gpu-memory-utilization", str(engine.kv_cache_fraction),
        "--enable-prefix-caching" if engine.is_prefix_caching else "--no-enable-prefix-caching",
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--grpc-port", str(GRPC_PORT),
        "--drain-timeout", str(config.drain_seconds),
    ]  # fmt: skip
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    if engine.max_num_seqs is not None:
        args += ["--max-num-seqs", str(engine.max_num_seqs)]
    if engine.kv_cache_dtype is not None:
        args += ["--kv-cache-dtype", engine.kv_cache_dtype]
    if engine.api_server_count is not None:
        args += ["--api-server-count", str(engine.api_server_count)]
    if spec.speculative is not None:
        args += ["--speculative-config", spec.speculative.config_json()]
    if spec.adapters:
        args += ["--enable-lora", "--lora-modules"]
        args += [f"{adapter.name}={adapter_path(spec, adapter)}" for adapter in spec.adapters]
        args += ["--max-loras", str(engine.max_loras), "--max-lora-rank", str(engine.max_lora_rank)]
        if engine.max_cpu_loras is not None:
            args += ["--max-cpu-loras", str(engine.max_cpu_loras)]
    if role == "worker":
        args.append("--headless")
    return args + list(engine.extra_args)


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _affinity(spec: ServiceSpec, decision: Decision) -> dict[str, Any]:
    """The user's affinity, with `gpu.product in (chosen)` ANDed into every required node term."""
    assert decision.gpu is not None
    affinity = copy.deepcopy(dict(spec.affinity or {}))
    expression = {"key": PRODUCT, "operator": "In", "values": list(decision.gpu.labels)}
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        term["matchExpressions"] = [*term.get("matchExpressions", []), expression]
    required["nodeSelectorTerms"] = terms
    return affinity


def default_requests(spec: ServiceSpec, decision: Decision) -> dict[str, str]:
    """CPU and memory to reserve, sized from the model (Burstable QoS: no CPU/memory limits by default).

    CPU: one core per GPU rank (the API process and the engine core mostly wait on the GPU, and may
    burst above the request). Memory: 2 GiB per rank (CUDA context, NCCL, pinned buffers) plus half
    the weights, read through the page cache while loading: Llama-3.1-8B fp8 at TP 1 asks 1 core and
    6 GiB, a 70B bf16 at TP 4 asks 4 cores and 74 GiB, the embedded 135M model 1 core and 3 GiB (so it
    still fits a 2-core test node). With engine.apiServerCount N > 1, at least N + 1 cores: more API
    processes are run because one saturates its core, and the engine core keeps one. spec.resources.requests
    overrides either.
    """
    tp = decision.tensor_parallel_size or 1
    # A pod of a group over several pods holds one pipeline stage: its share of the layers.
    weights = spec.model.num_params * _WEIGHT_BYTES.get(str(decision.precision), 2)
    weights //= decision.pipeline_parallel_size
    memory_gib = 2 * tp + -(-weights // (2 * GIB))
    api_servers = spec.engine.api_server_count or 1
    cpu = max(tp, api_servers + 1) if api_servers > 1 else tp
    return {"cpu": str(cpu), "memory": f"{memory_gib}Gi"}


def _resources(spec: ServiceSpec, decision: Decision) -> dict[str, Any]:
    """The user's resources over the defaults; nvidia.com/gpu is always the TP degree."""
    tp = decision.tensor_parallel_size or 1
    resources = copy.deepcopy(dict(spec.resources))
    requests = resources.get("requests") or {}
    resources["requests"] = default_requests(spec, decision) | requests | {RESOURCE: str(tp)}
    resources["limits"] = {**(resources.get("limits") or {}), RESOURCE: str(tp)}
    return resources


def _probe(path: str, period: int, failures: int, port: str = "http") -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _api_key_env(spec: ServiceSpec) -> list[dict[str, Any]]:
    """The API key, from its Secret into the environment: never an argument, which the pod spec shows."""
    if spec.api_key_secret is None:
        return []
    name, key = spec.api_key_secret
    return [{"name": "PAGODA_API_KEY", "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}]


Role = Literal["server", "leader", "worker"]  # a Deployment's pod; a LeaderWorkerSet group's pods


def _pod_template(
    spec: ServiceSpec, decision: Decision, config: OperatorConfig, role: Role
) -> dict[str, Any]:
    """The pod of a Deployment (`server`), or of a LeaderWorkerSet group: its `leader` (rank 0, the API,
    behind the Service) or a `worker` (the other stages, headless: only /health on the http port)."""
    gpu, tp = decision.gpu, decision.tensor_parallel_size
    if gpu is None or tp is None:
        raise ValueError("a workload needs a selected profile")
    arch = f"sm{gpu.compute_capability[0]}{gpu.compute_capability[1]}"
    volumes, mounts, init_containers = model_volumes(spec, config)
    for got, more in zip((volumes, mounts, init_containers), adapter_volumes(spec, config), strict=True):
        got.extend(more)
    cache_dir = f"{KERNEL_CACHE_DIR}/{arch}"  # kernels compiled for one architecture never mix
    if config.kernel_cache_pvc:
        volumes.append(
            {"name": "kernel-cache", "persistentVolumeClaim": {"claimName": config.kernel_cache_pvc}}
        )
        mounts.append({"name": "kernel-cache", "mountPath": cache_dir, "subPath": arch})
    else:
        volumes.append({"name": "kernel-cache", "emptyDir": {}})
        mounts.append({"name": "kernel-cache", "mountPath": cache_dir})
    # The root filesystem is read-only: what the server, torch and Hugging Face write goes here.
    volumes += [
        {"name": "tmp", "emptyDir": {"sizeLimit": "4Gi"}},
        {"name": "cache", "emptyDir": {"sizeLimit": "8Gi"}},
    ]
    mounts += [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": HOME_CACHE_DIR}]
    if tp > 1:
        # NCCL moves data between ranks through /dev/shm; the container default of 64 MiB crashes it.
        # 2 GiB per rank is a limit, not a reservation: pages count against the pod's memory only
        # as they are used (vLLM's docs likewise give TP containers a few GiB of shm).
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{2 * tp}Gi"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    is_worker = role == "worker"
    container: dict[str, Any] = {
        "name": "server",
        "image": spec.image or config.server_image,
        "command": ["pagoda", "serve"],
        "args": server_args(spec, decision, config, role),
        "env": [
            {"name": "TRITON_CACHE_DIR", "value": cache_dir},
            {"name": "XDG_CACHE_HOME", "value": HOME_CACHE_DIR},
            {"name": "HF_HOME", "value": f"{HOME_CACHE_DIR}/huggingface"},
            # The CPU request, whole CPUs rounded up: a CPU engine's torch threads (a Burstable pod has no
            # CPU quota to size them by; service/engine/runner/cpu_threads.py).
            {
                "name": "PAGODA_CPU_REQUEST",
                "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1"}},
            },
            *_api_key_env(spec),
            *spec.env,
        ],
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
        ],
        "resources": _resources(spec, decision),
        "volumeMounts": [*mounts, *spec.volume_mounts],
        # Startup gates liveness until the model is loaded; loads of large checkpoints take minutes.
        "startupProbe": _probe("/v1/health/ready", 10, max(1, config.startup_timeout_seconds // 10)),
        "readinessProbe": _probe("/v1/health/ready", 5, 3),
        "livenessProbe": _probe("/v1/health/live", 10, 6),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        # A server that exits at start (no such checkpoint, a refused flag) says why in its last log
        # lines; the kubelet keeps them as the termination message, which status quotes (pods.py).
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security(),
    }
    if is_worker:
        # A worker serves no API: only /health on the same port, which its probes read. The port is named
        # `health`, not `http`, so that the servers' PodMonitor (port http, /metrics) leaves it out; no
        # Service selects it, so it has no endpoint to leave before SIGTERM either.
        container["ports"] = [{"name": "health", "containerPort": HTTP_PORT, "protocol": "TCP"}]
        container["startupProbe"] = _probe(
            "/health", 10, max(1, config.startup_timeout_seconds // 10), "health"
        )
        container["readinessProbe"] = _probe("/health", 5, 3, "health")
        container["livenessProbe"] = _probe("/health", 10, 6, "health")
        del container["lifecycle"]
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [*volumes, *spec.volumes],
        "affinity": _affinity(spec, decision),
        "tolerations": [*spec.tolerations, GPU_TOLERATION],
        "terminationGracePeriodSeconds": config.drain_seconds
        + PRESTOP_SLEEP_SECONDS
        + SHUTDOWN_MARGIN_SECONDS,
        "securityContext": _pod_security(),
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    optional = {
        "nodeSelector": dict(spec.node_selector) or None,
        "runtimeClassName": spec.runtime_class_name,
        "priorityClassName": spec.priority_class_name,
        "serviceAccountName": spec.service_account_name,
        "imagePullSecrets": [{"name": s} for s in spec.image_pull_secrets] or None,
    }
    pod_spec |= {k: v for k, v in optional.items() if v is not None}
    annotations = {**spec.pod_annotations, ANNOTATION_PROFILE: profile_annotation(decision)}
    if not is_worker:
        annotations |= {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(HTTP_PORT),
            "prometheus.io/path": "/metrics",
        }
    return {
        "metadata": {"labels": {**spec.pod_labels, **labels(spec)}, "annotations": annotations},
        "spec": pod_spec,
    }


def profile_annotation(decision: Decision) -> str:
    """`NVIDIA-H200/fp8/tp1`, or `NVIDIA-H100-80GB-HBM3/bf16/tp8/pp2` for a group over several pods: the
    running profile, read back by placement.current_profile."""
    assert decision.gpu is not None
    profile = f"{decision.gpu.product}/{decision.precision}/tp{decision.tensor_parallel_size}"
    return profile + (f"/pp{decision.pipeline_parallel_size}" if decision.is_multi_node else "")


def _rolling(decision: Decision) -> dict[str, int]:
    # A replica that takes every GPU of a node can rarely surge: replace it in place instead.
    assert decision.gpu is not None and decision.tensor_parallel_size is not None
    if decision.tensor_parallel_size >= decision.gpu.num_gpus:
        return {"maxSurge": 0, "maxUnavailable": 1}
    return {"maxSurge": 1, "maxUnavailable": 0}


def deployment(spec: ServiceSpec, decision: Decision, config: OperatorConfig) -> dict[str, Any]:
    template = _pod_template(spec, decision, config, "server")
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(spec) | {"annotations": {ANNOTATION_PROFILE: profile_annotation(decision)}},
        "spec": {
            "selector": {"matchLabels": selector_labels(spec)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": _rolling(decision)},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": config.startup_timeout_seconds + 600,
            "template": template,
        },
    }
    if spec.autoscaling is None:  # with autoscaling the HPA owns the Deployment's replicas
        body["spec"]["replicas"] = spec.replicas
    return body


def leader_worker_set(spec: ServiceSpec, decision: Decision, config: OperatorConfig) -> dict[str, Any]:
    """A model over several pods (decision.is_multi_node): a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1)
    named `<name>-group` (LWS_SUFFIX), whose replicas are groups of num_nodes pods, one pipeline stage
    each: pods `<name>-group-<group>` (the leader) and `<name>-group-<group>-<index>`.

    - startupPolicy LeaderCreated: the workers start with the leader. LeaderReady would wait for a leader
      that is never ready without them (its engine needs every stage before it serves).
    - restartPolicy RecreateGroupOnPodRestart: a stage that dies (a restarted container, a deleted or
      evicted pod) leaves the others waiting on a dead peer; the whole group starts again, as one.
    - rolloutStrategy: one group at a time, with a surge group only where a pod does not take a whole
      node (as the Deployment's), and the same subdomain for every group (the leaders' DNS names, which
      LWS_LEADER_ADDRESS carries).
    """
    gpu = decision.gpu
    assert gpu is not None
    meta = _meta(spec) | {"name": spec.name + LWS_SUFFIX}
    body: dict[str, Any] = {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": meta | {"annotations": {ANNOTATION_PROFILE: profile_annotation(decision)}},
        "spec": {
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": _rolling(decision)},
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": decision.num_nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _pod_template(spec, decision, config, "leader"),
                "workerTemplate": _pod_template(spec, decision, config, "worker"),
            },
        },
    }
    if spec.autoscaling is None:  # with autoscaling the HPA owns the groups (the scale subresource)
        body["spec"]["replicas"] = spec.replicas
    return body


def workload(spec: ServiceSpec, decision: Decision, config: OperatorConfig) -> dict[str, Any]:
    """The pods' owner: a Deployment, or a LeaderWorkerSet where one replica spans several pods."""
    if decision.is_multi_node:
        return leader_worker_set(spec, decision, config)
    return deployment(spec, decision, config)


def server_selector(spec: ServiceSpec, is_group: bool = False) -> dict[str, str]:
    """The pods that serve the API: every server pod, or of LeaderWorkerSet groups (is_group) the leaders
    only (a worker runs no API)."""
    return selector_labels(spec) | ({WORKER_INDEX_LABEL: "0"} if is_group else {})


def service(spec: ServiceSpec, router_ready: bool = True, is_group: bool = False) -> dict[str, Any]:
    """The InferenceService's Service: the router's pods when there is one and one of them is Ready,
    else the servers' (the groups' leaders, is_group). A router being added (or with no Ready pod)
    leaves the clients on the servers rather than on a selector with no endpoints."""
    meta = _meta(spec) | ({"annotations": dict(spec.service_annotations)} if spec.service_annotations else {})
    if spec.router.enabled and router_ready:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {
                "type": spec.service_type,
                "selector": router.selector_labels(spec.name),
                "ports": [
                    {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                    {"name": "router-metrics", "port": router.METRICS_PORT, "targetPort": "metrics"},
                ],
            },
        }
    body = servers_service(spec, is_group)
    body["metadata"] = meta
    body["spec"]["type"] = spec.service_type
    return body


def servers_service(spec: ServiceSpec, is_group: bool = False) -> dict[str, Any]:
    """The server pods' own Service (`<name>-servers` beside a router; the main one without)."""
    name = f"{spec.name}-servers" if spec.router.enabled else spec.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": spec.namespace, "labels": labels(spec)},
        "spec": {
            "type": "ClusterIP",
            "selector": server_selector(spec, is_group),
            "ports": [
                {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {
                    "name": "grpc",
                    "port": GRPC_PORT,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    "appProtocol": "grpc",
                },
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def _pods_metric(name: str, target: float) -> dict[str, Any]:
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": name},
            "target": {"type": "AverageValue", "averageValue": _quantity(target)},
        },
    }


def hpa(spec: ServiceSpec, is_group: bool = False) -> dict[str, Any] | None:
    """is_group: the HPA scales the LeaderWorkerSet (its scale subresource: whole groups; the pods it
    averages the metrics over are the leaders, LWS's status.hpaPodSelector)."""
    scaling = spec.autoscaling
    if scaling is None:
        return None
    metrics = [
        _pods_metric(QUEUE_METRIC, scaling.target_queue_depth),
        _pods_metric(KV_CACHE_METRIC, scaling.target_kv_cache_usage),
    ]
    if scaling.target_gpu_activity is not None:
        metrics.append(_pods_metric(DCGM_METRIC, scaling.target_gpu_activity))
    body: dict[str, Any] = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(spec),
        "spec": {
            "scaleTargetRef": (
                {"apiVersion": LWS_API_VERSION, "kind": "LeaderWorkerSet", "name": spec.name + LWS_SUFFIX}
                if is_group
                else {"apiVersion": "apps/v1", "kind": "Deployment", "name": spec.name}
            ),
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": metrics,
        },
    }
    if scaling.behavior:
        body["spec"]["behavior"] = copy.deepcopy(dict(scaling.behavior))
    return body


def pdb(spec: ServiceSpec) -> dict[str, Any]:
    # maxUnavailable, not minAvailable: a single replica must not block node drains forever. Over the pods
    # of LeaderWorkerSet groups (leaders and workers alike) the same budget means one group at a time: an
    # evicted pod takes its whole group down (RecreateGroupOnPodRestart), whose pods are then not ready,
    # so no pod of any group is evicted until that group is whole and ready again.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(spec),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(spec)}},
    }


def ingress(spec: ServiceSpec) -> dict[str, Any] | None:
    """spec.ingress: the Service's http port behind the cluster's ingress controller (OpenAI clients
    and agents outside the cluster reach /v1 through it)."""
    if spec.ingress is None:
        return None
    ing = spec.ingress
    backend = {"service": {"name": spec.name, "port": {"name": "http"}}}
    rule: dict[str, Any] = {"http": {"paths": [{"path": ing.path, "pathType": "Prefix", "backend": backend}]}}
    if ing.host:
        rule["host"] = ing.host
    body: dict[str, Any] = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": _meta(spec) | ({"annotations": dict(ing.annotations)} if ing.annotations else {}),
        "spec": {"rules": [rule]},
    }
    if ing.class_name:
        body["spec"]["ingressClassName"] = ing.class_name
    if ing.tls_secret_name:
        body["spec"]["tls"] = [{"hosts": [ing.host] if ing.host else [], "secretName": ing.tls_secret_name}]
    return body


def http_route(spec: ServiceSpec) -> dict[str, Any] | None:
    """spec.httpRoute: the Service's http port behind the cluster's Gateway (Gateway API), as the
    Ingress is behind an ingress controller; the route's backend is the Service, so a router in front
    of the servers stays in the path."""
    if spec.http_route is None:
        return None
    route = spec.http_route
    rule = {
        "matches": [{"path": {"type": "PathPrefix", "value": route.path}}],
        "backendRefs": [{"name": spec.name, "port": HTTP_PORT}],
    }
    body: dict[str, Any] = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": _meta(spec) | ({"annotations": dict(route.annotations)} if route.annotations else {}),
        "spec": {"parentRefs": [dict(r) for r in route.parent_refs], "rules": [rule]},
    }
    if route.hostnames:
        body["spec"]["hostnames"] = list(route.hostnames)
    return body


def children(
    spec: ServiceSpec, decision: Decision, config: OperatorConfig, router_ready: bool = True
) -> list[dict[str, Any]]:
    """Every object this InferenceService should own, in apply order. `router_ready`: whether the
    router Deployment has a Ready pod (the Service moves to it only then)."""
    is_group = decision.is_multi_node
    objects = [
        service(spec, router_ready, is_group),
        pdb(spec),
        workload(spec, decision, config),
        hpa(spec, is_group),
        ingress(spec),
    ]
    objects += [http_route(spec)]
    if spec.router.enabled:
        placement = {
            "nodeSelector": dict(spec.node_selector) or None,
            "tolerations": list(spec.tolerations) or None,
            "imagePullSecrets": [{"name": s} for s in spec.image_pull_secrets] or None,
        }
        objects += [servers_service(spec, is_group)]
        objects += router.children(
            spec.name,
            spec.namespace,
            image=spec.image or config.server_image,
            image_pull_policy=spec.image_pull_policy,
            server_selector=server_selector(spec, is_group),
            server_port=HTTP_PORT,
            policy=spec.router.policy,
            replicas=spec.router.replicas,
            api_key_env=_api_key_env(spec),
            pod_security=_pod_security(),
            container_security=container_security(),
            placement={k: v for k, v in placement.items() if v is not None},
        )
    return [o for o in objects if o is not None]


def urls(spec: ServiceSpec, config: OperatorConfig) -> dict[str, str]:
    """Where clients go: the Service (the router's, with one); gRPC, which the router does not carry,
    to the servers' own Service."""
    host = f"{spec.name}.{spec.namespace}.svc.{config.cluster_domain}"
    grpc_host = f"{servers_service(spec)['metadata']['name']}.{spec.namespace}.svc.{config.cluster_domain}"
    return {"url": f"http://{host}:{HTTP_PORT}/v1", "grpcAddress": f"{grpc_host}:{GRPC_PORT}"}
