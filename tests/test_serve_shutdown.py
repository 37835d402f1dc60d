"""A real `pagoda serve` under pressure: SIGTERM drains in-flight streams (readiness and gRPC health
flip first, new requests get 503/UNAVAILABLE, exit 0), and the waiting-queue limit answers 503 +
Retry-After, then recovers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.service.grpc_gen import inference_pb2 as pb
from pagoda.service.grpc_gen import inference_pb2_grpc as pb_grpc
from pagoda.service.serve_process import ServeProcess

NUM_STREAMS = 8
MAX_TOKENS = 96


def _server(llama_ckpt: Path, tmp_path: Path, *flags: str) -> ServeProcess:
    args = ["--model", str(llama_ckpt), "--max-model-len", "512", "--kv-cache-memory-bytes", str(16 << 20)]
    return ServeProcess([*args, *flags], log_path=tmp_path / "serve.log")


async def _stream(http: httpx.AsyncClient, i: int, started: asyncio.Event) -> dict[str, Any]:
    body = {
        "prompt": f"Story number {i}:",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result: dict[str, Any] = {"text": "", "finish_reason": None, "usage": None, "done": False}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            chunk = json.loads(line[6:])
            started.set()
            for choice in chunk["choices"]:
                result["text"] += choice["text"]
                result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]
            result["usage"] = chunk["usage"] or result["usage"]
    return result


def _grpc_while_draining(target: str) -> tuple[int, grpc.StatusCode | None]:
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
        request = pb.GenerateRequest(text="late", sampling=pb.SamplingParameters(max_new_tokens=2))
        try:
            list(pb_grpc.InferenceStub(channel).Generate(request, timeout=10))
            code = None
        except grpc.RpcError as exc:
            code = exc.code()
    return health.status, code


@pytest.fixture(scope="module")
def limited_server(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """One running request and two waiting at most, and a drain only a second signal cuts short (300 s):
    the queue-limit test uses it, then the second-SIGTERM test ends it (one server start fewer)."""
    flags = ["--max-num-seqs", "1", "--max-waiting-requests", "2", "--max-model-len", "2048"]
    server = _server(llama_ckpt, tmp_path_factory.mktemp("serve"), *flags, "--drain-timeout", "300").start()
    try:
        yield server
        assert server.stop() == 0, server.log()[-3000:]  # exited 0 already after the second SIGTERM
    finally:
        server.kill()


def test_sigterm_drains_in_flight_streams_and_exits_0(llama_ckpt: Path, tmp_path: Path) -> None:
    server = _server(llama_ckpt, tmp_path, "--drain-timeout", "120").start()

    async def main() -> tuple[list[dict[str, Any]], int, int, int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            started = [asyncio.Event() for _ in range(NUM_STREAMS)]
            tasks = [asyncio.create_task(_stream(http, i, started[i])) for i in range(NUM_STREAMS)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            server.terminate()
            async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as probe:
                for _ in range(200):
                    ready = (await probe.get("/v1/health/ready")).status_code
                    if ready == 503:
                        break
                    await asyncio.sleep(0.01)
                num_unfinished = sum(not t.done() for t in tasks)
                late = await probe.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
                grpc_health, grpc_code = await asyncio.to_thread(_grpc_while_draining, server.grpc_target)
            assert grpc_health == health_pb2.HealthCheckResponse.NOT_SERVING
            assert grpc_code == grpc.StatusCode.UNAVAILABLE
            return await asyncio.gather(*tasks), ready, num_unfinished, late.status_code

    try:
        results, ready, num_unfinished, late_status = asyncio.run(main())
        assert ready == 503, "readiness must flip as soon as SIGTERM arrives"
        assert num_unfinished > 0, "readiness flipped only after the streams ended"
        assert late_status == 503, "a draining server takes no new requests"
        for result in results:
            assert result["done"] and result["finish_reason"] == "length"
            assert result["usage"]["completion_tokens"] == MAX_TOKENS
        assert server.wait(60) == 0
    finally:
        server.kill()
    log = server.log()
    assert "drain complete" in log


def test_queue_limit_answers_503_with_retry_after_and_recovers(limited_server: ServeProcess) -> None:
    server = limited_server

    async def burst(base_url: str) -> list[httpx.Response]:
        body = {"prompt": "Queue me", "max_tokens": 80, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(10)))

    responses = asyncio.run(burst(server.base_url))
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 503}, statuses
    for response in responses:
        if response.status_code == 503:
            assert int(response.headers["Retry-After"]) >= 1
            error = response.json()["error"]
            assert error["code"] == "queue_full" and "limit 2" in error["message"]
        else:
            assert response.json()["usage"]["completion_tokens"] == 80
    # Recovered: the queue drained, new requests are served.
    again = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert again.status_code == 200
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert f'pagoda_request_errors_total{{error="queue_full"}} {float(statuses.count(503))}' in metrics

    # The same limit over gRPC answers RESOURCE_EXHAUSTED.
    async def grpc_burst() -> list[grpc.StatusCode]:
        sampling = pb.SamplingParameters(max_new_tokens=80, ignore_eos=True)
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            stub = pb_grpc.InferenceStub(channel)

            async def one() -> grpc.StatusCode:
                try:
                    async for _ in stub.Generate(pb.GenerateRequest(text="Queue me", sampling=sampling)):
                        pass
                except grpc.aio.AioRpcError as error:
                    return error.code()
                return grpc.StatusCode.OK

            return await asyncio.gather(*(one() for _ in range(10)))

    codes = asyncio.run(grpc_burst())
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes


@pytest.mark.parametrize("flag", ["--precision=int8", "--tensor-parallel-size=0"])
def test_unrunnable_profile_exits_2_before_loading(llama_ckpt: Path, tmp_path: Path, flag: str) -> None:
    server = _server(llama_ckpt, tmp_path, flag)
    with pytest.raises(RuntimeError, match="exited with 2"):
        server.start(timeout_s=60)


def test_second_sigterm_aborts_the_drain(limited_server: ServeProcess) -> None:
    """A stream of 2000 tokens in flight (the only one the server runs at a time), SIGTERM: the drain
    waits for it, up to 300 s; a second SIGTERM aborts it, and the server exits 0 at once."""
    server, max_tokens = limited_server, 2000

    async def one(http: httpx.AsyncClient, started: asyncio.Event) -> int:
        body = {"prompt": "Go", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        num_chunks = 0
        try:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        num_chunks += 1
                        started.set()
        except httpx.HTTPError:
            pass  # cut off: the process is going away
        return num_chunks

    async def main() -> int:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            started = asyncio.Event()
            task = asyncio.create_task(one(http, started))
            await asyncio.wait_for(started.wait(), 60)
            server.terminate()
            while server.ready_status() == 200:
                await asyncio.sleep(0.01)
            server.terminate()
            return await task

    try:
        num_chunks = asyncio.run(main())
        assert server.wait(30) == 0
    finally:
        server.kill()
    assert num_chunks < max_tokens, num_chunks
    assert "second signal: aborting" in server.log()
