"""The managed model cache on the real control plane: the operator's PVC is bound by the real PV
controller, its download Job is run by the real Job controller (the pod simulated by kwok, which
completes Job pods), and status goes Caching -> Cached before the server pods mount the claim read-only.
"""

from __future__ import annotations

import json
from pathlib import Path

from by_path import load_by_path

base = load_by_path("pagoda_e2e_test_operator_base", Path(__file__).with_name("test_operator.py"))
operator = base.operator  # the module-scoped fixture: chart installed, `pagoda operator` running


def test_cache_goes_caching_then_cached_and_is_mounted_read_only(cluster, namespace, operator) -> None:
    storage_class = f"cache-{namespace}"  # a static PV of its own class: no provisioner in this cluster
    pv = f"cache-{namespace}"
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
        "spec": {"capacity": {"storage": "50Gi"}, "accessModes": ["ReadWriteMany"],
                 "storageClassName": storage_class, "hostPath": {"path": "/data/cache"},
                 "persistentVolumeReclaimPolicy": "Delete"},
    }))  # fmt: skip
    cluster.kubectl("create", "secret", "generic", "hf", "--from-literal=token=t", "-n", namespace)
    model = {
        "name": "llama-3.1-8b",
        "source": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct@main", "tokenSecret": {"name": "hf"}},
        "cache": {
            "size": "40Gi",
            "storageClassName": storage_class,
            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},  # the Job's own
        },
    }
    try:
        # Caching is seen first: the Job exists before any server pod.
        base.apply(cluster, namespace, base.small_service("cached", model=model))
        states = set()

        def cached() -> dict | None:
            isvc = base.get(cluster, namespace, "inferenceservice", "cached")
            state = (((isvc or {}).get("status") or {}).get("cache") or {}).get("state")
            if state:
                states.add(state)
                if state == "Caching":
                    # The status is written after the children are applied, so it can still say Caching
                    # while the Deployment exists. Read the Deployment first, then the Job: a Job's
                    # completion is final, so a Deployment seen before an incomplete Job came too early.
                    claim = isvc["status"]["cache"]["claimName"]
                    deployment = base.get(cluster, namespace, "deployment", "cached")
                    job = base.get(cluster, namespace, "job", claim)
                    is_complete = any(
                        c["type"] == "Complete" and c["status"] == "True"
                        for c in ((job or {}).get("status") or {}).get("conditions") or []
                    )
                    assert deployment is None or is_complete
            return isvc if state == "Cached" else None

        isvc = base.wait_for("status.cache.state Cached", cached, timeout=90, context=operator.tail)
        claim = isvc["status"]["cache"]["claimName"]
        job = base.get(cluster, namespace, "job", claim)
        assert job is not None and job["metadata"]["ownerReferences"][0]["name"] == "cached"
        download = job["spec"]["template"]["spec"]["containers"][0]
        assert download["resources"] == {"requests": {"cpu": "100m", "memory": "64Mi"}}
        assert any(c["type"] == "Complete" and c["status"] == "True" for c in job["status"]["conditions"])
        pvc = base.get(cluster, namespace, "pvc", claim)
        assert pvc["status"]["phase"] == "Bound" and pvc["spec"]["volumeName"] == pv
        events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "reason=Cached").stdout
        assert claim in events

        isvc = base.ready_service(cluster, namespace, "cached", operator)
        (pod,) = base.running_pods(cluster, namespace, "cached")
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
        mount = next(m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "model")
        assert mount["readOnly"] is True
        assert not pod["spec"].get("initContainers")
        # No server pod before the weights were there: the Deployment was created after the Job completed.
        deployment = base.get(cluster, namespace, "deployment", "cached")
        assert deployment["metadata"]["creationTimestamp"] >= job["status"]["completionTime"]
        assert "Cached" in states
    finally:
        cluster.kubectl(
            "delete", "pis", "--all", "-n", namespace, "--wait=true", "--timeout=60s", check=False
        )
        cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)
