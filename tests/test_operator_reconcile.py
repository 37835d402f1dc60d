"""reconcile() against an in-memory API: children, ownership, idempotence, status and events."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from fake_kube import FakeKube

from pagoda.operator import status as status_mod
from pagoda.operator.kube import KubeError
from pagoda.operator.reconcile import reconcile
from pagoda.operator.spec import OperatorConfig

CONFIG = OperatorConfig()
ROOT = Path(__file__).resolve().parents[1]


def gpu_node(name: str, product: str, cc: str, memory: int, count: int) -> dict:
    major, minor = cc.split(".")
    labels = {
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.compute.major": major,
        "nvidia.com/gpu.compute.minor": minor,
        "nvidia.com/gpu.memory": str(memory),
        "nvidia.com/gpu.count": str(count),
    }
    return {
        "metadata": {"name": name, "labels": labels},
        "status": {"allocatable": {"nvidia.com/gpu": str(count)}},
    }


H100 = gpu_node("h100", "NVIDIA-H100-80GB-HBM3", "9.0", 81559, 8)
T4 = gpu_node("t4", "Tesla-T4", "7.5", 15360, 1)


def inference_service(**spec: Any) -> dict:
    base = {"model": {"name": "llama-3.1-8b", "source": {"imagePath": "/models/llama"}}}
    return {
        "apiVersion": "serving.pagoda.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {
            "name": "llm",
            "namespace": "ns",
            "uid": "uid-1",
            "generation": 1,
            "labels": {"team": "a"},
        },
        "spec": base | spec,
    }


def run(kube: FakeKube, body: dict, now: str = "2026-01-01T00:00:00Z"):
    result = reconcile(body, kube, CONFIG, now)  # type: ignore[arg-type]
    body["status"] = result.status
    return result


def conditions(result) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in result.status["conditions"]}


def test_creates_owned_children_and_reports() -> None:
    kube, body = FakeKube([H100, T4]), inference_service()
    result = run(kube, body)
    assert sorted(kind for kind, _, _ in kube.objects) == ["Deployment", "PodDisruptionBudget", "Service"]
    for obj in kube.objects.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("InferenceService", "uid-1", True)
        assert obj["metadata"]["labels"]["team"] == "a"  # kopf.adopt copies the owner's labels
    profile = result.status["profile"]
    assert (profile["gpu"]["product"], profile["precision"], profile["tensorParallelSize"]) == (
        "NVIDIA-H100-80GB-HBM3",
        "fp8",
        1,
    )
    assert conditions(result)[status_mod.PROFILE_SELECTED] == ("True", "Selected")
    assert conditions(result)[status_mod.READY][0] == "False"
    assert result.status["selector"] == "app.kubernetes.io/name=pagoda-server,app.kubernetes.io/instance=llm"
    assert result.status["url"] == "http://llm.ns.svc.cluster.local:8000/v1"
    reasons = [e.reason for e in result.events]
    assert reasons.count("Created") == 3 and "ProfileSelected" in reasons


def test_second_pass_changes_nothing_and_ready_follows_the_deployment() -> None:
    kube, body = FakeKube([H100]), inference_service()
    run(kube, body)
    kube.writes.clear()
    dep = kube.objects[("Deployment", "ns", "llm")]
    dep["status"] = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}
    dep["status"]["availableReplicas"] = 1
    result = run(kube, body, now="2026-01-01T00:05:00Z")
    assert kube.writes == []
    assert result.events == ()
    assert conditions(result)[status_mod.READY] == ("True", "ReplicasReady")
    assert conditions(result)[status_mod.PROGRESSING] == ("False", "RolloutComplete")
    times = {c["type"]: c["lastTransitionTime"] for c in result.status["conditions"]}
    assert times[status_mod.PROFILE_SELECTED] == "2026-01-01T00:00:00Z"  # unchanged status keeps its time
    assert times[status_mod.READY] == "2026-01-01T00:05:00Z"


def test_spec_change_rolls_the_deployment() -> None:
    kube, body = FakeKube([H100]), inference_service()
    run(kube, body)
    body["spec"]["precision"] = "bf16"
    body["metadata"]["generation"] = 2
    result = run(kube, body)
    args = kube.objects[("Deployment", "ns", "llm")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--precision") + 1] == "bf16"
    assert "RollingOut" in [e.reason for e in result.events]
    assert result.status["observedGeneration"] == 2


def test_refuses_objects_it_does_not_own() -> None:
    kube, body = FakeKube([H100]), inference_service()
    kube.objects[("Service", "ns", "llm")] = {
        "kind": "Service",
        "metadata": {"name": "llm", "namespace": "ns"},
    }
    result = run(kube, body)
    assert kube.writes == []
    assert conditions(result)[status_mod.DEGRADED] == ("True", "Conflict")
    assert any(e.reason == "Conflict" and "Service llm" in e.message for e in result.events)


def test_no_fitting_gpu_creates_nothing() -> None:
    kube, body = FakeKube([T4]), inference_service()
    result = run(kube, body)
    assert kube.objects == {}
    assert conditions(result)[status_mod.PROFILE_SELECTED] == ("False", "NoFittingGpu")
    assert result.status["profile"]["reason"].startswith("8B fp16 needs 2 x 15 GiB")
    assert [e.reason for e in result.events] == ["NoFittingGpu"]
    assert run(kube, body).events == ()  # the same warning is not repeated


def test_autoscaling_replaces_replicas_and_hpa_goes_when_turned_off() -> None:
    kube, body = FakeKube([H100]), inference_service(autoscaling={"maxReplicas": 3})
    run(kube, body)
    assert ("HorizontalPodAutoscaler", "ns", "llm") in kube.objects
    assert "replicas" not in kube.objects[("Deployment", "ns", "llm")]["spec"]
    del body["spec"]["autoscaling"]
    body["spec"]["replicas"] = 2
    body["metadata"]["generation"] = 2
    run(kube, body)
    assert ("HorizontalPodAutoscaler", "ns", "llm") not in kube.objects
    assert kube.objects[("Deployment", "ns", "llm")]["spec"]["replicas"] == 2


def _ready(kube: FakeKube) -> None:
    dep = kube.objects[("Deployment", "ns", "llm")]
    generation = dep["metadata"]["generation"]
    dep["status"] = {
        "observedGeneration": generation,
        "replicas": 1,
        "updatedReplicas": 1,
        "readyReplicas": 1,
    }
    dep["status"]["availableReplicas"] = 1


def test_a_better_gpu_does_not_move_a_running_workload_but_a_spec_change_does() -> None:
    kube, body = (
        FakeKube([T4]),
        inference_service(model={"name": "llama-3.2-3b", "source": {"imagePath": "/m"}}),
    )
    run(kube, body)
    _ready(kube)
    assert run(kube, body).status["profile"]["gpu"]["product"] == "Tesla-T4"
    kube.nodes = [T4, H100]  # a better GPU arrives: each move reloads the weights, so stay
    kube.writes.clear()
    result = run(kube, body)
    assert result.status["profile"]["gpu"]["product"] == "Tesla-T4"
    assert "kept: the current profile still fits" in result.status["profile"]["reason"]
    assert kube.writes == [] and result.events == ()
    body["spec"]["engine"] = {"maxNumSeqs": 64}  # a spec change chooses afresh
    body["metadata"]["generation"] = 2
    result = run(kube, body)
    assert result.status["profile"]["gpu"]["product"] == "NVIDIA-H100-80GB-HBM3"
    assert "ProfileSelected" in [e.reason for e in result.events]
    _ready(kube)
    kube.nodes = []  # every GPU node gone, spec unchanged: keep what runs, say so
    result = run(kube, body)
    assert ("Deployment", "ns", "llm") in kube.objects
    assert conditions(result)[status_mod.DEGRADED] == ("True", "NoFittingGpu")
    assert result.status["profile"]["selected"] is False
    assert result.status["profile"]["gpu"]["product"] == "NVIDIA-H100-80GB-HBM3"  # what still runs


def test_a_cordoned_node_keeps_its_running_workload() -> None:
    h200 = gpu_node("h200", "NVIDIA-H200", "9.0", 143771, 8)
    kube, body = FakeKube([h200, H100]), inference_service()
    assert run(kube, body).status["profile"]["gpu"]["product"] == "NVIDIA-H200"
    _ready(kube)
    h200["spec"] = {"unschedulable": True}
    kube.writes.clear()
    result = run(kube, body)
    assert kube.writes == []
    assert result.status["profile"]["gpu"]["product"] == "NVIDIA-H200"
    cond = {c["type"]: c for c in result.status["conditions"]}
    assert (cond["ProfileSelected"]["status"], cond["ProfileSelected"]["reason"]) == ("True", "KeptRunning")
    assert (cond["Degraded"]["status"], cond["Ready"]["status"]) == ("False", "True")
    assert "NVIDIA-H100-80GB-HBM3" in cond["ProfileSelected"]["message"]  # where a new selection would go


def test_capacity_held_by_other_pods_steers_the_choice() -> None:
    h200 = gpu_node("h200", "NVIDIA-H200", "9.0", 143771, 8)
    kube = FakeKube([h200, H100])
    kube.pods = [
        {"metadata": {"name": "other", "namespace": "x", "labels": {}}, "spec": {"nodeName": "h200",
         "containers": [{"resources": {"limits": {"nvidia.com/gpu": "8"}}}]}, "status": {"phase": "Running"}},
    ]  # fmt: skip
    result = run(kube, inference_service())
    assert result.status["profile"]["gpu"]["product"] == "NVIDIA-H100-80GB-HBM3"
    (rejected,) = [r for r in result.status["profile"]["rejected"] if "H200" in r["candidate"]]
    assert rejected["reason"] == "8B fp8 TP 1 needs 1 free GPUs on one node; 0 of 8 free on the freest node"


def test_invalid_spec_is_a_status_not_a_crash() -> None:
    kube = FakeKube([H100])
    body = inference_service(model={"name": "mystery-model", "source": {"imagePath": "/m"}})
    result = run(kube, body)
    assert kube.objects == {}
    assert conditions(result)[status_mod.PROFILE_SELECTED][0] == "False"
    assert "not in the built-in catalogue" in result.status["profile"]["reason"]


def _schema_keys(schema: dict, prefix: str = "") -> set[str]:
    keys = set()
    for name, sub in (schema.get("properties") or {}).items():
        keys.add(prefix + name)
        keys |= _schema_keys(sub.get("items", sub), f"{prefix}{name}.")
    return keys


def _value_keys(value: Any, prefix: str = "") -> set[str]:
    keys = set()
    if isinstance(value, list):
        for item in value:
            keys |= _value_keys(item, prefix)
    elif isinstance(value, dict):
        for name, sub in value.items():
            keys.add(prefix + name)
            keys |= _value_keys(sub, f"{prefix}{name}.")
    return keys


def test_status_fits_the_crd_schema() -> None:
    """The API server prunes unknown status fields silently: every key written must be in the schema."""
    crd = yaml.safe_load((ROOT / "crds" / "serving.pagoda.dev_inferenceservices.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    allowed = _schema_keys(schema)
    kube = FakeKube([H100])
    for body in (inference_service(), inference_service(gpuPreferences=[{"product": "T4"}])):
        status = run(kube, body).status
        assert _value_keys(status) <= allowed


def _invalid(message: str) -> KubeError:
    return KubeError(
        422, "PATCH", "/apis/apps/v1/.../deployments/llm", {"message": message, "reason": "Invalid"}
    )


def test_a_child_the_api_server_refuses_leaves_nothing_half_applied() -> None:
    kube, body = FakeKube([H100]), inference_service()
    message = 'Deployment.apps "llm" is invalid: spec.template.spec.containers[0].env[1].name: Invalid value'
    kube.refuse[("Deployment", True)] = _invalid(message)
    result = run(kube, body)
    assert kube.objects == {}  # not the Service, not the PDB: the dry run of every child came first
    cond = {c["type"]: c for c in result.status["conditions"]}
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("False", "InvalidSpec")
    assert message in cond["Ready"]["message"] and cond["Degraded"]["status"] == "True"
    assert [(e.type, e.reason) for e in result.events if e.type == "Warning"] == [("Warning", "InvalidSpec")]
    assert message in result.events[-1].message
    assert result.retry_seconds is None  # only a spec change can help; the update handler will come
    assert result.status["url"] is None  # no Service, no URL
    assert not [e for e in run(kube, body).events if e.type == "Warning"]  # said once, not every resync
    del kube.refuse[("Deployment", True)]
    body["metadata"]["generation"] = 2
    result = run(kube, body)
    assert sorted(k for k, _, _ in kube.objects) == ["Deployment", "PodDisruptionBudget", "Service"]
    assert result.status["url"] == "http://llm.ns.svc.cluster.local:8000/v1"


def test_an_apply_that_fails_for_another_reason_is_retried_later() -> None:
    kube, body = FakeKube([H100]), inference_service()
    kube.refuse[("PodDisruptionBudget", False)] = KubeError(500, "PATCH", "/x", {"message": "etcd timeout"})
    result = run(kube, body)
    assert conditions(result)[status_mod.READY] == ("False", "ApplyFailed")
    assert "etcd timeout" in result.status["conditions"][1]["message"]
    assert result.retry_seconds is not None and result.retry_seconds >= 10


def test_a_missing_pvc_or_secret_is_named_in_the_status() -> None:
    source = {"pvc": {"claimName": "models", "path": "llama"}}
    kube, body = FakeKube([H100]), inference_service(model={"name": "llama-3.1-8b", "source": source})
    result = run(kube, body)
    assert ("Deployment", "ns", "llm") in kube.objects  # created: the pods start once the claim exists
    cond = {c["type"]: c for c in result.status["conditions"]}
    assert (cond["Degraded"]["status"], cond["Degraded"]["reason"]) == (
        "True",
        "PersistentVolumeClaimNotFound",
    )
    assert (
        'PersistentVolumeClaim "models" (model.source.pvc) not found in namespace ns'
        in cond["Ready"]["message"]
    )
    assert [e.reason for e in result.events if e.type == "Warning"] == ["PersistentVolumeClaimNotFound"]
    assert not [e for e in run(kube, body).events if e.type == "Warning"]
    kube.present.add(("PersistentVolumeClaim", "models"))
    pulling = {"name": "server", "ready": False, "state": {"waiting": {"reason": "ImagePullBackOff"}}}
    kube.pods = [{"metadata": {"name": "llm-x"}, "status": {"containerStatuses": [pulling]}}]
    assert conditions(run(kube, body))[status_mod.DEGRADED] == ("True", "ImagePullFailed")
    kube.pods = []
    assert conditions(run(kube, body))[status_mod.DEGRADED] == ("False", "AsExpected")

    # A missing Secret is never looked up (no access): the kubelet's words in the pod's status say it.
    hf = {"uri": "hf://org/model", "tokenSecret": {"name": "hf-token"}}
    body = inference_service(model={"name": "llama-3.1-8b", "source": hf})
    no_secret = {"reason": "CreateContainerConfigError", "message": 'secret "hf-token" not found'}
    fetch = {"name": "fetch-model", "ready": False, "state": {"waiting": no_secret}}
    kube.pods = [{"metadata": {"name": "llm-y"}, "status": {"initContainerStatuses": [fetch]}}]
    kube.fail["exists"] = AssertionError("a Secret was looked up")
    result = run(kube, body)
    assert conditions(result)[status_mod.DEGRADED] == ("True", "ContainerConfigError")
    assert (
        'init container fetch-model: secret "hf-token" not found' in result.status["conditions"][3]["message"]
    )


def test_model_cache_fills_a_pvc_once_then_the_pods_mount_it_read_only() -> None:
    source = {"uri": "hf://org/llama-3.1-8b@v2", "tokenSecret": {"name": "hf"}}
    cache = {"size": "40Gi", "storageClassName": "fast"}
    env = [{"name": "HF_ENDPOINT", "value": "http://mirror.local"}]
    kube = FakeKube([H100])
    body = inference_service(model={"name": "llama-3.1-8b", "source": source, "cache": cache}, env=env)
    result = run(kube, body)
    kinds = sorted(k for k, _, _ in kube.objects)
    assert kinds == ["Job", "PersistentVolumeClaim", "PodDisruptionBudget", "Service"]  # no pods yet
    ((_, _, name),) = [key for key in kube.objects if key[0] == "Job"]
    assert name.startswith("llm-model-")
    claim = kube.objects[("PersistentVolumeClaim", "ns", name)]
    assert claim["spec"]["storageClassName"] == "fast"
    assert claim["spec"]["resources"]["requests"]["storage"] == "40Gi"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    job = kube.objects[("Job", "ns", name)]
    assert job["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["pagoda", "download"]
    assert container["command"][2:] == [
        "--repo",
        "org/llama-3.1-8b",
        "--revision",
        "v2",
        "--target",
        "/models/llama-3.1-8b",
    ]
    env_names = {e["name"]: e for e in container["env"]}
    assert env_names["HF_ENDPOINT"]["value"] == "http://mirror.local"
    assert env_names["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert result.status["cache"]["state"] == "Caching"
    assert conditions(result)[status_mod.READY] == ("False", "Caching")
    assert conditions(result)[status_mod.DEGRADED] == ("False", "Caching")

    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    kube.writes.clear()
    result = run(kube, body)
    assert "apply Job" not in kube.writes  # the Job is created once, never re-applied
    assert result.status["cache"]["state"] == "Cached"
    assert "Cached" in [e.reason for e in result.events]
    pod_spec = kube.objects[("Deployment", "ns", "llm")]["spec"]["template"]["spec"]
    volume = next(v for v in pod_spec["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": name, "readOnly": True}
    assert "initContainers" not in pod_spec  # nothing is fetched at pod start
    args = pod_spec["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/llama-3.1-8b"


def test_a_stuck_or_failed_download_is_degraded_whatever_the_gpus() -> None:
    source = {"uri": "hf://org/llama-3.1-8b", "tokenSecret": {"name": "hf"}}
    kube = FakeKube([H100])
    body = inference_service(model={"name": "llama-3.1-8b", "source": source, "cache": {"size": "40Gi"}})
    result = run(kube, body)
    assert conditions(result)[status_mod.DEGRADED] == ("False", "Caching")  # downloading, as far as known
    ((_, _, name),) = [key for key in kube.objects if key[0] == "Job"]
    # Its pod cannot start: the token's Secret is missing (the kubelet's words), or no node takes it.
    job_labels = {"batch.kubernetes.io/job-name": name}
    no_secret = {"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'}
    waiting = {"name": "download", "ready": False, "state": {"waiting": no_secret}}
    kube.pods = [
        {"metadata": {"name": "dl-1", "labels": job_labels}, "status": {"containerStatuses": [waiting]}}
    ]
    result = run(kube, body)
    assert conditions(result)[status_mod.DEGRADED] == ("True", "ContainerConfigError")
    assert result.status["conditions"][3]["message"] == (
        f'download Job {name}: pod dl-1 container download: secret "hf" not found'
    )
    pending = {
        "type": "PodScheduled",
        "status": "False",
        "message": "0/3 nodes are available: 3 node(s) had taint",
    }
    kube.pods = [{"metadata": {"name": "dl-2", "labels": job_labels}, "status": {"conditions": [pending]}}]
    assert conditions(run(kube, body))[status_mod.DEGRADED] == ("True", "Unschedulable")
    kube.pods = [{"metadata": {"name": "other", "labels": {"batch.kubernetes.io/job-name": "x"}}, "status": {
        "conditions": [pending]}}]  # fmt: skip
    assert conditions(run(kube, body))[status_mod.DEGRADED] == ("False", "Caching")  # another Job's pod
    kube.pods = []
    message = "Job has reached the specified backoff limit"
    kube.objects[("Job", "ns", name)]["status"] = {
        "conditions": [
            {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": message}
        ]
    }
    result = run(kube, body)
    assert result.status["cache"]["state"] == "Failed"
    assert conditions(result)[status_mod.DEGRADED] == ("True", "CacheFailed")
    assert message in result.status["cache"]["message"]
    assert [e.reason for e in result.events if e.type == "Warning"] == ["CacheFailed"]
    assert ("Deployment", "ns", "llm") not in kube.objects


def _complete(kube: FakeKube, name: str) -> None:
    kube.objects[("Job", "ns", name)]["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}


def test_a_new_revision_is_cached_beside_the_old_one_which_goes_once_it_is_cached() -> None:
    kube = FakeKube([H100])
    model = {"name": "llama-3.1-8b", "source": {"uri": "hf://org/m@v1"}, "cache": {"size": "40Gi"}}
    body = inference_service(model=model)
    run(kube, body)
    ((_, _, old),) = [key for key in kube.objects if key[0] == "Job"]
    _complete(kube, old)
    run(kube, body)
    assert ("Deployment", "ns", "llm") in kube.objects
    body["spec"]["model"]["source"]["uri"] = "hf://org/m@v2"
    body["metadata"]["generation"] = 2
    result = run(kube, body)
    (new,) = [name for kind, _, name in kube.objects if kind == "Job" and name != old]
    assert result.status["cache"]["state"] == "Caching"
    claim = kube.objects[("Deployment", "ns", "llm")]["spec"]["template"]["spec"]["volumes"][0]
    assert claim["persistentVolumeClaim"]["claimName"] == old  # the old revision serves on meanwhile
    _complete(kube, new)
    result = run(kube, body)
    assert result.status["cache"]["state"] == "Cached"
    claim = kube.objects[("Deployment", "ns", "llm")]["spec"]["template"]["spec"]["volumes"][0]
    assert claim["persistentVolumeClaim"]["claimName"] == new
    left = sorted((kind, name) for kind, _, name in kube.objects if kind in ("Job", "PersistentVolumeClaim"))
    assert left == [("Job", new), ("PersistentVolumeClaim", new)]


def test_a_failed_download_quotes_the_downloader() -> None:
    kube = FakeKube([H100])
    model = {"name": "llama-3.1-8b", "source": {"uri": "hf://org/m"}, "cache": {"size": "40Gi"}}
    body = inference_service(model=model)
    run(kube, body)
    ((_, _, name),) = [key for key in kube.objects if key[0] == "Job"]
    kube.objects[("Job", "ns", name)]["status"] = {"conditions": [{"type": "Failed", "status": "True"}]}
    said = "download of org/m@main from https://huggingface.co failed: HTTP Error 401: Unauthorized"
    terminated = {"state": {"terminated": {"exitCode": 1, "message": said}}}
    labels = {"batch.kubernetes.io/job-name": name}
    kube.pods = [
        {"metadata": {"name": "dl", "labels": labels}, "status": {"containerStatuses": [terminated]}}
    ]
    result = run(kube, body)
    assert said in result.status["cache"]["message"]


def test_the_download_job_runs_where_the_service_may() -> None:
    """It once ignored the spec's placement: on a cluster of tainted or labelled nodes its pod sat Pending
    while status said 'downloading'."""
    source = {"uri": "hf://org/llama-3.1-8b"}
    toleration = {"key": "pool", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}  # fmt: skip
    kube = FakeKube([gpu_node("h100", "NVIDIA-H100-80GB-HBM3", "9.0", 81559, 8)])
    kube.nodes[0]["metadata"]["labels"]["pool"] = "llm"
    body = inference_service(
        model={"name": "llama-3.1-8b", "source": source, "cache": {"size": "40Gi"}},
        nodeSelector={"pool": "llm"},
        tolerations=[toleration],
        affinity=affinity,
    )
    run(kube, body)
    ((job),) = [o for (kind, _, _), o in kube.objects.items() if kind == "Job"]
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == {"pool": "llm"}
    assert pod_spec["tolerations"] == [
        toleration,
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ]
    assert pod_spec["affinity"] == affinity
    kube = FakeKube([H100])
    run(kube, inference_service(model={"name": "llama-3.1-8b", "source": source, "cache": {"size": "40Gi"}}))
    ((job),) = [o for (kind, _, _), o in kube.objects.items() if kind == "Job"]
    assert (
        "nodeSelector" not in job["spec"]["template"]["spec"]
        and "affinity" not in job["spec"]["template"]["spec"]
    )
    # Its own placement and resources, where model.cache gives them.
    own = {
        "size": "40Gi",
        "nodeSelector": {"disk": "fast"},
        "tolerations": [],
        "resources": {"limits": {"cpu": "2"}},
    }
    kube = FakeKube([H100])
    spec = {"tolerations": [toleration]}
    run(kube, inference_service(model={"name": "llama-3.1-8b", "source": source, "cache": own}, **spec))
    ((job),) = [o for (kind, _, _), o in kube.objects.items() if kind == "Job"]
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == {"disk": "fast"}
    assert pod_spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod_spec["containers"][0]["resources"] == {"limits": {"cpu": "2"}}


def test_an_ingress_comes_and_goes_with_the_spec() -> None:
    kube = FakeKube([H100])
    body = inference_service(ingress={"host": "llm.example.com"})
    run(kube, body)
    assert ("Ingress", "ns", "llm") in kube.objects
    run(kube, inference_service())
    assert ("Ingress", "ns", "llm") not in kube.objects and "delete Ingress" in kube.writes
    assert ("Service", "ns", "llm") in kube.objects  # the rest stays


def test_an_http_route_comes_and_goes_and_a_cluster_without_the_gateway_api_is_named() -> None:
    kube = FakeKube([H100])
    route = {"parentRefs": [{"name": "public"}]}
    run(kube, inference_service(httpRoute=route))
    assert kube.objects[("HTTPRoute", "ns", "llm")]["spec"]["rules"][0]["backendRefs"][0]["name"] == "llm"
    run(kube, inference_service())
    assert ("HTTPRoute", "ns", "llm") not in kube.objects and "delete HTTPRoute" in kube.writes
    # No Gateway API in the cluster: its dry run finds no such resource. Nothing is applied, and the
    # condition says what to install, not the API server's "could not find the requested resource".
    kube = FakeKube([H100])
    not_found = {"message": "the server could not find the requested resource"}
    missing = KubeError(404, "PATCH", "/apis/gateway.networking.k8s.io/v1/...", not_found)
    kube.refuse[("HTTPRoute", True)] = missing
    result = run(kube, inference_service(httpRoute=route))
    status, reason = conditions(result)[status_mod.READY]
    message = next(c["message"] for c in result.status["conditions"] if c["type"] == status_mod.READY)
    assert (status, reason) == ("False", "InvalidSpec")
    assert "install the Gateway API CRDs" in message and "spec.httpRoute" in message
    assert not kube.objects  # nothing half-applied
    # Any other 404 stays a failure that may pass on a retry.
    del kube.refuse[("HTTPRoute", True)]
    kube.refuse[("Service", True)] = KubeError(404, "PATCH", "/api/v1/...", {"message": "namespace gone"})
    assert conditions(run(kube, inference_service()))[status_mod.READY][1] == "ApplyFailed"


def test_drift_apply_cannot_undo_is_replaced_even_when_it_wedges_the_dry_run() -> None:
    kube = FakeKube([H100])
    run(kube, inference_service())
    edit = {
        "manager": "kubectl-edit",
        "operation": "Update",
        "fieldsV1": {"f:spec": {"f:ports": {'k:{"port":9000,"protocol":"TCP"}': {".": {}}}}},
    }
    kube.objects[("Service", "ns", "llm")]["metadata"]["managedFields"] = [edit]
    kube.refuse[("Service", True)] = KubeError(422, "PATCH", "/svc", {"message": 'Duplicate value: "http"'})
    result = run(kube, inference_service())
    assert "replace Service" in kube.writes
    assert [e.reason for e in result.events if e.reason == "DriftCorrected"] == ["DriftCorrected"]
    assert conditions(result)[status_mod.READY][1] != "InvalidSpec"
    # Without drift of another manager, a refused dry run is the spec's fault: reported, nothing replaced.
    kube.objects[("Service", "ns", "llm")]["metadata"].pop("managedFields", None)
    kube.writes.clear()
    assert conditions(run(kube, inference_service()))[status_mod.READY][1] == "InvalidSpec"
    assert "replace Service" not in kube.writes


ROUTER_CHILDREN = {
    ("ServiceAccount", "ns", "llm-router"),
    ("Role", "ns", "llm-router"),
    ("RoleBinding", "ns", "llm-router"),
    ("PodDisruptionBudget", "ns", "llm-router"),
    ("Deployment", "ns", "llm-router"),
    ("Service", "ns", "llm-servers"),
}


def test_a_router_comes_and_goes_with_the_spec_and_the_service_follows_it() -> None:
    kube = FakeKube([H100])
    result = run(kube, inference_service(router={"enabled": True, "policy": "power_of_two"}))
    assert set(kube.objects) >= ROUTER_CHILDREN
    # No router pod is Ready yet: the clients stay on the servers, not on a selector with no endpoints.
    service = kube.objects[("Service", "ns", "llm")]
    assert service["spec"]["selector"]["app.kubernetes.io/name"] == "pagoda-server"
    kube.objects[("Deployment", "ns", "llm-router")]["status"] = {"replicas": 2, "readyReplicas": 1}
    run(kube, inference_service(router={"enabled": True, "policy": "power_of_two"}))
    service = kube.objects[("Service", "ns", "llm")]
    assert service["spec"]["selector"]["app.kubernetes.io/name"] == "pagoda-router"
    servers = kube.objects[("Service", "ns", "llm-servers")]
    assert servers["spec"]["selector"]["app.kubernetes.io/name"] == "pagoda-server"
    router = kube.objects[("Deployment", "ns", "llm-router")]
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--policy") + 1] == "power_of_two"
    # Ready while it can route (one healthy server), not /health: 503 while any one server is unhealthy.
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert container["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert args[args.index("--service-discovery-namespace") + 1] == "ns"
    assert "app.kubernetes.io/name=pagoda-server" in args and "app.kubernetes.io/instance=llm" in args
    assert router["metadata"]["ownerReferences"][0]["name"] == "llm"  # owned: deleted with the service
    assert result.status["grpcAddress"].startswith("llm-servers.ns.svc")  # the router carries HTTP only
    assert result.status["router"] == {
        "name": "llm-router",
        "policy": "power_of_two",
        "replicas": 0,
        "readyReplicas": 0,
    }
    kube.objects[("Deployment", "ns", "llm-router")]["status"] = {"replicas": 2, "readyReplicas": 2}
    result = run(kube, inference_service(router={"enabled": True, "policy": "power_of_two"}))
    assert (result.status["router"]["replicas"], result.status["router"]["readyReplicas"]) == (2, 2)
    assert result.status["readyReplicas"] == 0  # the servers' own count, not the router's
    kube.objects[("Deployment", "ns", "llm-router")]["status"] = {"replicas": 2, "readyReplicas": 0}
    run(kube, inference_service(router={"enabled": True, "policy": "power_of_two"}))  # no router pod Ready:
    selector = kube.objects[("Service", "ns", "llm")]["spec"]["selector"]  # the servers answer directly
    assert selector["app.kubernetes.io/name"] == "pagoda-server"
    kube.objects[("Deployment", "ns", "llm-router")]["status"] = {"replicas": 2, "readyReplicas": 2}
    run(kube, inference_service(router={"enabled": True, "policy": "power_of_two"}))
    # The model's Deployment is the same one, not a second.
    assert kube.objects[("Deployment", "ns", "llm")]["spec"]["selector"]["matchLabels"][
        "app.kubernetes.io/name"
    ] == ("pagoda-server")

    result = run(kube, inference_service())  # router off: its objects go, the Service selects the servers
    assert not ROUTER_CHILDREN & set(kube.objects)
    assert result.status["router"] is None  # a merge patch removes it
    assert (
        kube.objects[("Service", "ns", "llm")]["spec"]["selector"]["app.kubernetes.io/name"]
        == "pagoda-server"
    )
    assert {"delete Deployment", "delete Role", "delete RoleBinding"} <= set(kube.writes)
    assert ("Deployment", "ns", "llm") in kube.objects and result.status["grpcAddress"].startswith(
        "llm.ns.svc"
    )


def test_a_router_child_someone_else_owns_is_not_overwritten() -> None:
    kube = FakeKube([H100])
    kube.objects[("Role", "ns", "llm-router")] = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "llm-router", "namespace": "ns"},
        "rules": [],
    }
    result = run(kube, inference_service(router={"enabled": True}))
    assert any("Role llm-router exists and is not owned" in e.message for e in result.events)
    assert ("Deployment", "ns", "llm-router") not in kube.objects


def test_uri_adapters_are_fetched_by_the_cache_job_into_the_models_claim() -> None:
    """One Job: an init container per uri adapter (each with its own Secret), then the model; the
    claim is the model's, so a changed adapter list gets a new Job on it and the model is not fetched
    again (pagoda download finds its folder complete). The old Job goes once the new one is done."""
    source = {"uri": "hf://org/m@v1", "tokenSecret": {"name": "hf"}}
    adapters = [
        {"name": "sql", "source": {"uri": "hf://org/sql-lora", "tokenSecret": {"name": "hf-sql"}}},
        {"name": "baked", "source": {"imagePath": "/opt/loras/baked"}},
        {"name": "chat", "source": {"uri": "s3://loras/chat", "credentialsSecret": {"name": "s3"}}},
    ]
    kube = FakeKube([H100])
    model = {"name": "llama-3.1-8b", "source": source, "cache": {"size": "40Gi"}}
    plain = FakeKube([H100])
    run(plain, inference_service(model=model))
    ((_, _, model_only),) = [key for key in plain.objects if key[0] == "Job"]
    body = inference_service(model=model, adapters=adapters[:2])
    result = run(kube, body)
    ((_, _, claim),) = [key for key in kube.objects if key[0] == "PersistentVolumeClaim"]
    ((_, _, first),) = [key for key in kube.objects if key[0] == "Job"]
    assert claim == model_only  # the model's claim whatever the adapters: nothing fetched twice
    assert first != claim  # the Job's name carries the adapters too
    assert result.status["cache"] == {
        "state": "Caching",
        "message": f"downloading org/m@v1 and 1 adapter into PersistentVolumeClaim {claim}",
        "claimName": claim,
        "job": first,
    }
    pod_spec = kube.objects[("Job", "ns", first)]["spec"]["template"]["spec"]
    (sql,) = pod_spec["initContainers"]  # the image-path adapter is not fetched
    assert sql["name"] == "download-adapter-0"
    assert sql["command"] == [
        "pagoda", "download", "--repo", "org/sql-lora", "--revision", "main",
        "--target", "/models/adapters/sql",
    ]  # fmt: skip
    token = {e["name"]: e for e in sql["env"]}["HF_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-sql", "key": "token"}
    assert sql["volumeMounts"] == pod_spec["containers"][0]["volumeMounts"]  # the same claim
    _complete(kube, first)
    result = run(kube, body)
    assert result.status["cache"]["message"] == (
        f"org/m@v1 and 1 adapter are in PersistentVolumeClaim {claim}"
    )
    args = kube.objects[("Deployment", "ns", "llm")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--lora-modules") + 1 : args.index("--max-loras")] == [
        "sql=/models/adapters/sql",
        "baked=/opt/loras/baked",
    ]

    body["spec"]["adapters"] = adapters
    body["metadata"]["generation"] = 2
    result = run(kube, body)
    (second,) = [name for kind, _, name in kube.objects if kind == "Job" and name != first]
    assert result.status["cache"]["state"] == "Caching"
    second_pod = kube.objects[("Job", "ns", second)]["spec"]["template"]["spec"]
    assert second_pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim
    chat = second_pod["initContainers"][1]
    assert (
        chat["envFrom"] == [{"secretRef": {"name": "s3"}}] and chat["command"][-1] == "/models/adapters/chat"
    )
    args = kube.objects[("Deployment", "ns", "llm")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "chat=/models/adapters/chat" not in args  # the running pods serve on meanwhile
    _complete(kube, second)
    run(kube, body)
    args = kube.objects[("Deployment", "ns", "llm")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "chat=/models/adapters/chat" in args
    left = sorted((kind, name) for kind, _, name in kube.objects if kind in ("Job", "PersistentVolumeClaim"))
    assert left == [("Job", second), ("PersistentVolumeClaim", claim)]


def test_a_failed_adapter_download_quotes_its_init_container() -> None:
    kube = FakeKube([H100])
    model = {"name": "llama-3.1-8b", "source": {"uri": "hf://org/m"}, "cache": {"size": "40Gi"}}
    body = inference_service(model=model, adapters=[{"name": "sql", "source": {"uri": "hf://org/sql"}}])
    run(kube, body)
    ((_, _, name),) = [key for key in kube.objects if key[0] == "Job"]
    kube.objects[("Job", "ns", name)]["status"] = {"conditions": [{"type": "Failed", "status": "True"}]}
    said = "download of org/sql@main from https://huggingface.co failed: HTTP Error 404: Not Found"
    terminated = {"state": {"terminated": {"exitCode": 1, "message": said}}}
    labels = {"batch.kubernetes.io/job-name": name}
    status = {"initContainerStatuses": [terminated], "containerStatuses": [{"state": {"waiting": {}}}]}
    kube.pods = [{"metadata": {"name": "dl", "labels": labels}, "status": status}]
    result = run(kube, body)
    assert said in result.status["cache"]["message"]


def test_a_read_write_once_pod_cache_is_one_claim_per_adapter_list() -> None:
    """A new Job could never mount a ReadWriteOncePod claim that the running pods hold."""
    cache = {"size": "40Gi", "accessMode": "ReadWriteOncePod"}
    model = {"name": "llama-3.1-8b", "source": {"uri": "hf://org/m"}, "cache": cache}
    kube = FakeKube([H100])
    run(kube, inference_service(model=model, adapters=[{"name": "a", "source": {"uri": "hf://org/a"}}]))
    ((_, _, claim),) = [key for key in kube.objects if key[0] == "PersistentVolumeClaim"]
    ((_, _, job),) = [key for key in kube.objects if key[0] == "Job"]
    assert claim == job


def test_status_lists_the_adapters() -> None:
    adapters = [
        {"name": "sql", "source": {"uri": "hf://org/sql-lora@v1"}},
        {"name": "chat", "source": {"pvc": {"claimName": "loras", "path": "chat"}}},
        {"name": "tarot", "source": {"hostPath": "/mnt/tarot"}},
    ]
    kube = FakeKube([H100])
    body = inference_service(adapters=adapters)
    result = run(kube, body)
    assert result.status["adapters"] == [
        {"name": "sql", "source": "hf://org/sql-lora@v1", "path": "/adapters/uri/sql"},
        {"name": "chat", "source": "pvc:loras/chat", "path": "/adapters/pvc/loras/chat"},
        {"name": "tarot", "source": "hostPath:/mnt/tarot", "path": "/adapters/host/tarot"},
    ]
    crd = yaml.safe_load((ROOT / "crds" / "serving.pagoda.dev_inferenceservices.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert _value_keys(result.status) <= _schema_keys(schema)  # not pruned by the API server
    del body["spec"]["adapters"]
    body["metadata"]["generation"] = 2
    assert run(kube, body).status["adapters"] is None  # None: the merge patch removes the list
    body["spec"]["adapters"] = [{"name": "llama-3.1-8b", "source": {"imagePath": "/a"}}]
    body["metadata"]["generation"] = 3
    result = run(kube, body)
    assert result.status["adapters"] is None
    assert conditions(result)[status_mod.READY] == ("False", "InvalidSpec")


def test_a_job_of_an_adapter_list_no_longer_wanted_is_stopped_before_the_next_one_starts() -> None:
    """Two Jobs fetching the model into one folder would write the same partial files: a Job of an
    earlier list that has not finished is deleted, and the next starts once its pod is gone."""
    model = {"name": "llama-3.1-8b", "source": {"uri": "hf://org/m"}, "cache": {"size": "40Gi"}}
    body = inference_service(model=model, adapters=[{"name": "a", "source": {"uri": "hf://org/a"}}])
    kube = FakeKube([H100])
    run(kube, body)
    ((_, _, first),) = [key for key in kube.objects if key[0] == "Job"]
    job_pod = copy.deepcopy(kube.objects[("Job", "ns", first)]["spec"]["template"])
    job_pod["metadata"] = {"name": "dl-1", "labels": {**job_pod["metadata"]["labels"],
                                                      "batch.kubernetes.io/job-name": first}}  # fmt: skip
    job_pod["status"] = {"phase": "Running"}
    kube.pods = [job_pod]
    body["spec"]["adapters"] = [{"name": "b", "source": {"uri": "hf://org/b"}}]
    body["metadata"]["generation"] = 2
    result = run(kube, body)
    assert [key for key in kube.objects if key[0] == "Job"] == []  # the first deleted, the next waits
    assert f"deleted Job {first}: its adapter list is no longer wanted" in [e.message for e in result.events]
    assert result.status["cache"]["state"] == "Caching"
    assert result.status["cache"]["message"].startswith(f"waiting for pod dl-1 of download Job {first}")
    assert conditions(result)[status_mod.DEGRADED] == ("False", "Caching")
    job_pod["status"] = {"phase": "Failed"}  # killed: it writes no more
    result = run(kube, body)
    ((_, _, second),) = [key for key in kube.objects if key[0] == "Job"]
    assert second != first and result.status["cache"]["message"].startswith("downloading org/m@main")


H100_B = gpu_node("h100-b", "NVIDIA-H100-80GB-HBM3", "9.0", 81559, 8)
LLAMA_405B = {"name": "llama-3.1-405b", "source": {"imagePath": "/m"}}
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


def group_pod(
    name: str, group: int, index: int, created: str, revision: str = "r1", ready: bool = True
) -> dict:
    labels = {
        "app.kubernetes.io/name": "pagoda-server",
        "app.kubernetes.io/instance": "llm",
        "leaderworkerset.sigs.k8s.io/name": "llm-group",
        "leaderworkerset.sigs.k8s.io/group-index": str(group),
        WORKER_INDEX: str(index),
        "leaderworkerset.sigs.k8s.io/template-revision-hash": revision,
    }
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": labels, "creationTimestamp": created},
        "spec": {"nodeName": "h100" if index == 0 else "h100-b"},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def _group_ready(kube: FakeKube) -> None:
    lws = kube.objects[("LeaderWorkerSet", "ns", "llm-group")]
    lws["status"] = {"observedGeneration": lws["metadata"]["generation"], "replicas": 1, "readyReplicas": 1}
    lws["status"]["updatedReplicas"] = 1


def test_a_model_no_node_holds_runs_as_a_leader_worker_set_group() -> None:
    kube, body = FakeKube([H100, H100_B]), inference_service(model=LLAMA_405B, precision="bf16")
    result = run(kube, body)
    assert sorted(k for k, _, _ in kube.objects) == ["LeaderWorkerSet", "PodDisruptionBudget", "Service"]
    profile = result.status["profile"]
    assert (profile["tensorParallelSize"], profile["pipelineParallelSize"]) == (8, 2), profile["reason"]
    assert "does not fit one node of 8 x NVIDIA-H100-80GB-HBM3" in profile["reason"]
    # The scale subresource counts groups: their leaders.
    assert result.status["selector"].endswith(f",{WORKER_INDEX}=0")
    assert result.status["groups"] == [
        {"name": "llm-group-0", "leader": None, "workers": [], "size": 2, "readyPods": 0, "startedAt": None,
         "revision": None, "recreations": 0, "lastRecreation": None}
    ]  # fmt: skip
    _group_ready(kube)
    kube.pods = [
        group_pod("llm-group-0", 0, 0, "2026-01-01T00:01:00Z"),
        group_pod("llm-group-0-1", 0, 1, "2026-01-01T00:01:00Z"),
    ]
    kube.writes.clear()
    result = run(kube, body)
    assert kube.writes == [] and conditions(result)[status_mod.READY] == ("True", "ReplicasReady")
    (group,) = result.status["groups"]
    assert (group["leader"], group["workers"], group["readyPods"]) == ("llm-group-0", ["llm-group-0-1"], 2)
    assert (group["startedAt"], group["revision"], group["recreations"]) == ("2026-01-01T00:01:00Z", "r1", 0)


def test_a_recreated_group_is_counted_with_lws_reason() -> None:
    kube, body = FakeKube([H100, H100_B]), inference_service(model=LLAMA_405B, precision="bf16")
    run(kube, body)
    _group_ready(kube)
    kube.pods = [
        group_pod("llm-group-0", 0, 0, "2026-01-01T00:01:00Z"),
        group_pod("llm-group-0-1", 0, 1, "2026-01-01T00:01:00Z"),
    ]
    run(kube, body)
    # The worker dies: LWS deletes the leader (its workers with it) and says so on the LeaderWorkerSet.
    said = "Worker pod llm-group-0-1 failed, deleted leader pod llm-group-0 to recreate group 0"
    kube.events = [
        {"involvedObject": {"kind": "LeaderWorkerSet", "name": "llm-group"}, "reason": "RecreateGroup",
         "message": said, "eventTime": "2026-01-01T00:05:00.123456Z"},
        {"involvedObject": {"kind": "LeaderWorkerSet", "name": "llm-group"}, "reason": "RecreateGroup",
         "message": "Worker pod llm-group-1-1 failed, deleted leader pod llm-group-1 to recreate group 1",
         "eventTime": "2026-01-01T00:06:00Z"},
    ]  # fmt: skip
    kube.pods = [group_pod("llm-group-0", 0, 0, "2026-01-01T00:05:01Z", ready=False)]
    result = run(kube, body)
    (group,) = result.status["groups"]
    assert group["recreations"] == 1 and group["lastRecreation"] == {
        "time": "2026-01-01T00:05:01Z",
        "reason": said,
    }
    assert [(e.type, e.reason) for e in result.events] == [("Warning", "GroupRecreated")]
    assert (
        "group llm-group-0 recreated (once so far): Worker pod llm-group-0-1 failed"
        in result.events[0].message
    )
    assert run(kube, body).events == ()  # told once
    # A new template revision is a rollout, not a recreation; a leader replaced with no event says so.
    kube.pods = [group_pod("llm-group-0", 0, 0, "2026-01-01T00:09:00Z", revision="r2")]
    assert run(kube, body).status["groups"][0]["recreations"] == 1
    kube.pods = [group_pod("llm-group-0", 0, 0, "2026-01-01T00:12:00Z", revision="r2")]
    (group,) = run(kube, body).status["groups"]
    assert group["recreations"] == 2 and group["lastRecreation"]["reason"].startswith(
        "the leader pod was replaced"
    )


def test_switching_between_one_node_and_several_cleans_up_the_other_workload() -> None:
    kube, body = FakeKube([H100, H100_B]), inference_service(model=LLAMA_405B, precision="bf16")
    run(kube, body)
    assert ("LeaderWorkerSet", "ns", "llm-group") in kube.objects
    body["spec"]["precision"] = "fp8"  # fp8 fits one node: a Deployment, and the group goes
    body["metadata"]["generation"] = 2
    result = run(kube, body)
    group, deployment = ("LeaderWorkerSet", "ns", "llm-group"), ("Deployment", "ns", "llm")
    assert group not in kube.objects and deployment in kube.objects
    assert "deleted LeaderWorkerSet llm-group: no longer wanted" in [e.message for e in result.events]
    assert "groups" in result.status and result.status["groups"] is None  # removed from the status
    assert WORKER_INDEX not in kube.objects[("Service", "ns", "llm")]["spec"]["selector"]
    body["spec"]["pipelineParallelSize"] = 2  # asked for: back to a group
    body["metadata"]["generation"] = 3
    run(kube, body)
    assert deployment not in kube.objects and group in kube.objects
    assert kube.objects[("Service", "ns", "llm")]["spec"]["selector"][WORKER_INDEX] == "0"


def test_without_leader_worker_set_installed_the_status_says_so() -> None:
    kube, body = FakeKube([H100, H100_B]), inference_service(model=LLAMA_405B, precision="bf16")
    not_served = KubeError(404, "PATCH", "/apis/leaderworkerset.x-k8s.io/v1/...", "404 page not found")
    kube.refuse[("LeaderWorkerSet", True)] = not_served
    result = run(kube, body)
    assert kube.objects == {}  # nothing half-made
    assert conditions(result)[status_mod.READY] == ("False", "LeaderWorkerSetNotInstalled")
    assert conditions(result)[status_mod.DEGRADED] == ("True", "LeaderWorkerSetNotInstalled")
    ready = next(c for c in result.status["conditions"] if c["type"] == "Ready")
    assert "does not serve that API: install LeaderWorkerSet" in ready["message"]
    assert result.retry_seconds is None  # no crash loop of retries: the resync tries again
    assert [e.reason for e in result.events if e.type == "Warning"] == ["LeaderWorkerSetNotInstalled"]
    del kube.refuse[("LeaderWorkerSet", True)]  # installed: the next pass creates it
    run(kube, body)
    assert ("LeaderWorkerSet", "ns", "llm-group") in kube.objects


def test_a_group_status_fits_the_crd_schema() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "serving.pagoda.dev_inferenceservices.yaml").read_text())
    allowed = _schema_keys(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"])
    kube, body = FakeKube([H100, H100_B]), inference_service(model=LLAMA_405B, precision="bf16")
    run(kube, body)
    kube.pods = [group_pod("llm-group-0", 0, 0, "2026-01-01T00:01:00Z")]
    run(kube, body)
    kube.events = [{"involvedObject": {"kind": "LeaderWorkerSet", "name": "llm-group"},
                    "reason": "RecreateGroup", "message": "... to recreate group 0",
                    "eventTime": "2026-01-01T00:02:00Z"}]  # fmt: skip
    kube.pods = [group_pod("llm-group-0", 0, 0, "2026-01-01T00:03:00Z")]
    status = run(kube, body).status
    assert status["groups"][0]["lastRecreation"] is not None
    assert _value_keys(status) <= allowed
