"""A TEST DOUBLE of NVIDIA's device plugin: advertises `--count` fake `nvidia.com/gpu` devices to the
real node's kubelet through the real device plugin API (v1beta1, deviceplugin.proto), so pods asking for
GPUs are admitted and allocated by the kubelet's device manager and then run on the CPU.

Allocate hands each container only PAGODA_FAKE_GPU_IDS (the device ids): no device node, no driver.

    python fake_gpu_plugin.py --plugin-dir <kubelet root>/device-plugins --stubs DIR [--count N]
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from types import ModuleType

import grpc

HERE = Path(__file__).resolve().parent
RESOURCE = "nvidia.com/gpu"
SOCKET = "pagoda-fake-gpu.sock"


def load_stubs(out: Path) -> tuple[ModuleType, ModuleType]:
    """deviceplugin_pb2 and _pb2_grpc, generated into `out` by grpcio-tools on first use."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "deviceplugin_pb2_grpc.py").exists():
        from grpc_tools import protoc

        args = [
            "protoc",
            f"-I{HERE}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            "deviceplugin.proto",
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {HERE / 'deviceplugin.proto'}")
    sys.path.insert(0, str(out))
    return importlib.import_module("deviceplugin_pb2"), importlib.import_module("deviceplugin_pb2_grpc")


def serve(plugin_dir: Path, count: int, pb: ModuleType, rpc: ModuleType) -> grpc.Server:
    ids = [f"fake-gpu-{i}" for i in range(count)]
    stop = threading.Event()

    class Plugin(rpc.DevicePluginServicer):
        def GetDevicePluginOptions(self, request, context):  # the API names its methods
            return pb.DevicePluginOptions()

        def ListAndWatch(self, request, context):
            yield pb.ListAndWatchResponse(devices=[pb.Device(ID=i, health="Healthy") for i in ids])
            while not stop.wait(1) and context.is_active():
                pass

        def Allocate(self, request, context):
            responses = [
                pb.ContainerAllocateResponse(envs={"PAGODA_FAKE_GPU_IDS": ",".join(r.devices_ids)})
                for r in request.container_requests
            ]
            return pb.AllocateResponse(container_responses=responses)

        def GetPreferredAllocation(self, request, context):
            return pb.PreferredAllocationResponse()

        def PreStartContainer(self, request, context):
            return pb.PreStartContainerResponse()

    sock = plugin_dir / SOCKET
    sock.unlink(missing_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rpc.add_DevicePluginServicer_to_server(Plugin(), server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    with grpc.insecure_channel(f"unix://{plugin_dir / 'kubelet.sock'}") as channel:
        request = pb.RegisterRequest(version="v1beta1", endpoint=SOCKET, resource_name=RESOURCE)
        rpc.RegistrationStub(channel).Register(request, timeout=10)
    print(f"fake_gpu_plugin: {count} x {RESOURCE} registered with the kubelet", flush=True)
    return server


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plugin-dir", type=Path, required=True)
    ap.add_argument("--stubs", type=Path, required=True)
    ap.add_argument("--count", type=int, default=1)
    args = ap.parse_args()
    pb, rpc = load_stubs(args.stubs)
    deadline = time.monotonic() + 60
    while not (args.plugin_dir / "kubelet.sock").exists():  # the kubelet makes it at start-up
        if time.monotonic() > deadline:
            raise SystemExit(f"no kubelet.sock in {args.plugin_dir} after 60 s")
        time.sleep(0.2)
    server = serve(args.plugin_dir, args.count, pb, rpc)
    signal.signal(signal.SIGTERM, lambda *_: server.stop(0))
    server.wait_for_termination()
    return 0


if __name__ == "__main__":
    sys.exit(main())
