"""The gRPC API of a real `pagoda serve` process: pagoda.v1.Inference (stubs from proto/),
grpc.health.v1 and server reflection."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagoda.service.grpc_gen import inference_pb2 as pb
from pagoda.service.grpc_gen import inference_pb2_grpc as pb_grpc
from pagoda.service.serve_process import ServeProcess

MODEL = "tiny-grpc"


@pytest.fixture(scope="module")
def server(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    args = ["--model", str(llama_ckpt), "--served-model-name", MODEL, "--max-model-len", "128"]
    args += ["--kv-cache-memory-bytes", str(8 << 20)]
    with ServeProcess(args, log_path=tmp_path_factory.mktemp("serve") / "serve.log") as proc:
        yield proc
    assert proc.proc is not None and proc.proc.returncode == 0, proc.log()[-3000:]


@pytest.fixture(scope="module")
def channel(server: ServeProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield ch


def test_health_is_serving_after_load(channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pagoda.v1.Inference"):
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(channel: grpc.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"pagoda.v1.Inference", "grpc.health.v1.Health"} <= names


def test_model_info_and_readiness(channel: grpc.Channel) -> None:
    stub = pb_grpc.InferenceStub(channel)
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.model_name == MODEL and info.max_context_length_tokens == 128
    assert info.kv_block_size_tokens == 16 and info.num_kv_blocks > 0 and list(info.eos_token_ids)
    ready = stub.GetReadiness(pb.GetReadinessRequest(), timeout=10)
    assert ready.ready and ready.state == pb.SERVING_STATE_READY


def test_generate_streams_the_same_text_as_http(server: ServeProcess, channel: grpc.Channel) -> None:
    stub = pb_grpc.InferenceStub(channel)
    request = pb.GenerateRequest(
        request_id="grpc-1",
        text="Once upon a time",
        sampling=pb.SamplingParameters(temperature=0.0, max_new_tokens=10, ignore_eos=True, top_logprobs=2),
    )
    responses = list(stub.Generate(request, timeout=60))
    assert len(responses) >= 3  # streamed, not one blob
    assert all(r.request_id == "grpc-1" for r in responses)
    *steps, last = responses
    assert last.usage.completion_tokens == 10 and last.usage.prompt_tokens > 0
    assert last.time_to_first_token_seconds > 0
    assert [r.finish_reason for r in steps if r.finish_reason] == [pb.FINISH_REASON_LENGTH]
    assert sum(len(r.token_ids) for r in steps) == 10
    assert sum(len(r.logprobs) for r in steps) == 10
    assert all(len(lp.top_logprobs) == 2 for r in steps for lp in r.logprobs)

    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    http = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).json()
    assert "".join(r.text for r in steps) == http["choices"][0]["text"]


def test_generate_chat_and_token_ids_with_n2(channel: grpc.Channel) -> None:
    stub = pb_grpc.InferenceStub(channel)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")])
    sampling = pb.SamplingParameters(n=2, seed=7, max_new_tokens=4, ignore_eos=True)
    responses = list(stub.Generate(pb.GenerateRequest(chat=chat, sampling=sampling), timeout=60))
    assert {r.index for r in responses if r.finish_reason} == {0, 1}
    assert responses[-1].usage.completion_tokens == 8

    ids = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 520, 1741]), sampling=pb.SamplingParameters(max_new_tokens=2)
    )
    assert list(stub.Generate(ids, timeout=60))[-1].usage.prompt_tokens == 3


def test_allowed_token_ids_truncation_and_the_stop_string_kept(channel: grpc.Channel) -> None:
    """vLLM's extras as HTTP has them: a sampled completion keeps to its allowed token ids; a prompt
    longer than the context runs on its last tokens; include_stop_str_in_output ends the text after
    the stop string."""
    stub = pb_grpc.InferenceStub(channel)

    def generate(prompt: list[int], **sampling: object) -> list[pb.GenerateResponse]:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParameters(**sampling)
        )
        return list(stub.Generate(request, timeout=60))

    allowed = [300, 301, 302]
    steps = generate(
        [7, 8, 9], temperature=1.5, seed=3, max_new_tokens=8, ignore_eos=True, allowed_token_ids=allowed
    )
    assert sorted({t for r in steps for t in r.token_ids} | set(allowed)) == allowed
    assert sum(len(r.token_ids) for r in steps) == 8
    assert generate([5] * 300, max_new_tokens=2, truncate_prompt_tokens=11)[-1].usage.prompt_tokens == 11
    free = "".join(r.text for r in generate([7, 8, 9], temperature=0.0, max_new_tokens=12, ignore_eos=True))
    stop = free[4:6]
    for included in (False, True):
        text = "".join(
            r.text
            for r in generate([7, 8, 9], temperature=0.0, max_new_tokens=12, stop=[stop],
                              include_stop_str_in_output=included)
        )  # fmt: skip
        assert text == free[: free.index(stop) + (len(stop) if included else 0)]


def test_a_reused_request_id_is_refused_and_the_first_goes_on(channel: grpc.Channel) -> None:
    stub = pb_grpc.InferenceStub(channel)
    sampling = pb.SamplingParameters(max_new_tokens=40, ignore_eos=True)
    request = pb.GenerateRequest(request_id="same", text="Hi", sampling=sampling)
    first = stub.Generate(request, timeout=60)
    next(first)  # the first is running
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(request, timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already in use" in (refused.value.details() or "")
    rest = list(first)
    assert rest[-1].usage.completion_tokens == 40


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (pb.GenerateRequest(model="other", text="x"), grpc.StatusCode.NOT_FOUND),
        (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
        (
            pb.GenerateRequest(text="x", sampling=pb.SamplingParameters(temperature=-1.0)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 200)), grpc.StatusCode.INVALID_ARGUMENT),
        # vLLM's extras, hostile: an id past the vocabulary, a truncation of none or past the context.
        (
            pb.GenerateRequest(text="x", sampling=pb.SamplingParameters(allowed_token_ids=[3, 2**31])),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            pb.GenerateRequest(text="x", sampling=pb.SamplingParameters(truncate_prompt_tokens=0)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            pb.GenerateRequest(text="x", sampling=pb.SamplingParameters(truncate_prompt_tokens=-7)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            pb.GenerateRequest(text="x", sampling=pb.SamplingParameters(truncate_prompt_tokens=129)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ],
)
def test_errors_map_to_status_codes(
    channel: grpc.Channel, request_: pb.GenerateRequest, code: grpc.StatusCode
) -> None:
    stub = pb_grpc.InferenceStub(channel)
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(request_, timeout=30))
    assert error.value.code() == code, error.value.details()
    # The server keeps serving.
    ok = pb.GenerateRequest(text="fine", sampling=pb.SamplingParameters(max_new_tokens=1))
    assert list(stub.Generate(ok, timeout=30))[-1].usage.completion_tokens == 1


def test_cancelled_call_aborts_the_request(server: ServeProcess, channel: grpc.Channel) -> None:
    def count(metrics_text: str) -> float:
        return float(
            metrics_text.split('pagoda_requests_finished_total{finish_reason="abort"} ', 1)[1].split()[0]
        )

    before = count(httpx.get(f"{server.base_url}/metrics").text)
    stub = pb_grpc.InferenceStub(channel)
    sampling = pb.SamplingParameters(max_new_tokens=120, ignore_eos=True)
    call = stub.Generate(pb.GenerateRequest(text="Go on", sampling=sampling), timeout=60)
    next(call)
    call.cancel()
    metrics = ""
    for _ in range(200):  # the running gauge is the core's, as of its next message after the abort
        metrics = httpx.get(f"{server.base_url}/metrics").text
        if count(metrics) > before and "pagoda_requests_running 0.0" in metrics:
            break
        time.sleep(0.05)
    assert count(metrics) == before + 1
    assert "pagoda_requests_running 0.0" in metrics
