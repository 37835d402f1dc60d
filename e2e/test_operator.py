"""The operator against a real control plane: the chart installed with Helm, `pagoda operator` run as a
local process with the chart's ServiceAccount token (so a permission the chart lacks fails here), the
examples applied on the simulated GPU catalogue (e2e/gpu_nodes.yaml), pods scheduled by the real
scheduler onto kwok nodes, garbage collection by the real kube-controller-manager.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "pagoda"
EXAMPLES = ROOT / "examples"
RELEASE, RELEASE_NS = "pagoda-e2e", "pagoda-system"
RESYNC_SECONDS = 3


class Operator:
    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc = proc
        self.log = log

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def wait_for(
    what: str, check: Callable[[], Any], timeout: float = 60.0, context: Callable[[], str] = str
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{context()}")
        time.sleep(0.5)


def helm(cluster, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(cluster.bin_dir / "helm"), "--kubeconfig", str(cluster.kubeconfig), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=cluster.env, check=True, timeout=300)


def get(cluster, namespace: str, *what: str) -> dict | None:
    out = cluster.kubectl("get", *what, "-n", namespace, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def running_operator(cluster, log: Path, resync_seconds: float = RESYNC_SECONDS) -> Iterator[Operator]:
    """The chart installed and `pagoda operator` running with its ServiceAccount; both gone afterwards."""
    # Helm installs crds/ only on first install and never upgrades it: apply the CRD as the chart's
    # README says to on upgrade, so that a cluster kept from an earlier run gets this version.
    crd = CHART / "crds" / "serving.pagoda.dev_inferenceservices.yaml"
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    helm(cluster, "install", RELEASE, str(CHART), "-n", RELEASE_NS, "--create-namespace")
    kubeconfig = cluster.serviceaccount_kubeconfig(RELEASE_NS, RELEASE)
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONSAFEPATH": "1"}
    cmd = [sys.executable, "-m", "pagoda.cli", "operator", f"--resync-seconds={resync_seconds}"]
    cmd += [f"--liveness=http://127.0.0.1:{port}/healthz", "--drain-seconds=30"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    op = Operator(proc, log)
    try:
        wait_for("the operator's liveness endpoint", lambda: healthy(f"http://127.0.0.1:{port}/healthz"),
                 context=op.tail)  # fmt: skip
        yield op
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        # No pre-delete hook: its Job needs the operator image on a node, which only the real node has
        # (test_real_pods.py runs it there).
        helm(cluster, "uninstall", RELEASE, "-n", RELEASE_NS, "--no-hooks")


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory) -> Iterator[Operator]:
    with running_operator(cluster, tmp_path_factory.mktemp("operator") / "operator.log") as op:
        yield op


def apply(cluster, namespace: str, obj: dict | Path) -> None:
    text = obj.read_text() if isinstance(obj, Path) else json.dumps(obj)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=text)


def condition(isvc: dict | None, kind: str) -> str | None:
    for cond in ((isvc or {}).get("status") or {}).get("conditions") or ():
        if cond["type"] == kind:
            return cond["status"]
    return None


def ready_service(cluster, namespace: str, name: str, op: Operator, timeout: float = 90.0) -> dict:
    """Ready=True in a status written for the current spec: right after a change (`kubectl scale`, a
    patch) the status still says what it said of the previous generation."""

    def check() -> dict | None:
        isvc = get(cluster, namespace, "inferenceservice", name)
        if isvc is None or isvc.get("status", {}).get("observedGeneration") != isvc["metadata"]["generation"]:
            return None
        return isvc if condition(isvc, "Ready") == "True" else None

    def context() -> str:
        isvc = get(cluster, namespace, "inferenceservice", name)
        pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
        status = json.dumps((isvc or {}).get("status"), indent=1)
        return f"status: {status}\npods:\n{pods}\noperator log:\n{op.tail()}"

    return wait_for(f"InferenceService {name} Ready=True", check, timeout, context)


def running_pods(cluster, namespace: str, name: str) -> list[dict]:
    """The service's running server pods (not its router's: a service of several replicas has one)."""
    selector = f"app.kubernetes.io/name=pagoda-server,app.kubernetes.io/instance={name}"
    pods = get(cluster, namespace, "pods", "-l", selector) or {"items": []}
    return [
        p
        for p in pods["items"]
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


def server_args(deployment: dict) -> dict[str, str]:
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return {a: b for a, b in zip(args, [*args[1:], ""], strict=True) if a.startswith("--")}


def test_chart_lints_and_renders_into_the_api_server(cluster) -> None:
    out = helm(cluster, "lint", "--strict", str(CHART))
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout
    for values in ([], ["--set", "operator.watchNamespaces={a,b}", "--set", "rbac.create=true"]):
        rendered = helm(
            cluster, "template", "dry", str(CHART), "-n", "default", "--include-crds", *values
        ).stdout
        result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered)
        assert "deployment.apps/dry-pagoda" in result.stdout


INVALID = [
    ({"replicas": 2, "autoscaling": {"maxReplicas": 3}}, "set either replicas or autoscaling, not both"),
    (
        {"autoscaling": {"minReplicas": 5, "maxReplicas": 3}},
        "autoscaling.minReplicas must be less than or equal to autoscaling.maxReplicas",
    ),
    (
        {"precision": "fp8", "gpuPreferences": [{"product": "H100"}, {"product": "NVIDIA-A100-SXM4-80GB"}]},
        "precision fp8 needs compute capability 8.9 or newer",
    ),
    (
        {"gpuPreferences": [{"product": "Tesla-T4", "precision": "fp8"}]},
        "fp8 needs compute capability 8.9 or newer (Ada, Hopper, Blackwell); this GPU is older",
    ),
    (
        {"model": {"name": "m", "source": {"imagePath": "/a", "hostPath": "/b"}}},
        "give exactly one of pvc, hostPath, imagePath or uri",
    ),
    ({"model": {"name": "m", "source": {}}}, "give exactly one of pvc, hostPath, imagePath or uri"),
    ({"tensorParallelSize": 3}, "tensorParallelSize must be auto, 1, 2, 4 or 8"),
    ({"precision": "int8"}, 'spec.precision: Unsupported value: "int8"'),
    (
        {"engine": {"extraArgs": ["--tensor-parallel-size=4"]}},
        'extraArgs[0]: Invalid value: "--tensor-parallel-size=4": engine.extraArgs cannot set a flag',
    ),
    # argparse takes unique prefixes, and the last value wins: an abbreviation would override too.
    ({"engine": {"extraArgs": ["--seed", "1", "--tensor", "4"]}}, "engine.extraArgs cannot set a flag"),
    ({"engine": {"extraArgs": ["--no-enable-prefix"]}}, "engine.extraArgs cannot set a flag"),
    # engine.kvCacheDtype and engine.apiServerCount render these two: extraArgs may not set them.
    (
        {"engine": {"extraArgs": ["--kv-cache-dtype", "fp8"]}},
        'extraArgs[0]: Invalid value: "--kv-cache-dtype": engine.extraArgs cannot set a flag',
    ),
    (
        {"engine": {"extraArgs": ["--seed", "1", "--api-server-count=2"]}},
        'extraArgs[2]: Invalid value: "--api-server-count=2": engine.extraArgs cannot set a flag',
    ),
    ({"engine": {"kvCacheDtype": "int8"}}, 'spec.engine.kvCacheDtype: Unsupported value: "int8"'),
    ({"engine": {"apiServerCount": 17}}, "should be less than or equal to 16"),
]


@pytest.mark.parametrize(("spec", "message"), INVALID, ids=[m[:40] for _, m in INVALID])
def test_invalid_objects_are_refused_with_their_message(cluster, namespace, spec: dict, message: str) -> None:
    body = {
        "apiVersion": "serving.pagoda.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "bad"},
        "spec": {"model": {"name": "llama-3.1-8b", "source": {"imagePath": "/m"}}} | spec,
    }
    if not get(cluster, "default", "crd", "inferenceservices.serving.pagoda.dev"):
        cluster.kubectl(
            "apply", "--server-side", "-f", str(ROOT / "crds" / "serving.pagoda.dev_inferenceservices.yaml")
        )
        cluster.kubectl("wait", "--for=condition=Established", "crd/inferenceservices.serving.pagoda.dev")
    out = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(body), check=False)
    assert out.returncode != 0
    assert message in out.stderr


def test_extra_args_of_the_users_own_are_accepted(cluster, namespace, operator) -> None:
    body = small_service("extra")
    body["spec"]["engine"] = {"extraArgs": ["--seed", "7", "--device=cuda", "--max-num-batched-tokens=4096"]}
    out = cluster.kubectl(
        "create", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(body), check=False
    )
    assert out.returncode == 0, out.stderr


def test_names_that_cannot_name_a_service_are_refused(cluster, namespace, operator) -> None:
    body = small_service("llama-3.1-8b")
    out = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(body), check=False)
    assert out.returncode != 0
    assert "metadata.name must be a DNS-1035 label" in out.stderr


# example file -> (node, precision, TP), or None: ProfileSelected=False and no workload.
CATALOGUE_CASES = {
    "llama-3.1-8b.yaml": ("gpu-h200-0", "fp8", 1),
    "llama-3.1-8b-a100.yaml": ("gpu-a100-80gb-0", "bf16", 1),
    "llama-3.1-8b-l4.yaml": ("gpu-l4-0", "fp8", 1),
    "llama-3.1-70b.yaml": ("gpu-h100-0", "bf16", 4),
    "llama-3.1-70b-fp8.yaml": ("gpu-h100-0", "fp8", 2),
    "llama-3.2-3b-t4.yaml": ("gpu-t4-0", "fp16", 1),
    "llama-3.1-8b-t4.yaml": None,
}


def models_volume(cluster, namespace: str) -> str:
    """A statically bound PV + PVC named `models` for the examples that read weights from a claim."""
    pv = f"models-{namespace}"
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
        "spec": {"capacity": {"storage": "1Ti"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                 "hostPath": {"path": "/data/models"}, "persistentVolumeReclaimPolicy": "Retain",
                 "claimRef": {"namespace": namespace, "name": "models"}},
    }))  # fmt: skip
    apply(cluster, namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv,
                 "resources": {"requests": {"storage": "1Ti"}}},
    })  # fmt: skip
    return pv


def test_examples_get_the_right_profile_on_the_gpu_catalogue(cluster, namespace, operator) -> None:
    pv = models_volume(cluster, namespace)
    try:
        extra = yaml.safe_load((EXAMPLES / "llama-3.1-8b.yaml").read_text())
        extra["metadata"]["name"] = "llama-3-1-8b-h100"
        extra["spec"]["gpuPreferences"] = [{"product": "H100"}]
        apply(cluster, namespace, extra)
        for example in CATALOGUE_CASES:
            apply(cluster, namespace, EXAMPLES / example)
        cases = {
            yaml.safe_load((EXAMPLES / f).read_text())["metadata"]["name"]: want
            for f, want in CATALOGUE_CASES.items()
        }
        cases["llama-3-1-8b-h100"] = ("gpu-h100-0", "fp8", 1)
        for name, want in cases.items():
            if want is None:
                isvc = wait_for(
                    f"{name} ProfileSelected=False",
                    lambda name=name: (
                        (i := get(cluster, namespace, "inferenceservice", name))
                        and condition(i, "ProfileSelected") == "False"
                        and i
                    ),
                    context=operator.tail,
                )
                assert isvc["status"]["profile"]["reason"] == (
                    "8B fp16 needs 2 x 15 GiB; largest node has 1 x 15 GiB (Tesla-T4); over several nodes: "
                    "1 x Tesla-T4 (15 GiB, cc 7.5): 8B fp16 TP 1 x PP 2 needs 2 pods of 1 GPU; 1 node of 1 x "
                    "Tesla-T4 has room for 1"
                )
                assert condition(isvc, "Ready") == "False"
                assert get(cluster, namespace, "deployment", name) is None
                continue
            node, precision, tp = want
            isvc = ready_service(cluster, namespace, name, operator)
            profile = isvc["status"]["profile"]
            assert (profile["precision"], profile["tensorParallelSize"]) == (precision, tp), profile["reason"]
            assert node in profile["gpu"]["nodes"]
            deployment = get(cluster, namespace, "deployment", name)
            assert deployment is not None
            args = server_args(deployment)
            assert (args["--precision"], args["--tensor-parallel-size"]) == (precision, str(tp))
            container = deployment["spec"]["template"]["spec"]["containers"][0]
            assert container["resources"]["limits"]["nvidia.com/gpu"] == str(tp)
            pods = running_pods(cluster, namespace, name)
            assert pods and {p["spec"]["nodeName"] for p in pods} == {node}
            owners = deployment["metadata"]["ownerReferences"]
            assert [(o["kind"], o["name"]) for o in owners] == [("InferenceService", name)]
        # The autoscaled 70B service got its HPA, on the server's queue-depth and KV metrics.
        hpa = get(cluster, namespace, "hpa", "llama-3-1-70b")
        assert hpa is not None
        assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} == {
            "pagoda_requests_waiting",
            "pagoda_kv_cache_usage_ratio",
        }
        printed = cluster.kubectl("get", "pis", "-n", namespace).stdout
        assert "NVIDIA-H100-80GB-HBM3" in printed and "fp8" in printed
    finally:
        cluster.kubectl(
            "delete", "pis", "--all", "-n", namespace, "--wait=true", "--timeout=60s", check=False
        )
        cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)


def small_service(name: str, **spec: Any) -> dict:
    return {
        "apiVersion": "serving.pagoda.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "llama-3.1-8b", "source": {"imagePath": "/models/llama"}},
            "gpuPreferences": [{"product": "L40S"}],
        }
        | spec,
    }


def deletion_stuck(cluster, namespace: str, name: str, stderr: str, op: Operator, grace: float = 30.0) -> str:
    """Why a `kubectl delete --wait` timed out: the object's finalizers and deletionTimestamp then, whether
    it went within `grace` seconds more (kopf looks again at a timer still in its pass only every
    settings.background.cancellation_polling seconds: 60 by default, 1 as handlers.configure sets it), and
    the operator's log."""
    isvc = get(cluster, namespace, "inferenceservice", name)
    meta = (isvc or {}).get("metadata") or {}
    # kopf's progress and touch annotations; not the two copies of the spec (last-handled, last-applied).
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if "/last-" not in k}
    start = time.monotonic()
    gone = wait_for_quietly(lambda: get(cluster, namespace, "inferenceservice", name) is None, grace)
    later = f"gone {time.monotonic() - start:.1f}s later" if gone else f"still there {grace:.0f}s later"
    return (
        f"{stderr}\nat the timeout: finalizers={meta.get('finalizers')} "
        f"deletionTimestamp={meta.get('deletionTimestamp')} resourceVersion={meta.get('resourceVersion')} "
        f"annotations={annotations}; {later}\noperator log:\n{op.tail(120)}"
    )


def wait_for_quietly(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def test_scale_roll_repair_and_delete(cluster, namespace, operator) -> None:
    apply(cluster, namespace, small_service("life", replicas=1))
    ready_service(cluster, namespace, "life", operator)

    # `kubectl scale` goes through the scale subresource.
    cluster.kubectl("scale", "pis/life", "-n", namespace, "--replicas=2")
    wait_for("2 pods", lambda: len(running_pods(cluster, namespace, "life")) == 2, context=operator.tail)
    isvc = ready_service(cluster, namespace, "life", operator)
    assert isvc["status"]["readyReplicas"] == 2
    assert get(cluster, namespace, "deployment", "life")["spec"]["replicas"] == 2

    # A spec change rolls the Deployment out to new pods.
    before = {p["metadata"]["name"] for p in running_pods(cluster, namespace, "life")}
    cluster.kubectl(
        "patch", "pis/life", "-n", namespace, "--type=merge", "-p", '{"spec":{"engine":{"maxNumSeqs":64}}}'
    )

    def rolled() -> bool:
        dep = get(cluster, namespace, "deployment", "life")
        pods = {p["metadata"]["name"] for p in running_pods(cluster, namespace, "life")}
        return (
            bool(dep)
            and server_args(dep).get("--max-num-seqs") == "64"
            and len(pods) == 2
            and not pods & before
        )

    wait_for("the rollout to new pods", rolled, timeout=120, context=operator.tail)
    isvc = ready_service(cluster, namespace, "life", operator)
    assert isvc["status"]["observedGeneration"] == isvc["metadata"]["generation"]

    # A hand-deleted Service comes back; a hand-edited Deployment is put back.
    uid = get(cluster, namespace, "service", "life")["metadata"]["uid"]
    cluster.kubectl("delete", "service", "life", "-n", namespace)
    wait_for(
        "the Service to come back",
        lambda: (s := get(cluster, namespace, "service", "life")) and s["metadata"]["uid"] != uid,
        context=operator.tail,
    )
    cluster.kubectl("set", "image", "deployment/life", "server=example.invalid/other:1", "-n", namespace)
    wait_for(
        "the image to be put back",
        lambda: (
            get(cluster, namespace, "deployment", "life")["spec"]["template"]["spec"]["containers"][0][
                "image"
            ]
            != "example.invalid/other:1"
        ),
        context=operator.tail,
    )

    # Deleting the InferenceService removes every child (kube-controller-manager's garbage collector).
    deleted = cluster.kubectl(
        "delete", "pis/life", "-n", namespace, "--wait=true", "--timeout=60s", check=False
    )
    # This has timed out now and then (kopf holding the finalizer): say what the object still holds.
    assert deleted.returncode == 0, deletion_stuck(cluster, namespace, "life", deleted.stderr, operator)
    for kind in ("deployment", "service", "poddisruptionbudget"):
        wait_for(
            f"the {kind} to be collected", lambda kind=kind: get(cluster, namespace, kind, "life") is None
        )


def test_hand_edits_that_apply_cannot_undo_converge(cluster, namespace, operator) -> None:
    """Server-side apply takes back the fields the operator sets but never removes what a hand edit added:
    a Service port changed by hand once made every apply fail (two ports named http) until the Service was
    deleted by hand. Each edit below converges back, with a DriftCorrected event, and the service stays
    Ready (no InvalidSpec on the way)."""
    apply(cluster, namespace, small_service("drift"))
    ready_service(cluster, namespace, "drift", operator)
    want = {
        kind: get(cluster, namespace, kind, "drift")
        for kind in ("service", "deployment", "poddisruptionbudget")
    }

    def ports(svc: dict | None) -> list:
        return sorted((p["name"], p["port"]) for p in (svc or {}).get("spec", {}).get("ports", []))

    def edit(kind: str, patch_type: str, patch: Any) -> None:
        cluster.kubectl(
            "patch", kind, "drift", "-n", namespace, f"--type={patch_type}", "-p", json.dumps(patch)
        )

    # The wedge: the http port moved to 9000 by hand.
    http = next(i for i, p in enumerate(want["service"]["spec"]["ports"]) if p["name"] == "http")
    # (The operator may have put it back before the next read: the event below says it saw 9000.)
    edit("service", "json", [{"op": "replace", "path": f"/spec/ports/{http}/port", "value": 9000}])
    wait_for(
        "the Service's ports to converge",
        lambda: ports(get(cluster, namespace, "service", "drift")) == ports(want["service"]),
        context=operator.tail,
    )
    # Keys added to a selector (the Service would select no pod: apply takes an atomic map back whole)
    # and to the pod template's labels (a granular map: apply leaves the key, a replace removes it).
    edit("service", "merge", {"spec": {"selector": {"tier": "hand"}}})
    edit("poddisruptionbudget", "merge", {"spec": {"selector": {"matchLabels": {"tier": "hand"}}}})
    edit("deployment", "merge", {"spec": {"template": {"metadata": {"labels": {"tier": "hand"}}}}})
    for kind, field in [
        ("service", lambda o: o["spec"]["selector"]),
        ("poddisruptionbudget", lambda o: o["spec"]["selector"]),
        ("deployment", lambda o: o["spec"]["template"]["metadata"]["labels"]),
    ]:
        wait_for(
            f"the {kind}'s selector or labels to converge",
            lambda kind=kind, field=field: field(get(cluster, namespace, kind, "drift")) == field(want[kind]),
            context=operator.tail,
        )
    assert (
        get(cluster, namespace, "service", "drift")["spec"]["clusterIP"]
        == want["service"]["spec"]["clusterIP"]
    )
    isvc = ready_service(cluster, namespace, "drift", operator)
    ready = next(c for c in isvc["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] != "InvalidSpec", ready
    events = get(cluster, namespace, "events", "--field-selector", "reason=DriftCorrected")
    said = " ".join(e["message"] for e in events["items"] if e["involvedObject"]["name"] == "drift")
    assert "replaced Service drift: spec.ports[port=9000,protocol=TCP]" in said, said
    assert "replaced Deployment drift: spec.template.metadata.labels.tier (kubectl-patch)" in said, said
    # Selectors are atomic maps: apply takes each back whole, with no replace.
    assert "selector" not in said and "PodDisruptionBudget" not in said, said
    cluster.kubectl("delete", "pis/drift", "-n", namespace, "--wait=true", "--timeout=60s")


def test_pod_labels_annotations_and_service_from_the_spec(cluster, namespace, operator) -> None:
    """What NIMService and KServe users reach for: labels and annotations on the pods, the Service's type
    and annotations, through the real API server; the operator's own labels cannot be replaced."""
    spec = {
        "podLabels": {"team": "search"},
        "podAnnotations": {"cost-centre": "42"},
        "service": {"type": "NodePort", "annotations": {"lb.example/internal": "true"}},
    }
    apply(cluster, namespace, small_service("dressed", **spec))
    ready_service(cluster, namespace, "dressed", operator)
    template = get(cluster, namespace, "deployment", "dressed")["spec"]["template"]["metadata"]
    assert template["labels"]["team"] == "search" and template["annotations"]["cost-centre"] == "42"
    assert template["labels"]["app.kubernetes.io/instance"] == "dressed"
    svc = get(cluster, namespace, "service", "dressed")
    assert svc["spec"]["type"] == "NodePort" and all(p.get("nodePort") for p in svc["spec"]["ports"])
    assert svc["metadata"]["annotations"]["lb.example/internal"] == "true"
    pods = running_pods(cluster, namespace, "dressed")
    assert pods and all(p["metadata"]["labels"]["team"] == "search" for p in pods)

    # Extra volumes and mounts: a ConfigMap in the running pods at the path asked for.
    cluster.kubectl("create", "configmap", "templates", "--from-literal=chat.jinja=hi", "-n", namespace)
    volumes = [{"name": "templates", "configMap": {"name": "templates"}}]
    mounts = [{"name": "templates", "mountPath": "/etc/templates", "readOnly": True}]
    apply(cluster, namespace, small_service("dressed", **spec, volumes=volumes, volumeMounts=mounts))

    def mounted() -> bool:
        pods = running_pods(cluster, namespace, "dressed")
        return bool(pods) and all(
            {"name": "templates", "configMap": {"name": "templates", "defaultMode": 420}}
            in p["spec"]["volumes"]
            and any(m["mountPath"] == "/etc/templates" for m in p["spec"]["containers"][0]["volumeMounts"])
            for p in pods
        )

    wait_for("the pods with the extra volume", mounted, timeout=120, context=operator.tail)
    # A volume the API server refuses (no source of any kind it knows) is InvalidSpec, nothing changed.
    broken = small_service("broken", volumes=[{"name": "v", "configMap": {}}], volumeMounts=[])
    apply(cluster, namespace, broken)

    def broken_refused() -> dict | None:
        isvc = get(cluster, namespace, "inferenceservice", "broken")
        conds = ((isvc or {}).get("status") or {}).get("conditions") or ()
        ready = next((c for c in conds if c["type"] == "Ready"), None)
        return ready if ready and ready["reason"] == "InvalidSpec" else None

    said = wait_for("the broken volume refused by the dry run", broken_refused, context=operator.tail)
    assert "Deployment broken refused by the API server" in said["message"], said
    assert get(cluster, namespace, "deployment", "broken") is None

    bad = small_service("relabelled", podLabels={"app.kubernetes.io/instance": "dressed"})
    apply(cluster, namespace, bad)

    def refused() -> dict | None:
        isvc = get(cluster, namespace, "inferenceservice", "relabelled")
        ready = next(
            (c for c in ((isvc or {}).get("status") or {}).get("conditions") or () if c["type"] == "Ready"),
            None,
        )
        return ready if ready and ready["reason"] == "InvalidSpec" else None

    ready = wait_for("the relabelling spec refused", refused, context=operator.tail)
    assert "podLabels: app.kubernetes.io/instance is set by the operator" in ready["message"], ready
    assert get(cluster, namespace, "deployment", "relabelled") is None  # nothing half-made
    for name in ("dressed", "broken", "relabelled"):
        cluster.kubectl("delete", "pis", name, "-n", namespace, "--wait=true", "--timeout=60s")


def test_an_ingress_comes_and_goes_with_the_spec(cluster, namespace, operator) -> None:
    ingress = {"host": "llm.example.com", "className": "nginx", "tlsSecretName": "llm-cert"}
    apply(cluster, namespace, small_service("exposed", ingress=ingress))
    ready_service(cluster, namespace, "exposed", operator)
    ing = wait_for(
        "the Ingress", lambda: get(cluster, namespace, "ingress", "exposed"), context=operator.tail
    )
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == "llm.example.com" and ing["spec"]["ingressClassName"] == "nginx"
    assert rule["http"]["paths"][0]["backend"]["service"] == {"name": "exposed", "port": {"name": "http"}}
    assert ing["spec"]["tls"] == [{"hosts": ["llm.example.com"], "secretName": "llm-cert"}]
    assert ing["metadata"]["ownerReferences"][0]["name"] == "exposed"
    cluster.kubectl(
        "patch",
        "pis",
        "exposed",
        "-n",
        namespace,
        "--type=json",
        "-p",
        '[{"op":"remove","path":"/spec/ingress"}]',
    )
    wait_for(
        "the Ingress removed with the field",
        lambda: get(cluster, namespace, "ingress", "exposed") is None,
        context=operator.tail,
    )
    assert get(cluster, namespace, "service", "exposed") is not None
    cluster.kubectl("delete", "pis", "exposed", "-n", namespace, "--wait=true", "--timeout=60s")


GATEWAY_API_VERSION = "v1.6.3"  # its CRDs come from the Go module proxy, as the control plane's sources


def gateway_api_crd(kind_plural: str) -> Path:
    """The Gateway API's standard CRD of `kind_plural` from its Go module (Go's module cache holds it)."""
    out = subprocess.run(
        ["go", "mod", "download", "-json", f"sigs.k8s.io/gateway-api@{GATEWAY_API_VERSION}"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"},
        timeout=300,
    ).stdout
    return (
        Path(json.loads(out)["Dir"]) / "config/crd/standard" / f"gateway.networking.k8s.io_{kind_plural}.yaml"
    )


def test_an_http_route_waits_for_the_gateway_api_then_comes_converges_and_goes(
    cluster, namespace, operator
) -> None:
    """spec.httpRoute in a cluster without the Gateway API: Ready=False, InvalidSpec, naming what to
    install, and nothing half-applied. Once the HTTPRoute CRD is installed the operator (kopf starts
    watching the new resource) creates the route; a hand edit of it converges back; removing the field
    deletes it."""
    crd = gateway_api_crd("httproutes")
    route = {"parentRefs": [{"name": "public", "namespace": "gateways"}], "hostnames": ["llm.example.com"]}
    apply(cluster, namespace, small_service("gw", httpRoute=route))

    def refused() -> str | None:
        isvc = get(cluster, namespace, "inferenceservice", "gw") or {}
        conds = {c["type"]: c for c in (isvc.get("status") or {}).get("conditions") or ()}
        ready = conds.get("Ready", {})
        return ready.get("message") if ready.get("reason") == "InvalidSpec" else None

    message = wait_for("InvalidSpec naming the Gateway API", refused, context=operator.tail)
    assert "install the Gateway API CRDs" in message, message
    assert get(cluster, namespace, "deployment", "gw") is None  # nothing half-made
    cluster.kubectl("apply", "--server-side", "-f", str(crd))
    try:
        got = wait_for(
            "the HTTPRoute",
            lambda: get(cluster, namespace, "httproute", "gw"),
            timeout=120,
            context=operator.tail,
        )
        assert got["spec"]["parentRefs"][0]["name"] == "public" and got["spec"]["hostnames"] == [
            "llm.example.com"
        ]
        assert got["spec"]["rules"][0]["backendRefs"][0]["name"] == "gw"
        assert got["metadata"]["ownerReferences"][0]["name"] == "gw"
        ready_service(cluster, namespace, "gw", operator)
        edit = '[{"op":"replace","path":"/spec/rules/0/backendRefs/0/port","value":9999}]'
        cluster.kubectl("patch", "httproute", "gw", "-n", namespace, "--type=json", "-p", edit)
        wait_for(
            "the route's backend port back at 8000",
            lambda: (
                get(cluster, namespace, "httproute", "gw")["spec"]["rules"][0]["backendRefs"][0]["port"]
                == 8000
            ),
            context=operator.tail,
        )
        remove = '[{"op":"remove","path":"/spec/httpRoute"}]'
        cluster.kubectl("patch", "pis", "gw", "-n", namespace, "--type=json", "-p", remove)
        wait_for(
            "the HTTPRoute removed with the field",
            lambda: get(cluster, namespace, "httproute", "gw") is None,
            context=operator.tail,
        )
        cluster.kubectl("delete", "pis", "gw", "-n", namespace, "--wait=true", "--timeout=60s")
    finally:
        cluster.kubectl("delete", "-f", str(crd), "--wait=true", check=False)


def test_objects_not_ours_are_left_alone(cluster, namespace, operator) -> None:
    cluster.kubectl("create", "service", "clusterip", "taken", "--tcp=80:80", "-n", namespace)
    apply(cluster, namespace, small_service("taken"))

    def degraded() -> dict | None:
        isvc = get(cluster, namespace, "inferenceservice", "taken")
        return isvc if condition(isvc, "Degraded") == "True" else None

    isvc = wait_for("Degraded=True", degraded, context=operator.tail)
    conds = {c["type"]: c for c in isvc["status"]["conditions"]}
    assert conds["Degraded"]["reason"] == "Conflict"
    assert "Service taken exists and is not owned" in conds["Degraded"]["message"]
    assert get(cluster, namespace, "deployment", "taken") is None
    svc = get(cluster, namespace, "service", "taken")
    assert svc is not None and not svc["metadata"].get("ownerReferences")


def test_a_new_gpu_node_is_used_and_a_cordon_moves_nothing(
    cluster, namespace, operator, cluster_harness
) -> None:
    # Waiting for a GPU the cluster does not have yet; and one running on L40S.
    apply(cluster, namespace, small_service("waiting", gpuPreferences=[{"product": "B200"}]))
    apply(
        cluster, namespace, small_service("steady", gpuPreferences=[{"product": "B200"}, {"product": "L40S"}])
    )
    isvc = ready_service(cluster, namespace, "steady", operator)
    assert isvc["status"]["profile"]["gpu"]["product"] == "NVIDIA-L40S"
    (steady_pod,) = [p["metadata"]["name"] for p in running_pods(cluster, namespace, "steady")]
    gpus = {"NVIDIA-B200": {"family": "blackwell", "compute": "10.0", "memory": "183359"}}
    entry = {"name": "gpu-b200-e2e", "product": "NVIDIA-B200", "gpus": 8, "cpu": "224", "memory": "2Ti"}
    node = cluster_harness.nodes.node_manifest(entry, gpus)
    cluster.kubectl("create", "-f", "-", input=json.dumps(node))
    try:
        wait_for(
            "the waiting service to start on the new B200 node",
            lambda: (
                [p["spec"]["nodeName"] for p in running_pods(cluster, namespace, "waiting")]
                == ["gpu-b200-e2e"]
            ),
            timeout=90,
            context=operator.tail,
        )
        isvc = ready_service(cluster, namespace, "waiting", operator)
        profile = isvc["status"]["profile"]
        assert (profile["gpu"]["product"], profile["precision"]) == ("NVIDIA-B200", "fp8")
        wait_for(  # kopf posts events from its own queue, after the status patch: wait, not race
            "a ProfileSelected event naming the B200",
            lambda: (
                "NVIDIA-B200"
                in cluster.kubectl(
                    "get", "events", "-n", namespace, "--field-selector", "reason=ProfileSelected"
                ).stdout
            ),
            context=operator.tail,
        )

        # Cordon the L40S node: the running pod stays where it is (each move reloads the weights).
        cluster.kubectl("cordon", "gpu-l40s-0")
        try:

            def kept() -> dict | None:
                i = get(cluster, namespace, "inferenceservice", "steady")
                conds = {c["type"]: c for c in ((i or {}).get("status") or {}).get("conditions") or ()}
                return conds if conds.get("ProfileSelected", {}).get("reason") == "KeptRunning" else None

            conds = wait_for("ProfileSelected KeptRunning", kept, timeout=30, context=operator.tail)
            assert "NVIDIA-B200" in conds["ProfileSelected"]["message"]  # where a fresh choice would go
            assert conds["Degraded"]["status"] == "False" and conds["Ready"]["status"] == "True"
            time.sleep(2 * RESYNC_SECONDS)
            assert [p["metadata"]["name"] for p in running_pods(cluster, namespace, "steady")] == [steady_pod]
            dep = get(cluster, namespace, "deployment", "steady")
            assert dep["metadata"]["annotations"]["serving.pagoda.dev/profile"] == "NVIDIA-L40S/fp8/tp1"
        finally:
            cluster.kubectl("uncordon", "gpu-l40s-0")
        # Uncordoned: still nothing moves, and the status goes back to Selected.
        isvc = wait_for(
            "ProfileSelected Selected again",
            lambda: (
                (i := get(cluster, namespace, "inferenceservice", "steady"))
                and {c["type"]: c["reason"] for c in i["status"]["conditions"]}["ProfileSelected"]
                == "Selected"
                and i
            ),
            timeout=30,
            context=operator.tail,
        )
        assert "kept: the current profile still fits" in isvc["status"]["profile"]["reason"]
        assert [p["metadata"]["name"] for p in running_pods(cluster, namespace, "steady")] == [steady_pod]
    finally:
        cluster.kubectl(
            "delete", "pis", "--all", "-n", namespace, "--wait=true", "--timeout=60s", check=False
        )
        cluster.kubectl("delete", "node", "gpu-b200-e2e", "--wait=false", check=False)


def test_operator_log_has_no_permission_errors(operator) -> None:
    """RBAC denials read `... is forbidden: User "system:serviceaccount:..." cannot <verb> ...`."""
    text = operator.log.read_text(errors="replace")
    assert "forbidden: User" not in text, operator.tail(80)
    assert operator.proc.poll() is None, operator.tail(80)
