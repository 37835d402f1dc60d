"""`pagoda serve --api-server-count 2`: two API processes on the same ports in front of one engine core.
Real servers, each in a process group of its own: requests over HTTP and gRPC from both processes,
one /metrics for the whole server, the same greedy outputs as one process, and the processes living
and dying together."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import grpc
import httpx
import openai
import pytest
from process_group import children, cmdline, group_members, status, wait_for
from prometheus_client.parser import text_string_to_metric_families

from pagoda.service.grpc_gen import inference_pb2 as pb
from pagoda.service.grpc_gen import inference_pb2_grpc as pb_grpc
from pagoda.service.serve_process import ServeProcess
from pagoda.service.server import API_SERVER_HEADER

PROMPTS = [f"Story number {i} begins" for i in range(24)]
MAX_TOKENS = 8


def start(llama_ckpt: Path, log_path: Path, count: int, *extra: str) -> ServeProcess:
    args = ["--model", str(llama_ckpt), "--device", "cpu", "--kv-cache-memory-bytes", str(8 << 20)]
    args += ["--max-model-len", "128", "--api-server-count", str(count), *extra]
    return ServeProcess(args, log_path=log_path, new_session=True).start()


@pytest.fixture
def launch(llama_ckpt: Path, tmp_path: Path) -> Iterator[Callable[..., ServeProcess]]:
    """`launch(count, *extra)` starts a test's own server. Afterwards its process group is killed if a
    failed assertion left any of it running: it would outlive pytest (found orphaned after a CI run)."""
    servers: list[ServeProcess] = []

    def launch_one(count: int, *extra: str) -> ServeProcess:
        servers.append(start(llama_ckpt, tmp_path / f"serve-{len(servers)}.log", count, *extra))
        return servers[-1]

    yield launch_one
    for server in servers:
        if server.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()


@pytest.fixture(scope="module")
def server(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """Two API processes, shared: the requests' test uses it, then the Ctrl-C drain ends it (one start
    fewer: ~12 s). Whichever runs alone, or fails first, the teardown leaves nothing."""
    proc = start(llama_ckpt, tmp_path_factory.mktemp("serve") / "serve.log", 2)
    assert proc.proc is not None
    pgid = proc.proc.pid
    try:
        yield proc
        assert proc.stop() == 0, proc.log()[-3000:]  # exited 0 already after the drain, else SIGTERM
        assert wait_for(lambda: not group_members(pgid), 10), group_members(pgid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        proc.proc.wait()


def http_completion(base_url: str, prompt: str) -> tuple[str, str]:
    """(text, the answering API process) of one streamed greedy completion, on a connection of its own."""
    served_by: list[str] = []
    hooks = {"response": [lambda response: served_by.append(response.headers[API_SERVER_HEADER])]}
    with httpx.Client(event_hooks=hooks) as http:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", http_client=http)
        stream = client.completions.create(
            model="", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    return text, served_by[0]


def grpc_completion(target: str, prompt: str, request_id: str) -> str:
    with grpc.insecure_channel(target) as channel:
        sampling = pb.SamplingParameters(temperature=0.0, max_new_tokens=MAX_TOKENS, ignore_eos=True)
        request = pb.GenerateRequest(request_id=request_id, text=prompt, sampling=sampling)
        responses = list(pb_grpc.InferenceStub(channel).Generate(request, timeout=120))
    assert all(r.request_id == request_id for r in responses)
    assert responses[-1].usage.completion_tokens == MAX_TOKENS
    return "".join(r.text for r in responses)


def finished_total(metrics: str) -> float:
    return sum(
        float(v) for v in re.findall(r"^pagoda_requests_finished_total\{[^}]*\} (\S+)$", metrics, re.M)
    )


def run_all(server: ServeProcess) -> tuple[list[str], list[str], list[str]]:
    """Every prompt over HTTP and over gRPC at once: (HTTP texts, their API processes, gRPC texts)."""
    with ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
        http = [pool.submit(http_completion, server.base_url, p) for p in PROMPTS]
        # The same client-chosen id on every process at once: each process's ids are its own.
        grpc_ids = [f"same-{i % 2}" if i < 2 else f"grpc-{i}" for i in range(len(PROMPTS))]
        rpc = [
            pool.submit(grpc_completion, server.grpc_target, prompt, request_id)
            for prompt, request_id in zip(PROMPTS, grpc_ids, strict=True)
        ]
        http_results = [f.result() for f in http]
        return [t for t, _ in http_results], [s for _, s in http_results], [f.result() for f in rpc]


def test_both_processes_serve_http_and_grpc_and_metrics_count_each_request_once(
    server: ServeProcess, llama_ckpt: Path, tmp_path: Path
) -> None:
    before = finished_total(httpx.get(f"{server.base_url}/metrics").text)
    http_texts, served_by, grpc_texts = run_all(server)
    assert set(served_by) == {"0", "1"}, "both processes accept from the shared listening socket"
    assert http_texts == grpc_texts
    assert all(http_texts)

    # Whichever process answers a scrape, it reports the whole server.
    for _ in range(6):
        with httpx.Client() as http:
            response = http.get(f"{server.base_url}/metrics")
        assert finished_total(response.text) - before == 2 * len(PROMPTS)
        assert re.search(r"^pagoda_requests_running 0", response.text, re.M)

    single = start(llama_ckpt, tmp_path / "single.log", 1)
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            single_texts = [t for t, _ in pool.map(lambda p: _plain_completion(single, p), PROMPTS)]
    finally:
        assert single.stop() == 0
    assert http_texts == single_texts


def _plain_completion(server: ServeProcess, prompt: str) -> tuple[str, None]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert API_SERVER_HEADER not in response.headers  # one process: exactly the old responses
    return response.json()["choices"][0]["text"], None


# Process 0 alone: tests/test_serve_shutdown.py; SIGTERM to the whole group (a worker too):
# tests/test_serve_processes.py. Here Ctrl-C to the group, and one child alone: every process drains,
# none is taken down by the signal (pagoda.service.stop_relay).
@pytest.mark.parametrize("stop", ["Ctrl-C to the process group", "SIGTERM to the core"])
def test_a_stop_signal_drains_every_process_and_exits_0(
    launch: Callable[..., ServeProcess], request: pytest.FixtureRequest, stop: str
) -> None:
    """Ctrl-C ends the module's server, after the requests' test (file order); SIGTERM to the core its own."""
    server: ServeProcess = request.getfixturevalue("server") if stop.startswith("Ctrl-C") else launch(2)
    assert server.proc is not None
    pgid = server.proc.pid
    started = threading.Barrier(9)
    results: list[tuple[str, int]] = []

    def stream() -> None:
        body = {"prompt": "Hi", "max_tokens": 48, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", f"{server.base_url}/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            started.wait()
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            usage = json.loads(events[-2])["usage"]
            results.append((r.headers[API_SERVER_HEADER], usage["completion_tokens"]))

    threads = [threading.Thread(target=stream) for _ in range(8)]
    for thread in threads:
        thread.start()
    started.wait()
    if stop == "SIGTERM to the core":
        (core,) = [p for p in children(pgid) if "pagoda.service.engine.core_process" in cmdline(p)]
        os.kill(core, signal.SIGTERM)
    else:
        os.killpg(pgid, signal.SIGINT)
    for thread in threads:
        thread.join(120)
    assert server.wait() == 0, server.log()[-3000:]
    assert len(results) == 8 and all(n == 48 for _, n in results), results  # every stream ran to its end
    assert wait_for(lambda: not group_members(pgid), 10), group_members(pgid)


@pytest.mark.parametrize("victim", ["api server 1", "core"])
def test_sigkill_of_an_api_server_process_or_the_core_fails_health(
    launch: Callable[..., ServeProcess], victim: str
) -> None:
    """Process 0 kills the API processes left, so only it answers: 503 to both probes, and SIGTERM
    still leaves nothing.

    API server 1's death also resets no waiting connection. Connections wait in one accept queue that
    every API process shares: while processes 1 and 2 are stopped, process 0 takes them all, and
    killing process 1 resets none. (With SO_REUSEPORT each process had a queue of its own, and the
    connections hashed to process 1's were reset when it died.) Process 2 stays stopped until process 0
    kills it: SIGKILL reaches a stopped process, and it holds no connection to reset."""
    server = launch(3)
    assert server.proc is not None
    pgid = server.proc.pid
    others = [p for p in children(pgid) if "pagoda.service.api_server_process" in cmdline(p)]
    assert len(others) == 2, [cmdline(p) for p in children(pgid)]
    core = [p for p in children(pgid) if "pagoda.service.engine.core_process" in cmdline(p)]
    live, ready = f"{server.base_url}/v1/health/live", f"{server.base_url}/v1/health/ready"
    if victim == "core":
        os.kill(core[0], signal.SIGKILL)
    else:
        for pid in others:
            os.kill(pid, signal.SIGSTOP)
        with ThreadPoolExecutor(24) as pool:
            probes = [pool.submit(status, live) for _ in range(24)]
            # Not a timing assertion: this only lets the probes connect before process 1 goes.
            wait_for(lambda: all(p.done() for p in probes), 3)
            os.kill(others[0], signal.SIGKILL)
            answers = [p.result() for p in probes]
        assert all(code in (200, 503) for code in answers), answers  # None: the connection was reset
    assert wait_for(lambda: not set(others) & set(group_members(pgid)), 30), server.log()[-3000:]
    statuses = [(status(live), status(ready)) for _ in range(6)]
    assert statuses == [(503, 503)] * 6, (statuses, server.log()[-3000:])
    assert server.stop() == 1, server.log()[-3000:]  # the engine or a process failed: not a clean exit
    assert wait_for(lambda: not group_members(pgid), 10), group_members(pgid)


def test_sigkill_of_process_0_takes_every_process_with_it(launch: Callable[..., ServeProcess]) -> None:
    """API process 1, the core and (TP 2) its worker all go; tests/test_serve_processes.py had the same
    case at TP 2 with one API process, which this layout covers too."""
    server = launch(2, "--api-key", "secret-key", "--tensor-parallel-size", "2")
    assert server.proc is not None
    pgid = server.proc.pid
    lines = [cmdline(p) for p in children(pgid)]
    assert sum("pagoda.service.api_server_process" in c for c in lines) == 1, lines
    assert sum("pagoda.service.engine.core_process" in c for c in lines) == 1, lines
    assert sum("spawn_main" in c for c in lines) == 1, lines  # the tensor-parallel worker
    assert not any("secret-key" in c for c in lines)  # its config goes on stdin
    # While it is up, its key guard as Anthropic's client meets it: `api_key` travels as x-api-key.
    client = anthropic.Anthropic(base_url=server.base_url, api_key="secret-key", max_retries=0, timeout=60)
    reply = client.messages.create(
        model="llama",
        max_tokens=2,
        messages=[{"role": "user", "content": "Hi"}],
        extra_body={"temperature": 0},
    )
    assert reply.usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError, match="x-api-key: <key>") as refused:
        client.with_options(api_key="secret").messages.count_tokens(
            model="llama", messages=[{"role": "user", "content": "Hi"}]
        )
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # The per-route HTTP series, summed over both processes, count the key guard's refusal too.
    counts = {
        (s.labels["handler"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text)
        for s in family.samples
        if s.name == "http_requests_total"
    }
    assert counts == {("/v1/messages", "2xx"): 1, ("/v1/messages/count_tokens", "4xx"): 1}, counts
    server.kill()
    assert wait_for(lambda: not group_members(pgid), 10), group_members(pgid)
