"""The manifest builders: pure dicts, checked field by field, and the contracts with the server."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.operator import manifests
from pagoda.operator.gpus import GpuGroup
from pagoda.operator.profile import Decision
from pagoda.operator.spec import OperatorConfig, parse_spec

ROOT = Path(__file__).resolve().parents[1]
CONFIG = OperatorConfig()
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
H100 = GpuGroup("NVIDIA-H100-80GB-HBM3", (9, 0), 81559, 8, labels=("NVIDIA-H100-80GB-HBM3",))


def body(**spec: object) -> dict:
    base = {"model": {"name": "llama-3.1-8b", "source": {"imagePath": "/models/llama"}}}
    return {
        "apiVersion": "serving.pagoda.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "llm", "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": base | spec,
    }


def decision(tp: int = 1, precision: str = "fp8", gpu: GpuGroup = H100) -> Decision:
    return Decision(
        True, "fits", gpu=gpu, precision=precision, tensor_parallel_size=tp, kv_cache_dtype=precision
    )


def pod(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]


def test_deployment_carries_the_profile() -> None:
    dep = manifests.deployment(parse_spec(body()), decision(), CONFIG)
    container = pod(dep)["containers"][0]
    args = container["args"]
    assert args[args.index("--precision") + 1] == "fp8"
    assert args[args.index("--tensor-parallel-size") + 1] == "1"
    assert args[args.index("--model") + 1] == "/models/llama"
    assert args[args.index("--served-model-name") + 1] == "llama-3.1-8b"
    assert container["command"] == ["pagoda", "serve"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    term = pod(dep)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term == [
        {
            "matchExpressions": [
                {"key": "nvidia.com/gpu.product", "operator": "In", "values": [H100.labels[0]]}
            ]
        }
    ]
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "pagoda-server",
        "app.kubernetes.io/instance": "llm",
    }
    assert not any(v["name"] == "dshm" for v in pod(dep)["volumes"])
    # Kernels are cached per architecture.
    assert {"name": "TRITON_CACHE_DIR", "value": "/var/cache/pagoda/triton/sm90"} in container["env"]
    # The CPU request, for a CPU engine's threads (a Burstable pod has no quota to size them by).
    request = {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1"}}
    assert {"name": "PAGODA_CPU_REQUEST", "valueFrom": request} in container["env"]
    assert pod(dep)["securityContext"]["runAsNonRoot"] is True


def test_probes_and_termination_follow_the_server() -> None:
    config = OperatorConfig(startup_timeout_seconds=1200, drain_seconds=60)
    dep = manifests.deployment(parse_spec(body()), decision(), config)
    container = pod(dep)["containers"][0]
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/v1/health/ready"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200
    assert container["readinessProbe"]["httpGet"]["path"] == "/v1/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v1/health/live"
    # The preStop pause lets the endpoint removal reach kube-proxy before the drain refuses requests.
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop >= 3 and pod(dep)["terminationGracePeriodSeconds"] > 60 + pre_stop
    args = container["args"]
    assert args[args.index("--drain-timeout") + 1] == "60"


def test_tensor_parallel_gets_shared_memory_and_gpus() -> None:
    dep = manifests.deployment(parse_spec(body(precision="bf16")), decision(4, "bf16"), CONFIG)
    volumes = {v["name"]: v for v in pod(dep)["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}  # 2 GiB per rank
    mounts = {m["name"]: m["mountPath"] for m in pod(dep)["containers"][0]["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"
    assert pod(dep)["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "4"
    whole_node = manifests.deployment(parse_spec(body()), decision(8, "bf16"), CONFIG)
    assert {v["name"]: v for v in pod(whole_node)["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "16Gi"
    assert whole_node["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    # The smallest TP needs it too (NCCL's shared-memory transport between two ranks).
    two = manifests.deployment(parse_spec(body(precision="bf16")), decision(2, "bf16"), CONFIG)
    assert {v["name"]: v for v in pod(two)["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "4Gi"


def test_model_sources() -> None:
    pvc = parse_spec(
        body(model={"name": "x", "parameters": "7B", "source": {"pvc": {"claimName": "m", "path": "a/b"}}})
    )
    dep = manifests.deployment(pvc, decision(), CONFIG)
    assert pod(dep)["volumes"][0]["persistentVolumeClaim"] == {"claimName": "m", "readOnly": True}
    assert "/models/a/b" in pod(dep)["containers"][0]["args"]

    host = parse_spec(body(model={"name": "x", "parameters": "7B", "source": {"hostPath": "/data/m.gguf"}}))
    dep = manifests.deployment(host, decision(), CONFIG)
    assert pod(dep)["volumes"][0]["hostPath"] == {"path": "/data/m.gguf"}
    assert "/models/m.gguf" in pod(dep)["containers"][0]["args"]

    source = {"uri": "hf://org/name@v1", "tokenSecret": {"name": "hf"}}
    mirror = [{"name": "HF_ENDPOINT", "value": "http://mirror"}]
    hf = parse_spec(body(model={"name": "x", "parameters": "7B", "source": source}, env=mirror))
    dep = manifests.deployment(hf, decision(), CONFIG)
    init = pod(dep)["initContainers"][0]
    # The server image's own downloader: no pip at start-up, a mirror and a token honoured.
    assert init["image"] == CONFIG.server_image
    assert init["command"] + init["args"] == [
        "pagoda", "download", "--repo", "org/name", "--revision", "v1", "--target", "/models/name"
    ]  # fmt: skip
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert env["HF_ENDPOINT"]["value"] == "http://mirror"
    model = next(v for v in pod(dep)["volumes"] if v["name"] == "model")
    assert model["emptyDir"] == {"sizeLimit": "15Gi"}  # 7B x 2 bytes + 10%, not unbounded
    assert "/models/name" in pod(dep)["containers"][0]["args"]
    assert "envFrom" not in init


@pytest.mark.parametrize(
    ("uri", "folder", "served"),
    [
        ("s3://bucket/team/llama-3.1-8b/", "/models/llama-3.1-8b", "/models/llama-3.1-8b"),
        ("gs://bucket/m/SmolLM2.Q4_1.gguf", "/models/SmolLM2.Q4_1", "/models/SmolLM2.Q4_1/SmolLM2.Q4_1.gguf"),
        ("https://mirror.local/ggufs/tiny.gguf", "/models/tiny", "/models/tiny/tiny.gguf"),
    ],
)
def test_an_object_store_source_is_fetched_by_uri_with_its_credentials(
    uri: str, folder: str, served: str
) -> None:
    source = {"uri": uri, "credentialsSecret": {"name": "store"}}
    spec = parse_spec(body(model={"name": "x", "parameters": "7B", "source": source}))
    dep = manifests.deployment(spec, decision(), CONFIG)
    init = pod(dep)["initContainers"][0]
    assert init["command"] + init["args"] == ["pagoda", "download", "--uri", uri, "--target", folder]
    assert init["envFrom"] == [{"secretRef": {"name": "store"}}]  # AWS_* / GOOGLE_* keys, never read here
    assert "HF_TOKEN" not in {e["name"] for e in init["env"]}
    args = pod(dep)["containers"][0]["args"]
    assert args[args.index("--model") + 1] == served


@pytest.mark.parametrize(
    "uri",
    ["s3://b", "s3:///path", "ftp://host/m.gguf", "https://host/folder/", "hf://justname", "s3://b/ path"],
)
def test_a_uri_of_no_known_form_is_refused(uri: str) -> None:
    with pytest.raises(ValueError, match="give hf://org/name"):
        parse_spec(body(model={"name": "x", "parameters": "7B", "source": {"uri": uri}}))


def test_pass_through_and_user_affinity_is_anded() -> None:
    user_term = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
    spec = parse_spec(
        body(
            nodeSelector={"pool": "gpu"},
            tolerations=[{"key": "dedicated", "operator": "Exists"}],
            affinity={
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [user_term]}
                }
            },
            runtimeClassName="nvidia",
            priorityClassName="high",
            image="my/image:1",
            resources={"limits": {"memory": "64Gi"}},
            engine={
                "maxModelLen": 8192,
                "maxNumSeqs": 64,
                "prefixCaching": False,
                "extraArgs": ["--seed", "1"],
            },
        )
    )
    dep = manifests.deployment(spec, decision(), CONFIG)
    p = pod(dep)
    terms = p["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert [e["key"] for e in terms[0]["matchExpressions"]] == ["zone", "nvidia.com/gpu.product"]
    assert spec.affinity == {
        "nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [user_term]}}
    }  # input untouched
    assert p["nodeSelector"] == {"pool": "gpu"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in p["tolerations"]
    assert (p["runtimeClassName"], p["priorityClassName"]) == ("nvidia", "high")
    container = p["containers"][0]
    assert container["image"] == "my/image:1"
    assert container["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": "1"}
    args = container["args"]
    assert args[args.index("--max-model-len") + 1] == "8192"
    assert "--no-enable-prefix-caching" in args
    assert args[-2:] == ["--seed", "1"]


def test_service_hpa_pdb() -> None:
    spec = parse_spec(body())
    svc = manifests.service(spec)
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {
        "http": 8000,
        "grpc": 8001,
        "metrics": 9090,
    }
    assert manifests.hpa(spec) is None
    assert manifests.pdb(spec)["spec"]["maxUnavailable"] == 1

    scaled = parse_spec(body(autoscaling={"minReplicas": 2, "maxReplicas": 5, "targetQueueDepth": 4}))
    hpa = manifests.hpa(scaled)
    assert hpa is not None
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm"}
    targets = {
        m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]
    }
    assert targets == {manifests.QUEUE_METRIC: "4", manifests.KV_CACHE_METRIC: "800m"}
    assert "replicas" not in manifests.deployment(scaled, decision(), CONFIG)["spec"]  # the HPA owns it

    dcgm = parse_spec(body(autoscaling={"maxReplicas": 3, "targetGpuActivity": 0.9, "behavior": {"x": 1}}))
    hpa = manifests.hpa(dcgm)
    assert hpa is not None
    assert "DCGM_FI_PROF_GR_ENGINE_ACTIVE" in [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert hpa["spec"]["behavior"] == {"x": 1}


def test_urls() -> None:
    assert manifests.urls(parse_spec(body()), CONFIG) == {
        "url": "http://llm.ns.svc.cluster.local:8000/v1",
        "grpcAddress": "llm.ns.svc.cluster.local:8001",
    }


def test_server_accepts_the_args() -> None:
    """The contract: every flag the operator passes is one `pagoda serve` knows."""
    from pagoda.service import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    engine = {"maxModelLen": 4096, "maxNumSeqs": 32, "kvCacheDtype": "fp8", "apiServerCount": 4}
    spec = parse_spec(body(engine=engine))
    args = manifests.server_args(spec, decision(1, "bf16"), CONFIG)
    parsed = parser.parse_args(args)
    assert (parsed.precision, parsed.tensor_parallel_size, parsed.port, parsed.grpc_port) == (
        "bf16",
        1,
        8000,
        8001,
    )
    assert parsed.enable_prefix_caching is True
    assert (parsed.max_num_seqs, parsed.kv_cache_dtype, parsed.api_server_count) == (32, "fp8", 4)
    for precision in ("fp16", "fp8"):
        assert precision in serve_cli.PRECISIONS
    assert "int8" not in serve_cli.PRECISIONS


def test_engine_flags_are_rendered_only_when_set() -> None:
    """engine.kvCacheDtype and engine.apiServerCount, as engine.maxNumSeqs: unset, the server default."""
    engine = {"kvCacheDtype": "fp8", "apiServerCount": 4, "extraArgs": ["--seed", "1"]}
    spec = parse_spec(body(engine=engine))
    args = manifests.server_args(spec, decision(), CONFIG)
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    assert args[args.index("--api-server-count") + 1] == "4"
    assert args[-2:] == ["--seed", "1"]  # the user's extraArgs still come last
    assert spec.profile_request().kv_cache_dtype == "fp8"  # the profile sizes and reports an fp8 cache
    auto = manifests.server_args(parse_spec(body(engine={"kvCacheDtype": "auto"})), decision(), CONFIG)
    assert auto[auto.index("--kv-cache-dtype") + 1] == "auto"
    plain_spec = parse_spec(body())
    plain = manifests.server_args(plain_spec, decision(), CONFIG)
    assert (
        "--kv-cache-dtype" not in plain
        and "--api-server-count" not in plain
        and "--max-num-seqs" not in plain
    )
    assert plain_spec.profile_request().kv_cache_dtype == "auto"


def test_hpa_metrics_are_what_the_server_exports() -> None:
    source = ROOT / "service" / "metrics.py"
    exported = set(re.findall(r'"(pagoda_[a-z_]+)"', source.read_text()))
    assert {manifests.QUEUE_METRIC, manifests.KV_CACHE_METRIC} <= exported


def test_operator_imports_no_torch_and_no_service() -> None:
    code = (
        "import sys, pagoda.cli, pagoda.operator.handlers, pagoda.operator.cmd_operator;"
        "import pagoda.operator.cmd_profile;"
        "pagoda.cli.build_parser;"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('pagoda.service')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True, cwd=ROOT)


def test_cpu_and_memory_requests_are_sized_from_the_model_and_overridable() -> None:
    dep = manifests.deployment(parse_spec(body()), decision(), CONFIG)
    resources = pod(dep)["containers"][0]["resources"]
    assert resources["requests"] == {"cpu": "1", "memory": "6Gi", "nvidia.com/gpu": "1"}  # 8B fp8, TP 1
    assert resources["limits"] == {"nvidia.com/gpu": "1"}  # Burstable: no CPU/memory limit to OOM-kill a load
    small = parse_spec(body(model={"name": "smollm2-135m", "source": {"imagePath": "/m"}}))
    requests = pod(manifests.deployment(small, decision(1, "bf16"), CONFIG))["containers"][0]["resources"][
        "requests"
    ]
    assert (requests["cpu"], requests["memory"]) == ("1", "3Gi")
    big = parse_spec(body(model={"name": "llama-3.1-70b", "source": {"imagePath": "/m"}}, precision="bf16"))
    requests = pod(manifests.deployment(big, decision(4, "bf16"), CONFIG))["containers"][0]["resources"][
        "requests"
    ]
    assert (requests["cpu"], requests["memory"]) == ("4", "74Gi")
    for count, cpu in ((1, "1"), (4, "5")):  # N API processes and the engine core, a core each
        multi = parse_spec(body(engine={"apiServerCount": count}))
        container = pod(manifests.deployment(multi, decision(), CONFIG))["containers"][0]
        assert container["resources"]["requests"]["cpu"] == cpu
    mine = body(resources={"requests": {"memory": "20Gi", "nvidia.com/gpu": "7"}, "limits": {"cpu": "16"}})
    resources = pod(manifests.deployment(parse_spec(mine), decision(), CONFIG))["containers"][0]["resources"]
    assert resources["requests"] == {"cpu": "1", "memory": "20Gi", "nvidia.com/gpu": "1"}
    assert resources["limits"] == {"cpu": "16", "nvidia.com/gpu": "1"}


def test_read_only_root_with_writable_tmp_and_caches() -> None:
    hf = body(model={"name": "llama-3.1-8b", "source": {"uri": "hf://org/m"}})
    spec = pod(manifests.deployment(parse_spec(hf), decision(), CONFIG))
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["tmp"]["emptyDir"]["sizeLimit"] and volumes["cache"]["emptyDir"]["sizeLimit"]
    for container in spec["containers"] + spec["initContainers"]:
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False and security["capabilities"] == {"drop": ["ALL"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/tmp"] == "tmp"
    server = spec["containers"][0]
    mounts = {m["mountPath"]: m["name"] for m in server["volumeMounts"]}
    assert mounts[manifests.HOME_CACHE_DIR] == "cache"
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert (
        env["HF_HOME"].startswith(manifests.HOME_CACHE_DIR)
        and env["XDG_CACHE_HOME"] == manifests.HOME_CACHE_DIR
    )
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_the_api_key_comes_from_its_secret_as_env_never_as_an_arg() -> None:
    spec = parse_spec(body(apiKeySecret={"name": "llm-keys"}))
    container = pod(manifests.deployment(spec, decision(), CONFIG))["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["PAGODA_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "llm-keys", "key": "api-key"}}
    assert not any("api-key" in arg for arg in container["args"])
    without = pod(manifests.deployment(parse_spec(body()), decision(), CONFIG))["containers"][0]
    assert "PAGODA_API_KEY" not in {e["name"] for e in without["env"]}
    # "--api" and longer prefixes are the key's (argparse would take them for it); "--ap" is also a prefix
    # of --api-server-count, which it would override: refused as such.
    for extra in (["--api-key", "k"], ["--api-k=k"], ["--api=k"], ["--api-", "k"]):
        with pytest.raises(ValueError, match="apiKeySecret"):
            parse_spec(body(engine={"extraArgs": extra}))
    with pytest.raises(ValueError, match="'--ap' would override --api-server-count"):
        parse_spec(body(engine={"extraArgs": ["--ap", "2"]}))


def test_pod_labels_and_annotations_and_the_service_from_the_spec() -> None:
    import pytest

    from pagoda.operator.reserved import OPERATOR_POD_ANNOTATIONS, OPERATOR_POD_LABELS

    plain = manifests.deployment(parse_spec(body()), decision(), CONFIG)["spec"]["template"]["metadata"]
    assert tuple(plain["labels"]) == OPERATOR_POD_LABELS  # the reserved lists are what is rendered
    assert tuple(plain["annotations"]) == OPERATOR_POD_ANNOTATIONS
    spec = parse_spec(
        body(
            podLabels={"team": "search", "sidecar.istio.io/inject": "true"},
            podAnnotations={"cost-centre": "42"},
            service={"type": "LoadBalancer", "annotations": {"lb.example/internal": "true"}},
        )
    )
    template = manifests.deployment(spec, decision(), CONFIG)["spec"]["template"]["metadata"]
    assert template["labels"] == {"team": "search", "sidecar.istio.io/inject": "true"} | plain["labels"]
    assert template["annotations"] == {"cost-centre": "42"} | plain["annotations"]
    svc = manifests.service(spec)
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["metadata"]["annotations"] == {"lb.example/internal": "true"}
    assert svc["spec"]["selector"] == manifests.selector_labels(spec)  # never the added labels
    assert manifests.service(parse_spec(body()))["spec"]["type"] == "ClusterIP"
    assert "annotations" not in manifests.service(parse_spec(body()))["metadata"]
    for field, value, message in [
        (
            "podLabels",
            {"app.kubernetes.io/instance": "other"},
            "podLabels: app.kubernetes.io/instance is set",
        ),
        ("podAnnotations", {"prometheus.io/port": "1"}, "podAnnotations: prometheus.io/port is set"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_spec(body(**{field: value}))


def test_extra_volumes_and_mounts_from_the_spec() -> None:
    import pytest

    templates = {"name": "templates", "configMap": {"name": "chat-templates"}}
    mount = {"name": "templates", "mountPath": "/etc/templates", "readOnly": True}
    spec = parse_spec(body(volumes=[templates], volumeMounts=[mount]))
    pod_spec = manifests.deployment(spec, decision(), CONFIG)["spec"]["template"]["spec"]
    assert pod_spec["volumes"][-1] == templates and pod_spec["containers"][0]["volumeMounts"][-1] == mount
    plain = manifests.deployment(parse_spec(body()), decision(), CONFIG)["spec"]["template"]["spec"]
    assert pod_spec["volumes"][:-1] == plain["volumes"]  # the operator's own are all still there
    for volumes, mounts, message in [
        ([{"name": "tmp", "emptyDir": {}}], [], "volumes: tmp is a volume of the operator's"),
        ([templates], [{"name": "templates", "mountPath": "/models/extra"}], "/models/extra overlaps"),
        ([templates], [{"name": "templates", "mountPath": "/var/cache"}], "/var/cache overlaps"),
        ([templates], [{"name": "templates", "mountPath": "/"}], "/ overlaps"),
        ([templates], [{"name": "templates", "mountPath": "/tmp/"}], "/tmp overlaps"),  # the very path
        ([], [{"name": "nowhere", "mountPath": "/etc/x"}], "'nowhere' names no volume"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_spec(body(volumes=volumes, volumeMounts=mounts))
    ok = parse_spec(body(volumes=[templates], volumeMounts=[{"name": "templates", "mountPath": "/models2"}]))
    assert ok.volume_mounts[0]["mountPath"] == "/models2"  # a neighbour of /models, not inside it


def test_an_http_route_when_the_spec_asks_for_one() -> None:
    assert manifests.http_route(parse_spec(body())) is None
    gateway = {"name": "public", "namespace": "gateways", "sectionName": "https"}
    spec = parse_spec(
        body(httpRoute={"parentRefs": [gateway], "hostnames": ["llm.example.com"], "annotations": {"a": "b"}})
    )
    route = manifests.http_route(spec)
    assert route is not None
    assert (route["apiVersion"], route["kind"]) == ("gateway.networking.k8s.io/v1", "HTTPRoute")
    assert route["metadata"]["name"] == "llm" and route["metadata"]["annotations"] == {"a": "b"}
    assert route["metadata"]["labels"] == manifests.labels(spec)
    assert route["spec"] == {
        "parentRefs": [gateway],
        "hostnames": ["llm.example.com"],
        "rules": [
            {
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"name": "llm", "port": 8000}],  # the Service: the router, where one is
            }
        ],
    }
    bare = manifests.http_route(parse_spec(body(httpRoute={"parentRefs": [{"name": "g"}], "path": "/llm"})))
    assert bare is not None and "hostnames" not in bare["spec"] and "annotations" not in bare["metadata"]
    assert bare["spec"]["rules"][0]["matches"][0]["path"]["value"] == "/llm"
    assert manifests.children(spec, decision(), CONFIG)[-1]["kind"] == "HTTPRoute"
    for refs in ([], [{"namespace": "x"}], None):
        with pytest.raises(
            ValueError, match=r"httpRoute\.parentRefs: at least one Gateway, each with a name"
        ):
            parse_spec(body(httpRoute={"parentRefs": refs}))


def test_an_ingress_when_the_spec_asks_for_one() -> None:
    assert manifests.ingress(parse_spec(body())) is None
    assert [o["kind"] for o in manifests.children(parse_spec(body()), decision(), CONFIG)] == [
        "Service",
        "PodDisruptionBudget",
        "Deployment",
    ]
    spec = parse_spec(
        body(
            ingress={
                "host": "llm.example.com",
                "className": "nginx",
                "annotations": {"a": "b"},
                "tlsSecretName": "cert",
            }
        )
    )
    ing = manifests.ingress(spec)
    assert (
        ing is not None and ing["metadata"]["name"] == "llm" and ing["metadata"]["annotations"] == {"a": "b"}
    )
    assert ing["spec"] == {
        "rules": [
            {
                "host": "llm.example.com",
                "http": {
                    "paths": [
                        {
                            "path": "/",
                            "pathType": "Prefix",
                            "backend": {"service": {"name": "llm", "port": {"name": "http"}}},
                        }
                    ]
                },
            }
        ],
        "ingressClassName": "nginx",
        "tls": [{"hosts": ["llm.example.com"], "secretName": "cert"}],
    }
    bare = manifests.ingress(parse_spec(body(ingress={"path": "/llm"})))
    assert bare is not None and "host" not in bare["spec"]["rules"][0] and "tls" not in bare["spec"]
    assert bare["spec"]["rules"][0]["http"]["paths"][0]["path"] == "/llm"
    assert manifests.children(spec, decision(), CONFIG)[-1]["kind"] == "Ingress"


def test_speculation_is_off_unless_the_spec_asks() -> None:
    """Off by default (docs/operator.md: no gain without repeated text, a loss at batch 64 before the
    adaptive rule); asked for, every field is written out in vLLM's keys."""
    plain = manifests.server_args(parse_spec(body()), decision(), CONFIG)
    assert not any(a.startswith("--speculative") for a in plain)
    args = manifests.server_args(parse_spec(body(speculative={"method": "ngram"})), decision(), CONFIG)
    assert args[args.index("--speculative-config") + 1] == (
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2, '
        '"max_batch_tokens": 128, "adaptive": true}'
    )
    draft = {"method": "draftModel", "draftModel": "/drafts/llama-3.2-1b", "adaptive": False}
    args = manifests.server_args(parse_spec(body(speculative=draft)), decision(), CONFIG)
    assert args[args.index("--speculative-config") + 1] == (
        '{"method": "draft_model", "model": "/drafts/llama-3.2-1b", "num_speculative_tokens": 3, '
        '"max_batch_tokens": 128, "adaptive": false}'
    )


def _adapter_pod(model: dict, adapters: list[dict], **spec: object) -> dict:
    parsed = parse_spec(body(model=model, adapters=adapters, **spec))
    return pod(manifests.deployment(parsed, decision(), CONFIG))


def _lora_modules(pod_spec: dict) -> dict[str, str]:
    args = pod_spec["containers"][0]["args"]
    start = args.index("--lora-modules") + 1
    modules = args[start : args.index("--max-loras")]
    return dict(m.split("=", 1) for m in modules)


def test_adapters_are_mounted_read_only_as_the_model_is() -> None:
    model = {"name": "llama-3.1-8b", "source": {"pvc": {"claimName": "weights", "path": "llama"}}}
    # The other claim sorts after the model's ("zoo" > "weights"): only the same name is the model's.
    adapters = [
        {"name": "in-model-claim", "source": {"pvc": {"claimName": "weights", "path": "loras/a"}}},
        {"name": "b", "source": {"pvc": {"claimName": "zoo", "path": "b"}}},
        {"name": "c", "source": {"pvc": {"claimName": "zoo", "path": "c"}}},
        {"name": "tarot", "source": {"hostPath": "/mnt/loras/tarot"}},
        {"name": "baked", "source": {"imagePath": "/opt/loras/baked"}},
    ]
    pod_spec = _adapter_pod(model, adapters)
    assert _lora_modules(pod_spec) == {
        "in-model-claim": "/models/loras/a",  # the model's claim, mounted once at /models
        "b": "/adapters/pvc/zoo/b",
        "c": "/adapters/pvc/zoo/c",
        "tarot": "/adapters/host/tarot",
        "baked": "/opt/loras/baked",
    }
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    mounts = {m["mountPath"]: m for m in pod_spec["containers"][0]["volumeMounts"]}
    # One volume per claim, however many adapters it holds (and none for the model's own).
    claims = [v["persistentVolumeClaim"] for v in volumes.values() if "persistentVolumeClaim" in v]
    assert claims == [{"claimName": "weights", "readOnly": True}, {"claimName": "zoo", "readOnly": True}]
    assert mounts["/adapters/pvc/zoo"]["name"] == "adapter-1"
    assert volumes["adapter-3"]["hostPath"] == {"path": "/mnt/loras/tarot"}
    assert mounts["/adapters/host/tarot"]["name"] == "adapter-3"
    adapter_mounts = [m for path, m in mounts.items() if path.startswith("/adapters")]
    assert len(adapter_mounts) == 2 and all(m["readOnly"] is True for m in adapter_mounts)
    assert "initContainers" not in pod_spec  # nothing to fetch
    args = pod_spec["containers"][0]["args"]
    assert args[args.index("--enable-lora") :][-4:] == ["--max-loras", "5", "--max-lora-rank", "16"]


def test_uri_adapters_are_fetched_at_start_without_a_cache_each_with_its_own_credentials() -> None:
    model = {"name": "llama-3.1-8b", "source": {"imagePath": "/models/llama"}}
    adapters = [
        {"name": "sql", "source": {"uri": "hf://org/sql-lora@v2", "tokenSecret": {"name": "hf", "key": "t"}}},
        {"name": "chat", "source": {"uri": "s3://loras/chat/", "credentialsSecret": {"name": "s3"}}},
    ]
    mirror = [{"name": "HF_ENDPOINT", "value": "http://mirror"}]
    pod_spec = _adapter_pod(model, adapters, env=mirror, engine={"maxLoraRank": 64})
    assert _lora_modules(pod_spec) == {"sql": "/adapters/uri/sql", "chat": "/adapters/uri/chat"}
    sql, chat = pod_spec["initContainers"]
    assert (sql["name"], chat["name"]) == ("fetch-adapter-0", "fetch-adapter-1")
    assert sql["command"] + sql["args"] == [
        "pagoda", "download", "--repo", "org/sql-lora", "--revision", "v2", "--target", "/adapters/uri/sql"
    ]  # fmt: skip
    assert chat["command"] + chat["args"] == [
        "pagoda", "download", "--uri", "s3://loras/chat/", "--target", "/adapters/uri/chat"
    ]  # fmt: skip
    sql_env = {e["name"]: e for e in sql["env"]}
    assert sql_env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "t"}
    assert sql_env["HF_ENDPOINT"]["value"] == "http://mirror"
    assert "envFrom" not in sql and "HF_TOKEN" not in {e["name"] for e in chat["env"]}
    assert chat["envFrom"] == [{"secretRef": {"name": "s3"}}]  # each its own secrets, no other's
    assert {"name": "adapters", "mountPath": "/adapters/uri"} in chat["volumeMounts"]
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    # Room for A and B of rank 64 in fp32 (640 MiB for an 8B) + 10%, in whole GiB: 1 GiB each.
    assert volumes["adapters"]["emptyDir"] == {"sizeLimit": "2Gi"}
    # A 70B at rank 256: 12.3 GiB each, 13.6 with the 10%, rounded up: 14 GiB each.
    big = _adapter_pod(model | {"name": "llama-3.1-70b"}, adapters, engine={"maxLoraRank": 256})
    assert {v["name"]: v for v in big["volumes"]}["adapters"]["emptyDir"] == {"sizeLimit": "28Gi"}
    server_mounts = pod_spec["containers"][0]["volumeMounts"]
    assert {"name": "adapters", "mountPath": "/adapters/uri", "readOnly": True} in server_mounts


def test_uri_adapters_of_a_cached_model_are_read_from_its_claim() -> None:
    model = {"name": "llama-3.1-8b", "source": {"uri": "hf://org/llama"}, "cache": {"size": "40Gi"}}
    adapters = [{"name": "sql", "source": {"uri": "hf://org/sql-lora"}}]
    pod_spec = _adapter_pod(model, adapters)
    assert _lora_modules(pod_spec) == {"sql": "/models/adapters/sql"}  # the cache Job fetched it there
    assert "initContainers" not in pod_spec
    assert [v["name"] for v in pod_spec["volumes"] if v["name"].startswith("adapter")] == []


def group_decision(tp: int = 8, pp: int = 2, precision: str = "bf16") -> Decision:
    return Decision(
        True,
        "fits",
        gpu=H100,
        precision=precision,
        tensor_parallel_size=tp,
        kv_cache_dtype=precision,
        pipeline_parallel_size=pp,
    )


def test_a_model_over_several_pods_is_a_leader_worker_set() -> None:
    """Each replica a group of PP pods (one pipeline stage of TP GPUs each): started together, recreated
    together, the leader rank 0 behind the Service, the workers headless with a /health probe."""
    spec = parse_spec(body(model={"name": "llama-3.1-405b", "source": {"imagePath": "/m"}}, replicas=2))
    objs = manifests.children(spec, group_decision(), CONFIG)
    assert [o["kind"] for o in objs] == [
        "Service", "PodDisruptionBudget", "LeaderWorkerSet",
        "Service", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget", "Deployment",
    ]  # two replicas: a router in front  # fmt: skip
    lws = next(o for o in objs if o["kind"] == "LeaderWorkerSet")
    assert (lws["apiVersion"], lws["metadata"]["name"]) == ("leaderworkerset.x-k8s.io/v1", "llm-group")
    assert lws["metadata"]["annotations"] == {
        "serving.pagoda.dev/profile": "NVIDIA-H100-80GB-HBM3/bf16/tp8/pp2"
    }
    assert lws["spec"]["replicas"] == 2
    assert (
        lws["spec"]["startupPolicy"] == "LeaderCreated"
    )  # LeaderReady would wait forever: see the docstring
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxSurge": 0,
        "maxUnavailable": 1,
    }
    template = lws["spec"]["leaderWorkerTemplate"]
    assert (template["size"], template["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    leader = template["leaderTemplate"]["spec"]["containers"][0]
    worker = template["workerTemplate"]["spec"]["containers"][0]
    group = ["--tensor-parallel-size", "8", "--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank"]
    at = leader["args"].index("--tensor-parallel-size")
    assert leader["args"][at : at + 12] == [*group, "0", "--master-addr", "$(LWS_LEADER_ADDRESS)",
                                            "--master-port", "29500"]  # fmt: skip
    assert worker["args"][at : at + 12] == [*group, "$(LWS_WORKER_INDEX)", "--master-addr",
                                            "$(LWS_LEADER_ADDRESS)", "--master-port", "29500"]  # fmt: skip
    assert "--headless" not in leader["args"] and worker["args"][-1] == "--headless"
    others = [a for a in leader["args"] if a not in ("0", "$(LWS_WORKER_INDEX)")]
    assert others == [a for a in worker["args"] if a not in ("0", "$(LWS_WORKER_INDEX)", "--headless")]
    for container in (leader, worker):  # every pod holds a stage: the node's GPUs
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert container["resources"]["requests"]["nvidia.com/gpu"] == "8"
    assert leader["readinessProbe"]["httpGet"] == {"path": "/v1/health/ready", "port": "http"}
    assert [p["name"] for p in leader["ports"]] == ["http", "grpc"]
    # A worker serves only /health on the same port, named so that no PodMonitor (port http) scrapes it.
    assert worker["ports"] == [{"name": "health", "containerPort": 8000, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/health", "port": "health"}
    assert "lifecycle" not in worker  # behind no Service: nothing to leave before SIGTERM
    leader_meta, worker_meta = template["leaderTemplate"]["metadata"], template["workerTemplate"]["metadata"]
    assert leader_meta["annotations"]["prometheus.io/scrape"] == "true"
    assert "prometheus.io/scrape" not in worker_meta["annotations"]
    assert leader_meta["labels"] == worker_meta["labels"] == manifests.labels(spec)


def test_only_the_leaders_serve_and_the_hpa_scales_whole_groups() -> None:
    spec = parse_spec(body(model={"name": "llama-3.1-405b", "source": {"imagePath": "/m"}},
                           autoscaling={"maxReplicas": 3}, router={"enabled": False}))  # fmt: skip
    objs = {o["kind"] + o["metadata"]["name"]: o for o in manifests.children(spec, group_decision(), CONFIG)}
    leaders = manifests.selector_labels(spec) | {"leaderworkerset.sigs.k8s.io/worker-index": "0"}
    assert objs["Servicellm"]["spec"]["selector"] == leaders
    assert objs["HorizontalPodAutoscalerllm"]["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "llm-group",
    }
    assert "replicas" not in objs["LeaderWorkerSetllm-group"]["spec"]  # the HPA owns the groups
    # The budget covers every pod of every group: one pod evicted takes its group down, and no other pod
    # goes until that group is whole and ready again.
    assert objs["PodDisruptionBudgetllm"]["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": manifests.selector_labels(spec)},
    }
    routed = parse_spec(body(model={"name": "llama-3.1-405b", "source": {"imagePath": "/m"}}, replicas=2))
    router_dep = next(
        o for o in manifests.children(routed, group_decision(), CONFIG) if o["kind"] == "Deployment"
    )
    args = " ".join(router_dep["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "leaderworkerset.sigs.k8s.io/worker-index=0" in args  # the router finds the leaders only
    servers = manifests.servers_service(routed, is_group=True)
    assert servers["spec"]["selector"] == leaders


def test_a_pod_of_a_group_reserves_memory_for_its_stage() -> None:
    spec = parse_spec(body(model={"name": "llama-3.1-405b", "source": {"imagePath": "/m"}}))
    one_stage = manifests.default_requests(spec, group_decision(8, 2))
    whole = manifests.default_requests(spec, group_decision(8, 1))
    # 2 GiB a GPU + half the weights a pod reads: 811.8 GB of bf16 over two stages, 405.9 GB each.
    assert one_stage == {"cpu": "8", "memory": f"{16 + 190}Gi"} and whole["memory"] == f"{16 + 379}Gi"


def test_status_names_each_adapter_source_in_one_line() -> None:
    """status.adapters' `source`: a claim with its path inside (or none), a URI as given, a node or image
    path with its kind."""
    from pagoda.operator.model_mounts import describe_source
    from pagoda.operator.spec import ModelSource

    assert describe_source(ModelSource("pvc", "loras", "sql/v2")) == "pvc:loras/sql/v2"
    assert describe_source(ModelSource("pvc", "loras")) == "pvc:loras"
    assert describe_source(ModelSource("uri", "s3://loras/chat/")) == "s3://loras/chat/"
    assert describe_source(ModelSource("hostPath", "/mnt/loras/tarot")) == "hostPath:/mnt/loras/tarot"
    assert describe_source(ModelSource("imagePath", "/opt/loras/baked")) == "imagePath:/opt/loras/baked"
