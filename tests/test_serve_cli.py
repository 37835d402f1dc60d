"""`pagoda serve` flags: documented in --help, readable from PAGODA_* variables, refused clearly."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from pagoda.cli import build_parser
from pagoda.service import cli as serve_cli
from pagoda.service.engine.config import EngineConfig

FLAGS = [
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--grpc-port",
    "--precision",
    "--tensor-parallel-size",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--block-size",
    "--cuda-graph-max-tokens",
    "--max-cudagraph-capture-size",
    "--long-prefill-attention",
    "--gpu-memory-utilization",
    "--kv-cache-memory-bytes",
    "--enable-prefix-caching",
    "--max-waiting-requests",
    "--drain-timeout",
    "--engine-stall-timeout",
    "--body-read-timeout",
    "--max-header-bytes",
    "--api-server-count",
    "--device",
]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_help_documents_every_flag_and_its_variable() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "serve", "--help"], capture_output=True, text=True, check=True
    )
    text = re.sub(r"\s+", " ", result.stdout)
    for flag in FLAGS:
        assert flag in text, flag
        assert serve_cli.env_name(flag) in text, flag
    assert "--no-enable-prefix-caching" in text


def test_defaults() -> None:
    args = parse()
    server, engine = serve_cli.build_configs(args)
    assert (server.port, server.grpc_port) == (8000, 8001)
    assert engine.model is None and engine.dtype == "auto" and engine.enable_prefix_caching
    assert server.api_server_count == 1
    assert engine.long_prefill_attention == "cudnn"
    assert engine.max_cudagraph_capture_size == EngineConfig().max_cudagraph_capture_size
    assert (server.engine_stall_timeout_s, server.body_read_timeout_s, server.max_header_bytes) == (
        120.0,
        30.0,
        64 << 10,
    )
    # Serving holds prompt chunks beside decodes to 256 tokens; the offline engine takes the whole budget.
    assert engine.max_mixed_prefill_tokens == 256
    assert EngineConfig().max_mixed_prefill_tokens == 0


def test_environment_sets_flags_and_command_line_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_PORT", "9000")
    monkeypatch.setenv("PAGODA_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("PAGODA_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("PAGODA_PRECISION", "fp32")
    monkeypatch.setenv("PAGODA_KV_CACHE_MEMORY_BYTES", "1048576")
    monkeypatch.setenv("PAGODA_CUDA_GRAPH_MAX_TOKENS", "0")
    monkeypatch.setenv("PAGODA_MAX_CUDAGRAPH_CAPTURE_SIZE", "512")
    monkeypatch.setenv("PAGODA_API_SERVER_COUNT", "3")
    monkeypatch.setenv("PAGODA_LONG_PREFILL_ATTENTION", "cudnn")
    server, engine = serve_cli.build_configs(parse("--max-num-seqs", "9"))
    assert server.port == 9000
    assert server.api_server_count == 3
    assert engine.max_num_seqs == 9
    assert engine.enable_prefix_caching is False
    assert engine.dtype == "float32"
    assert engine.kv_cache_memory_bytes == 1048576
    assert engine.cuda_graph_max_tokens == 0
    assert engine.max_cudagraph_capture_size == 512
    assert engine.long_prefill_attention == "cudnn"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be at least 1"),
        (["--model", "/no/such/model"], "no such checkpoint"),
        (["--block-size", "12"], "block_size must be a power of two"),
        (["--cuda-graph-max-tokens", "-5"], "cuda_graph_max_tokens must be at least 0"),
        (["--max-cudagraph-capture-size", "0"], "max_cudagraph_capture_size must be at least 1, got 0"),
        (["--max-mixed-prefill-tokens", "-1"], "max_mixed_prefill_tokens must be at least 0, got -1"),
        (["--max-waiting-requests", "-1"], "--max-waiting-requests"),
        (["--api-server-count", "0"], "--api-server-count must be at least 1, got 0"),
        (["--engine-stall-timeout", "-1"], "--engine-stall-timeout must be >= 0, got -1.0"),
        (["--body-read-timeout", "-0.5"], "--body-read-timeout must be >= 0, got -0.5"),
        (["--max-header-bytes", "-1"], "--max-header-bytes must be >= 0, got -1"),
    ],
)
def test_refuses_what_the_engine_cannot_run(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        serve_cli.build_configs(parse(*argv))


def test_int8_is_not_a_precision(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse("--precision", "int8")
    assert exit_info.value.code == 2
    assert "argument --precision: invalid choice: 'int8'" in capsys.readouterr().err
    # From the environment argparse does not check choices; the config check does.
    monkeypatch.setenv("PAGODA_PRECISION", "int8")
    with pytest.raises(ValueError, match="must be one of auto, bf16, fp16, fp32, fp8, got 'int8'"):
        serve_cli.build_configs(parse())


def test_cuda_device_without_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml  # nvidia-ml-py, a server dependency

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: (_ for _ in ()).throw(pynvml.NVMLError(1)))
    with pytest.raises(ValueError, match="no NVIDIA GPU found"):
        serve_cli.build_configs(parse("--device", "cuda"))


def mock_nvml_gpu(monkeypatch: pytest.MonkeyPatch, cc: tuple[int, int], name: str) -> None:
    """A mock of NVML (no GPU on this machine): one GPU of this compute capability and name."""
    import pynvml  # nvidia-ml-py, a server dependency

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 1)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCudaComputeCapability", lambda h: cc)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: name)


def test_bf16_refused_on_a_gpu_older_than_ampere(monkeypatch: pytest.MonkeyPatch) -> None:
    mock_nvml_gpu(monkeypatch, (7, 5), "Tesla T4")
    with pytest.raises(ValueError, match=r"bf16 needs compute capability 8.0.*Tesla T4.*7.5"):
        serve_cli.build_configs(parse("--precision", "bf16", "--device", "cuda"))


def test_fp8_maps_to_quantized_projections() -> None:
    _, engine = serve_cli.build_configs(parse("--precision", "fp8", "--device", "cpu"))
    assert engine.quantization == "fp8" and engine.dtype == "auto"


def test_fp8_refused_on_a_gpu_older_than_ada(monkeypatch: pytest.MonkeyPatch) -> None:
    mock_nvml_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"fp8 needs compute capability 8.9.*A100.*8.0"):
        serve_cli.build_configs(parse("--precision", "fp8", "--device", "cuda"))


def test_fp8_kv_cache_refused_on_a_gpu_older_than_ada(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels store e4m3, which NVIDIA GPUs convert in hardware from Ada (8.9) on."""
    mock_nvml_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8 needs compute capability 8.9.*A100.*8.0"):
        serve_cli.build_configs(parse("--precision", "bf16", "--kv-cache-dtype", "fp8", "--device", "auto"))
    _, engine = serve_cli.build_configs(parse("--precision", "bf16", "--device", "auto"))  # auto cache: fine
    assert engine.kv_cache_dtype == "auto"
    _, engine = serve_cli.build_configs(parse("--kv-cache-dtype", "fp8", "--device", "cpu"))  # CPU: fine
    assert engine.kv_cache_dtype == "fp8"


def test_refusal_exits_2_with_the_reason() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "serve", "--precision", "int8"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "invalid choice: 'int8'" in result.stderr
