"""The real node: this machine registered beside the kwok nodes, running pods in containers."""

from __future__ import annotations

import ipaddress
import json
import time

REAL_POD = """
apiVersion: v1
kind: Pod
metadata: {{name: {name}}}
spec:
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  tolerations: [{{key: pagoda.dev/real-node, operator: Exists, effect: NoSchedule}}]
  containers:
  - name: pause
    image: registry.k8s.io/pause:3.10
    imagePullPolicy: Never
"""


def _wait_pod(cluster, namespace: str, name: str, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pod = json.loads(cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout)
        conditions = pod["status"].get("conditions", [])
        if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
            return pod
        time.sleep(0.5)
    raise AssertionError(cluster.kubectl("describe", "pod", name, "-n", namespace).stdout)


def test_node_is_real_and_has_its_own_address(cluster, real_node) -> None:
    node = json.loads(cluster.kubectl("get", "node", real_node.name, "-o", "json").stdout)
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.36.3"
    assert info["containerRuntimeVersion"].startswith("containerd://")
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    ip = ipaddress.ip_address(addresses["InternalIP"])
    assert not ip.is_loopback and str(ip) == real_node.ip
    # Only pods that ask for the real node land there: the kwok tests' pods never pull images.
    assert {"key": "pagoda.dev/real-node", "value": "true", "effect": "NoSchedule"} in node["spec"]["taints"]


def test_pod_runs_in_a_container_with_a_pod_ip(cluster, real_node, namespace) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=REAL_POD.format(name="p", node=real_node.name))
    pod = _wait_pod(cluster, namespace, "p")
    assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network("10.244.0.0/24")
    assert pod["status"]["containerStatuses"][0]["containerID"].startswith("containerd://")
    # kube-apiserver reaches the kubelet at the node's address (logs; pause writes none).
    assert cluster.kubectl("logs", "p", "-n", namespace).returncode == 0
    containers = real_node.ctr("containers", "list", "--quiet").stdout.split()
    assert pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://") in containers
