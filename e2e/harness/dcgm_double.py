"""A test double of NVIDIA's dcgm-exporter: serves dcgm-exporter's /metrics output for the real node's
four (fake) GPUs, each labelled with the pod that holds it, as dcgm-exporter's Kubernetes mapping labels
it (`namespace`, `pod`, `container` of the GPU's pod). Prometheus scrapes it as kube-prometheus-stack
scrapes the real exporter, with the exporter pod's own `namespace`/`pod` as target labels, so the GPU's
labels arrive renamed `exported_namespace`/`exported_pod`: what the chart's recording rule maps back.

Only the GPU's engine activity (DCGM_FI_PROF_GR_ENGINE_ACTIVE) is set by the test; the other series
keep the sample's values. There is no GPU: nothing here measures anything.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
# dcgm-exporter 3.3's output for four A10 GPUs of one host, default counters (a subset), before the
# Kubernetes mapping adds the pod labels.
SAMPLE = """\
# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-5a3b7c1e-90d2-4f1a-8e6b-2c4d6f8a0b1c",pci_bus_id="00000000:00:1E.0",device="nvidia0",modelName="NVIDIA A10",Hostname="pagoda-real-0",DCGM_FI_DRIVER_VERSION="535.183.01"} 0
DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-7e1f2a3b-4c5d-46e7-98f9-0a1b2c3d4e5f",pci_bus_id="00000000:00:1F.0",device="nvidia1",modelName="NVIDIA A10",Hostname="pagoda-real-0",DCGM_FI_DRIVER_VERSION="535.183.01"} 0
DCGM_FI_DEV_GPU_UTIL{gpu="2",UUID="GPU-1c2d3e4f-5a6b-47c8-89d0-e1f2a3b4c5d6",pci_bus_id="00000000:00:20.0",device="nvidia2",modelName="NVIDIA A10",Hostname="pagoda-real-0",DCGM_FI_DRIVER_VERSION="535.183.01"} 0
DCGM_FI_DEV_GPU_UTIL{gpu="3",UUID="GPU-9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d",pci_bus_id="00000000:00:21.0",device="nvidia3",modelName="NVIDIA A10",Hostname="pagoda-real-0",DCGM_FI_DRIVER_VERSION="535.183.01"} 0
# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-5a3b7c1e-90d2-4f1a-8e6b-2c4d6f8a0b1c",pci_bus_id="00000000:00:1E.0",device="nvidia0",modelName="NVIDIA A10",Hostname="pagoda-real-0",DCGM_FI_DRIVER_VERSION="535.183.01"} 20571
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-7e1f2a3b-4c5d-46e7-98f9-0a1b2c3d4e5f",pci_bus_id="00000000:00:1F.0",device="nvidia1",modelName="NVIDIA A10",Hostname="pagoda-real-0",DCGM_FI_DRIVER_VERSION="535.183.01"} 0
DCGM_FI_DEV_FB_USED{gpu="2",UUID="GPU-1c2d3e4f-5a6b-47c8-89d0-e1f2a3b4c5d6",pci_bus_id="00000000:00:20.0",device="nvidia2",modelName="NVIDIA A10",Hostname="pagoda-real-0",DCGM_FI_DRIVER_VERSION="535.183.01"} 0
DCGM_FI_DEV_FB_USED{gpu="3",UUID="GPU-9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d",pci_bus_id="00000000:00:21.0",device="nvidia3",modelName="NVIDIA A10",Hostname="pagoda-real-0",DCGM_FI_DRIVER_VERSION="535.183.01"} 0
# HELP DCGM_FI_PROF_GR_ENGINE_ACTIVE Ratio of time the graphics engine is active.
# TYPE DCGM_FI_PROF_GR_ENGINE_ACTIVE gauge
DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-5a3b7c1e-90d2-4f1a-8e6b-2c4d6f8a0b1c",pci_bus_id="00000000:00:1E.0",device="nvidia0",modelName="NVIDIA A10",Hostname="pagoda-real-0",DCGM_FI_DRIVER_VERSION="535.183.01"} 0.000000
DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="1",UUID="GPU-7e1f2a3b-4c5d-46e7-98f9-0a1b2c3d4e5f",pci_bus_id="00000000:00:1F.0",device="nvidia1",modelName="NVIDIA A10",Hostname="pagoda-real-0",DCGM_FI_DRIVER_VERSION="535.183.01"} 0.000000
DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="2",UUID="GPU-1c2d3e4f-5a6b-47c8-89d0-e1f2a3b4c5d6",pci_bus_id="00000000:00:20.0",device="nvidia2",modelName="NVIDIA A10",Hostname="pagoda-real-0",DCGM_FI_DRIVER_VERSION="535.183.01"} 0.000000
DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="3",UUID="GPU-9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d",pci_bus_id="00000000:00:21.0",device="nvidia3",modelName="NVIDIA A10",Hostname="pagoda-real-0",DCGM_FI_DRIVER_VERSION="535.183.01"} 0.000000
"""  # noqa: E501 - the exporter writes each series on one line


@dataclass(frozen=True)
class GpuHolder:
    """The pod holding one GPU, and the engine activity (0-1) the double reports for that GPU."""

    namespace: str
    pod: str
    container: str
    engine_active: float


class _Collector:
    def __init__(self) -> None:
        self.holders: dict[str, GpuHolder] = {}  # gpu index -> holder
        self.lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            holders = dict(self.holders)
        for family in text_string_to_metric_families(SAMPLE):
            out = GaugeMetricFamily(
                family.name,
                family.documentation,
                labels=[*family.samples[0].labels, "container", "namespace", "pod"],
            )
            for sample in family.samples:
                holder = holders.get(sample.labels["gpu"])
                value = sample.value
                if holder is not None and family.name == ENGINE_ACTIVE:
                    value = holder.engine_active
                pod_labels = [holder.container, holder.namespace, holder.pod] if holder else ["", "", ""]
                out.add_metric([*sample.labels.values(), *pod_labels], value)
            yield out


class DcgmExporterDouble:
    """Serves the sample on 127.0.0.1 (`address`); `hold(gpu, holder)` sets a GPU's pod and activity."""

    def __init__(self) -> None:
        self._collector = _Collector()
        registry = CollectorRegistry()
        registry.register(self._collector)
        self._server, self._thread = start_http_server(0, addr="127.0.0.1", registry=registry)
        self.address = f"127.0.0.1:{self._server.server_port}"

    def hold(self, gpu: str, holder: GpuHolder | None) -> None:
        with self._collector.lock:
            if holder is None:
                self._collector.holders.pop(gpu, None)
            else:
                self._collector.holders[gpu] = holder

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# ---------------------------------------------------------------------------------------------------
# Standalone (`make demo-cluster`): the double as a process of its own that maps the GPUs itself.

DEMO_ACTIVITY = 0.3  # what the double says a server pod's GPU is doing: a fixed value, nothing measured


def _gpu_of(kubectl: list[str], namespace: str, pod: str) -> str | None:
    """The fake GPU the device plugin gave the pod (its Allocate sets PAGODA_FAKE_GPU_IDS)."""
    import re
    import subprocess

    env = subprocess.run(
        [*kubectl, "exec", "-n", namespace, pod, "--", "env"], capture_output=True, text=True
    )
    found = re.search(r"^PAGODA_FAKE_GPU_IDS=fake-gpu-(\d+)$", env.stdout, re.MULTILINE)
    return found.group(1) if found else None


def follow_pods(double: DcgmExporterDouble, kubectl: list[str], every: float = 5.0) -> None:
    """Forever: every running server pod holds its GPU at DEMO_ACTIVITY; a pod gone frees it."""
    import json
    import subprocess
    import time

    held: dict[tuple[str, str], str] = {}  # (namespace, pod) -> gpu
    while True:
        out = subprocess.run(
            [
                *kubectl,
                "get",
                "pods",
                "-A",
                "-l",
                "app.kubernetes.io/component=inference-server",
                "-o",
                "json",
            ],
            capture_output=True,
            text=True,
        )
        pods = json.loads(out.stdout)["items"] if out.returncode == 0 else []
        running = {
            (p["metadata"]["namespace"], p["metadata"]["name"])
            for p in pods
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        }
        for key in running - held.keys():
            if (gpu := _gpu_of(kubectl, *key)) is not None:
                held[key] = gpu
                double.hold(gpu, GpuHolder(key[0], key[1], "server", DEMO_ACTIVITY))
        for key in held.keys() - running:
            double.hold(held.pop(key), None)
        time.sleep(every)


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(description="the DCGM exporter double, following the cluster's server pods")
    ap.add_argument("--kubectl", required=True, help="the kubectl binary")
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--address-file", type=Path, required=True, help="where to write host:port once serving")
    args = ap.parse_args(argv)
    double = DcgmExporterDouble()
    args.address_file.write_text(double.address)
    follow_pods(double, [args.kubectl, "--kubeconfig", args.kubeconfig])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
