"""One place maps engine-side errors for both transports: a conversation the model's chat template
cannot render is a 400 over HTTP and INVALID_ARGUMENT over gRPC, with the same message."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from pagoda.service.grpc_gen import inference_pb2 as pb
from pagoda.service.grpc_gen import inference_pb2_grpc as pb_grpc
from pagoda.service.serve_process import ServeProcess


@pytest.fixture(scope="module")
def server(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A checkpoint whose tokenizer has no chat template at all."""
    folder = tmp_path_factory.mktemp("no-template") / "ckpt"
    shutil.copytree(llama_ckpt, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    args = ["--model", str(folder), "--kv-cache-memory-bytes", str(8 << 20)]
    with ServeProcess(args, log_path=folder.parent / "serve.log") as proc:
        yield proc


def test_chat_template_error_is_the_clients_fault_on_both_transports(server: ServeProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as http_error:
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert "chat template" in str(http_error.value)

    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")])
        with pytest.raises(grpc.RpcError) as grpc_error:
            list(stub.Generate(pb.GenerateRequest(chat=chat), timeout=30))
    assert grpc_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat template" in (grpc_error.value.details() or "")
    # The server is unharmed.
    completion = client.completions.create(model="", prompt="Hi", max_tokens=2)
    assert completion.choices[0].finish_reason == "length"
