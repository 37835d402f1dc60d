"""The operator-engine contract (DESIGN.md): the pod gets only container args and env, and
- every profile the operator can choose, on every GPU it knows, `pagoda serve` accepts;
- they really serve, here on the CPU with a tiny checkpoint: every precision at TP 1 and 2, and TP 4
  and 8 (gloo ranks);
- a user's engine.extraArgs never override a flag the operator renders (spec parsing and the CRD).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pagoda.operator import manifests
from pagoda.operator.catalogue import CATALOGUE
from pagoda.operator.gpus import KNOWN_GPUS, GpuGroup
from pagoda.operator.profile import PRECISIONS, TP_DEGREES, Decision, select_profile
from pagoda.operator.spec import OPERATOR_FLAGS, OperatorConfig, ServiceSpec, operator_flag, parse_spec

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "serving.pagoda.dev_inferenceservices.yaml"
CONFIG = OperatorConfig()


def _body(spec: dict[str, Any], name: str = "contract") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns"}, "spec": spec}


def _bodies() -> Iterator[dict[str, Any]]:
    """Every example as written, and every catalogue model at every precision and TP a spec can ask for."""
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        example = yaml.safe_load(path.read_text())
        yield _body(example["spec"], example["metadata"]["name"])
    for model in CATALOGUE:
        for precision in PRECISIONS:
            for tp in ("auto", *TP_DEGREES):
                source = {"imagePath": f"/models/{model}"}
                spec = {"model": {"name": model, "source": source}, "precision": precision}
                yield _body(spec | {"tensorParallelSize": tp})


def _groups() -> Iterator[GpuGroup]:
    """Every GPU the operator knows (as GPU Feature Discovery labels it), in nodes of 1 to 8."""
    for product, (cc, memory_mib) in KNOWN_GPUS.items():
        for num_gpus in TP_DEGREES:
            yield GpuGroup(product, cc, memory_mib, num_gpus, labels=(product,), node_names=("node",))


@functools.cache
def chosen_profiles() -> list[tuple[ServiceSpec, Decision]]:
    """Every (spec, selected profile) the operator can reach, deduplicated on what the pod gets."""
    seen: set[tuple] = set()
    out = []
    for body in _bodies():
        spec = parse_spec(body)
        for group in _groups():
            decision = select_profile(spec.profile_request(), [group])
            if not decision.is_selected:
                continue
            container = _container(spec, decision)
            key = (
                spec.model_name,
                tuple(container["args"]),
                repr(container["env"]),
                group.compute_capability,
            )
            if key not in seen:
                seen.add(key)
                out.append((spec, decision))
    return out


def _container(spec: ServiceSpec, decision: Decision) -> dict[str, Any]:
    return manifests.deployment(spec, decision, CONFIG)["spec"]["template"]["spec"]["containers"][0]


def _with_values(args: list[str], **values: str) -> list[str]:
    """`args` with the values of some flags replaced: `_with_values(args, model="/x")`."""
    args = list(args)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        args[args.index(flag) + 1] = value
    return args


class FakeNvml:
    """NVML as `pagoda serve` sees it on the chosen node: its GPU's name and compute capability."""

    def __init__(self, group: GpuGroup) -> None:
        self.group = group

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import pynvml  # nvidia-ml-py, a server dependency

        monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: self.group.num_gpus)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: index)
        monkeypatch.setattr(
            pynvml, "nvmlDeviceGetCudaComputeCapability", lambda h: self.group.compute_capability
        )
        monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: self.group.product)


def test_the_table_reaches_every_precision_and_tp() -> None:
    """What the contract covers: the operator's whole range, so a gap below is a real gap."""
    reached = {(d.precision, d.tensor_parallel_size) for _, d in chosen_profiles()}
    assert {p for p, _ in reached} == {"fp8", "bf16", "fp16"}
    assert {tp for _, tp in reached} == set(TP_DEGREES)


def test_serve_accepts_every_profile_the_operator_chooses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from pagoda.service import cli as serve_cli

    for name in [n for n in os.environ if n.startswith("PAGODA_")]:
        monkeypatch.delenv(name)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    for spec, decision in chosen_profiles():
        assert decision.gpu is not None
        container = _container(spec, decision)
        with monkeypatch.context() as patch:
            for var in container["env"]:  # PAGODA_* variables are flags too
                if "value" in var:
                    patch.setenv(var["name"], var["value"])
            FakeNvml(decision.gpu).install(patch)
            parser = argparse.ArgumentParser(exit_on_error=False)
            serve_cli.add_arguments(parser)
            where = f"{spec.name} on {decision.gpu.describe()}: {container['args']}"
            try:
                args = parser.parse_args(_with_values(container["args"], model=str(checkpoint)))
                _, engine = serve_cli.build_configs(args)
            except (argparse.ArgumentError, SystemExit, ValueError) as exc:
                raise AssertionError(f"pagoda serve refuses {where}: {exc}") from exc
        dtype, quantization = serve_cli.PRECISION_DTYPES[str(decision.precision)]
        assert (engine.dtype, engine.quantization) == (dtype, quantization), where
        assert engine.tensor_parallel_size == decision.tensor_parallel_size, where
        assert engine.served_model_name == spec.model_name, where


# --- extraArgs never override the operator's flags ---------------------------------------------------


def _crd_flags() -> list[str]:
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    rule, api_key_rule, one_item_rule = spec["engine"]["properties"]["extraArgs"]["items"][
        "x-kubernetes-validations"
    ]
    assert "'--api-key'" in api_key_rule["rule"]  # the key never in args: apiKeySecret
    assert "matches(r'\\s')" in one_item_rule["rule"]  # a flag and its value in one item
    return re.findall(r"'(--[a-z-]+)'", rule["rule"])


def test_operator_flags_are_one_list_with_the_crd_and_what_is_rendered() -> None:
    from pagoda.service import cli as serve_cli

    assert _crd_flags() == list(OPERATOR_FLAGS)
    engine = {"maxModelLen": 4096, "maxNumSeqs": 8, "kvCacheDtype": "fp8", "apiServerCount": 2}
    engine["prefixCaching"] = False
    full = parse_spec(
        _body({"model": {"name": "llama-3.1-8b", "source": {"imagePath": "/m"}}, "engine": engine})
    )
    profiles = [(full, chosen_profiles()[0][1]), *chosen_profiles()]
    rendered = {a for s, d in profiles for a in manifests.server_args(s, d, CONFIG) if a.startswith("--")}
    assert rendered == set(OPERATOR_FLAGS)
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    serve_flags = {o for action in parser._actions for o in action.option_strings if o.startswith("--")}
    assert set(OPERATOR_FLAGS) <= serve_flags
    for flag in serve_flags - set(OPERATOR_FLAGS):  # the rule never takes a flag that is the user's
        assert operator_flag(flag) is None and operator_flag(f"{flag}=1") is None, flag


@pytest.mark.parametrize(
    ("arg", "flag"),
    [
        ("--tensor-parallel-size=4", "--tensor-parallel-size"),
        ("--tensor-parallel-size", "--tensor-parallel-size"),
        ("--tensor=4", "--tensor-parallel-size"),  # argparse takes a unique prefix
        ("--precision", "--precision"),
        ("--model=/elsewhere", "--model"),
        ("--grpc", "--grpc-port"),
        ("--no-enable-prefix", "--no-enable-prefix-caching"),
        ("--max-model-len=100000", "--max-model-len"),
        ("--kv-cache-dtype", "--kv-cache-dtype"),
        ("--kv-cache-d=fp8", "--kv-cache-dtype"),
        ("--api-server-count=2", "--api-server-count"),
        ("--api-server", "--api-server-count"),
        ("--kv-cache-memory-bytes=1073741824", None),
        ("--seed", None),
        ("--device=cpu", None),
        ("--max-num-batched-tokens=4096", None),
        ("4", None),
        ("--", None),
        ("-h", None),
    ],
)
def test_operator_flag(arg: str, flag: str | None) -> None:
    assert operator_flag(arg) == flag


def test_abbreviations_would_really_override() -> None:
    """Why abbreviations are refused too: `pagoda serve` takes them, and the last value wins."""
    from pagoda.service import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    assert parser.parse_args(["--tensor-parallel-size", "1", "--tensor=4"]).tensor_parallel_size == 4


def test_extra_args_that_override_are_refused_at_parsing() -> None:
    spec = {"model": {"name": "llama-3.1-8b", "source": {"imagePath": "/m"}}}
    ok = parse_spec(_body(spec | {"engine": {"extraArgs": ["--seed", "7", "--device=cuda"]}}))
    assert ok.engine.extra_args == ("--seed", "7", "--device=cuda")
    with pytest.raises(ValueError, match=r"'--tensor-parallel-size=4' would override --tensor-parallel-size"):
        parse_spec(_body(spec | {"engine": {"extraArgs": ["--seed", "7", "--tensor-parallel-size=4"]}}))
    with pytest.raises(ValueError, match=r"'--kv-cache-dtype' would override --kv-cache-dtype"):
        parse_spec(_body(spec | {"engine": {"extraArgs": ["--kv-cache-dtype", "fp8"]}}))
    with pytest.raises(ValueError, match=r"'--api-server-count=4' would override --api-server-count"):
        parse_spec(_body(spec | {"engine": {"extraArgs": ["--api-server-count=4"]}}))


def test_a_flag_and_its_value_in_one_item_is_refused() -> None:
    """`pagoda serve` takes "--tensor-parallel-size 2" for one unknown flag and exits at every start."""
    from pagoda.service import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--seed 7"])
    spec = {"model": {"name": "llama-3.1-8b", "source": {"imagePath": "/m"}}}
    for arg in ("--tensor-parallel-size 2", "--seed 7", "--seed\t7", "-s 7"):
        with pytest.raises(ValueError, match=r"holds a flag and its value in one item"):
            parse_spec(_body(spec | {"engine": {"extraArgs": [arg]}}))
    # A value may hold spaces, after '=' or as its own item.
    ok = parse_spec(_body(spec | {"engine": {"extraArgs": ["--chat-template=a b", "--seed", "7", "a b"]}}))
    assert ok.engine.extra_args == ("--chat-template=a b", "--seed", "7", "a b")


def test_pagoda_variables_that_set_an_operator_flag_are_refused() -> None:
    """`pagoda serve` reads every flag from PAGODA_<FLAG>; where the operator renders no flag (an unset
    maxModelLen, kvCacheDtype, apiServerCount) the variable would win."""
    from pagoda.operator.spec import operator_env, serve_env_name
    from pagoda.service import cli as serve_cli

    for flag in (*OPERATOR_FLAGS, "--api-key", "--seed"):
        assert serve_env_name(flag) == serve_cli.env_name(flag)
    assert operator_env("PAGODA_MAX_MODEL_LEN") == "--max-model-len"
    assert operator_env("PAGODA_ENABLE_PREFIX_CACHING") == "--enable-prefix-caching"
    assert operator_env("PAGODA_SEED") is None and operator_env("pagoda_max_model_len") is None
    spec = {"model": {"name": "llama-3.1-8b", "source": {"imagePath": "/m"}}}
    for name, message in [
        ("PAGODA_MAX_MODEL_LEN", "spec.env: PAGODA_MAX_MODEL_LEN would set --max-model-len"),
        ("PAGODA_TENSOR_PARALLEL_SIZE", "would set --tensor-parallel-size"),
        ("PAGODA_API_KEY", "spec.env cannot set PAGODA_API_KEY: use apiKeySecret"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_spec(_body(spec | {"env": [{"name": "A", "value": "1"}, {"name": name, "value": "4"}]}))
    crd = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    (env_rule,) = [
        v["rule"] for v in crd["properties"]["spec"]["x-kubernetes-validations"] if "env" in v["rule"]
    ]
    assert re.findall(r"'(PAGODA_[A-Z_]+)'", env_rule) == [
        *(serve_env_name(f) for f in OPERATOR_FLAGS),
        "PAGODA_API_KEY",
    ]
    ok = parse_spec(_body(spec | {"env": [{"name": "PAGODA_SEED", "value": "7"}, {"name": "HF_ENDPOINT"}]}))
    assert [e["name"] for e in ok.env] == ["PAGODA_SEED", "HF_ENDPOINT"]


def test_a_stored_int8_object_is_an_invalid_spec() -> None:
    """int8 left the CRD's enums; an object stored before says why it cannot run, not a KeyError."""
    spec = {"model": {"name": "llama-3.1-8b", "source": {"imagePath": "/m"}}}
    with pytest.raises(ValueError, match="precision 'int8': pagoda serve runs auto, bf16, fp16, fp8"):
        parse_spec(_body(spec | {"precision": "int8"}))
    with pytest.raises(ValueError, match=r"gpuPreferences\.precision 'int8'"):
        parse_spec(_body(spec | {"gpuPreferences": [{"product": "T4", "precision": "int8"}]}))


# --- every distinct (precision, TP) serves ------------------------------------------------------------


@pytest.fixture(scope="session")
def tp8_llama_ckpt(tmp_path_factory: pytest.TempPathFactory, tokenizer_files: Path) -> Path:
    """Llama with 16 query and 8 KV heads: at TP 8 each rank holds one KV head, as 70B and 405B do."""
    from transformers import LlamaConfig

    from tests.conftest import _build

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=16,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    return _build(tmp_path_factory, "tp8_llama", tokenizer_files, config, seed=0)


# Every precision at TP 1 and 2, where sharding meets each dtype (and fp8's per-shard scales); TP 4 and
# 8 once each, as the catalogue's big models get them: more ranks, the same code. On 2 cores a start
# takes 5-8 s at TP 1-2, ~15 s at TP 4 and ~18 s at TP 8 (twice that on a busy machine): all 12 pairs
# took 2.5 min quiet and 4 min 12 s busy (all passed), these 8 take 1 min 20 s.
WIDE_TP_PRECISION = {4: "bf16", 8: "fp8"}  # 70B bf16 on H100s, 405B fp8 on H100s


def _distinct_profiles() -> dict[tuple[str, int], tuple[ServiceSpec, Decision]]:
    out: dict[tuple[str, int], tuple[ServiceSpec, Decision]] = {}
    for spec, decision in chosen_profiles():
        precision, tp = str(decision.precision), int(decision.tensor_parallel_size or 0)
        if tp <= 2 or WIDE_TP_PRECISION.get(tp) == precision:
            out.setdefault((precision, tp), (spec, decision))
    return dict(sorted(out.items(), key=lambda item: (item[0][1], item[0][0])))


DISTINCT = _distinct_profiles()


def test_the_served_profiles_cover_every_precision_and_tp() -> None:
    assert set(DISTINCT) == {(p, tp) for p in ("bf16", "fp16", "fp8") for tp in (1, 2)} | {
        (precision, tp) for tp, precision in WIDE_TP_PRECISION.items()
    }


@pytest.mark.parametrize("key", list(DISTINCT), ids=[f"{p}-tp{tp}" for p, tp in DISTINCT])
def test_the_profiles_serve_on_the_cpu(
    key: tuple[str, int], tp8_llama_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rendered args with the tiny checkpoint for the model, on the CPU, on free local ports."""
    from pagoda.service.serve_process import ServeProcess

    spec, decision = DISTINCT[key]
    container = _container(spec, decision)
    local = {"model": str(tp8_llama_ckpt), "host": "127.0.0.1", "port": "0", "grpc_port": "0"}
    if "--max-model-len" in container["args"]:
        local["max_model_len"] = "512"  # the tiny model's context is 2048
    on_the_cpu = ["--device", "cpu", "--kv-cache-memory-bytes", str(8 << 20)]
    args = _with_values(container["args"], **local) + on_the_cpu
    for var in container["env"]:
        if var["name"].startswith("PAGODA_") and "value" in var:
            monkeypatch.setenv(var["name"], var["value"])
    with ServeProcess(args, log_path=tmp_path / "serve.log") as server:
        body = {"model": spec.model_name, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        assert choice["finish_reason"] in ("length", "stop") and isinstance(choice["text"], str)
        if decision.tensor_parallel_size != 1:  # really sharded, over that many gloo ranks
            assert f"tensor parallel over {decision.tensor_parallel_size} ranks" in server.log()


def test_the_model_uri_pattern_is_one_with_the_crd() -> None:
    from pagoda.operator.spec import URI_PATTERN

    crd = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    uri = crd["properties"]["spec"]["properties"]["model"]["properties"]["source"]["properties"]["uri"]
    assert uri["pattern"] == URI_PATTERN.pattern
