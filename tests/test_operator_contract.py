"""The operator-engine contract (DESIGN.md): the pod gets only container args and env, and
- every profile the operator can choose, on every GPU it knows, `pagoda serve` accepts;
- they really serve, here on the CPU with a tiny checkpoint: every precision at TP 1 and 2, and TP 4
  and 8 (gloo ranks);
- a model over several pods (a LeaderWorkerSet group): every leader's and worker's args parse as the
  pod's place in the group, and the groups start on the CPU as separate `pagoda serve` processes, one
  per pod, over gloo, and answer;
- a user's engine.extraArgs never override a flag the operator renders (spec parsing and the CRD);
- spec.speculative and spec.adapters reach the server as the configs they mean, and what admission
  refuses of them (the CRD's bounds and CEL rules) parsing refuses too.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest
import yaml

from pagoda.operator import manifests
from pagoda.operator import spec as spec_mod
from pagoda.operator.catalogue import CATALOGUE
from pagoda.operator.gpus import KNOWN_GPUS, GpuGroup
from pagoda.operator.profile import MAX_AUTO_NODES, PRECISIONS, TP_DEGREES, Decision, select_profile
from pagoda.operator.reserved import MULTI_NODE_FLAGS, OPERATOR_FLAGS, operator_flag
from pagoda.operator.spec import OperatorConfig, ServiceSpec, Speculative, parse_spec
from pagoda.service.engine.runner.cpu_threads import cpu_budget

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


def _groups(num_nodes: int = 1) -> Iterator[GpuGroup]:
    """Every GPU the operator knows (as GPU Feature Discovery labels it), in nodes of 1 to 8."""
    nodes = tuple(f"node-{i}" for i in range(num_nodes))
    for product, (cc, memory_mib) in KNOWN_GPUS.items():
        for num_gpus in TP_DEGREES:
            yield GpuGroup(product, cc, memory_mib, num_gpus, labels=(product,), node_names=nodes)


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


def _group_bodies() -> Iterator[dict[str, Any]]:
    """Every catalogue model at every precision, its pipeline left to the operator or asked for."""
    for model in CATALOGUE:
        for precision in PRECISIONS:
            for pp in ("auto", 2, 3, 4):
                spec = {"model": {"name": model, "source": {"imagePath": f"/models/{model}"}}}
                yield _body(spec | {"precision": precision, "pipelineParallelSize": pp})


@functools.cache
def chosen_group_profiles() -> list[tuple[ServiceSpec, Decision]]:
    """Every (spec, profile over several pods) the operator can reach on clusters of MAX_AUTO_NODES nodes
    of each GPU, deduplicated on what the leader gets."""
    seen: set[tuple] = set()
    out = []
    for body in _group_bodies():
        spec = parse_spec(body)
        for group in _groups(MAX_AUTO_NODES):
            decision = select_profile(spec.profile_request(), [group])
            if not decision.is_multi_node:
                continue
            args = tuple(manifests.server_args(spec, decision, CONFIG, "leader"))
            key = (spec.model_name, args, group.compute_capability)
            if key not in seen:
                seen.add(key)
                out.append((spec, decision))
    return out


def _group_containers(spec: ServiceSpec, decision: Decision) -> tuple[dict[str, Any], dict[str, Any]]:
    """The leader's and the workers' server containers of the LeaderWorkerSet."""
    lws = manifests.leader_worker_set(spec, decision, CONFIG)["spec"]["leaderWorkerTemplate"]
    return (
        lws["leaderTemplate"]["spec"]["containers"][0],
        lws["workerTemplate"]["spec"]["containers"][0],
    )


def _serve_parser() -> argparse.ArgumentParser:
    from pagoda.service import cli as serve_cli

    parser = argparse.ArgumentParser(exit_on_error=False)
    serve_cli.add_arguments(parser)
    return parser


def _serve_has_multi_node_flags() -> bool:
    flags = {o for action in _serve_parser()._actions for o in action.option_strings}
    return set(MULTI_NODE_FLAGS) <= flags


needs_multi_node_serve = pytest.mark.skipif(
    not _serve_has_multi_node_flags(), reason="pagoda serve has no --nnodes/--node-rank/--headless yet"
)


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """$(VAR) in container args, as the kubelet expands them from the container's environment."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


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


def test_the_table_reaches_groups_over_several_pods() -> None:
    """Asked for and chosen alone (a model no node holds), at every precision and TP, up to the deepest
    pipeline the operator picks by itself."""
    reached = {
        (d.precision, d.tensor_parallel_size, d.pipeline_parallel_size) for _, d in chosen_group_profiles()
    }
    assert {p for p, _, _ in reached} == {"fp8", "bf16", "fp16"}
    assert {tp for _, tp, _ in reached} == set(TP_DEGREES)
    assert {pp for _, _, pp in reached} == set(range(2, MAX_AUTO_NODES + 1))
    chosen = [d for s, d in chosen_group_profiles() if s.pipeline_parallel_size is None]
    assert ("NVIDIA-H100-80GB-HBM3", "bf16", 8, 2) in {
        (d.gpu.product, d.precision, d.tensor_parallel_size, d.pipeline_parallel_size)  # type: ignore[union-attr]
        for d in chosen
    }  # 405B bf16 over two H100 nodes


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
    engine |= {"prefixCaching": False, "maxLoras": 1, "maxLoraRank": 8, "maxCpuLoras": 2}
    full = parse_spec(
        _body(
            {
                "model": {"name": "llama-3.1-8b", "source": {"imagePath": "/m"}},
                "engine": engine,
                "speculative": {"method": "ngram"},
                "adapters": [{"name": "sql", "source": {"imagePath": "/a"}}],
            }
        )
    )
    profiles = [(full, chosen_profiles()[0][1]), *chosen_profiles()]
    rendered = {a for s, d in profiles for a in manifests.server_args(s, d, CONFIG) if a.startswith("--")}
    for spec, decision in chosen_group_profiles()[:1]:  # a group's pods: their place in it
        for role in ("leader", "worker"):
            rendered |= {a for a in manifests.server_args(spec, decision, CONFIG, role) if a.startswith("--")}  # type: ignore[arg-type]
    # --no-enable-lora is never rendered (no adapters: no LoRA flag at all), and refused all the same: it
    # would switch off what spec.adapters turns on.
    assert rendered | {"--no-enable-lora"} == set(OPERATOR_FLAGS)
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    serve_flags = {o for action in parser._actions for o in action.option_strings if o.startswith("--")}
    for flag in serve_flags - set(OPERATOR_FLAGS):  # the rule never takes a flag that is the user's
        assert operator_flag(flag) is None and operator_flag(f"{flag}=1") is None, flag
    # The multi-node flags are pagoda serve's once the engine's side lands (until then, only these miss).
    assert set(OPERATOR_FLAGS) - serve_flags <= set(MULTI_NODE_FLAGS)
    if not set(MULTI_NODE_FLAGS) <= serve_flags:
        pytest.skip(f"pagoda serve lacks {sorted(set(MULTI_NODE_FLAGS) - serve_flags)} (the engine's side)")


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
        ("--speculative-config={}", "--speculative-config"),
        ("--spec", "--speculative-config"),
        ("--enable-lora", "--enable-lora"),
        ("--no-enable-lora", "--no-enable-lora"),
        ("--lora-modules", "--lora-modules"),
        ("--lora=a=/b", "--lora-modules"),
        ("--max-lora=4", "--max-loras"),  # ambiguous to argparse; refused all the same
        ("--max-lora-r=64", "--max-lora-rank"),
        ("--max-cpu", "--max-cpu-loras"),
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
    from pagoda.operator.reserved import operator_env, serve_env_name
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
    env_rules = [
        v["rule"] for v in crd["properties"]["spec"]["x-kubernetes-validations"] if "env" in v["rule"]
    ]
    # Two rules: one list of every name exceeds a rule's CEL cost budget (a v1.36.3 API server refused it).
    names = [re.findall(r"'(PAGODA_[A-Z_]+)'", rule) for rule in env_rules]
    multi_node = [serve_env_name(f) for f in MULTI_NODE_FLAGS]
    assert names == [
        [*(serve_env_name(f) for f in OPERATOR_FLAGS if f not in MULTI_NODE_FLAGS), "PAGODA_API_KEY"],
        multi_node,
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


# Started for real: each precision once and TP 1, 2 and 8, a `pagoda serve` each (a start costs 5-8 s of
# CPU at TP 1-2 and ~27 s at TP 8: a torch import per rank). fp8 at TP 8 is where sharding meets the
# per-shard scales and one KV head per rank, as 405B has. The rest of the operator's (precision, TP)
# choices differ from these only in values, which `test_serve_accepts_every_profile_the_operator_chooses`
# parses with the real `pagoda serve` into its EngineConfig; all twelve pairs served took 2.5 min quiet.
SERVED = [("bf16", 1), ("fp16", 2), ("fp8", 8)]


def _served_profiles() -> dict[tuple[str, int], tuple[ServiceSpec, Decision]]:
    out: dict[tuple[str, int], tuple[ServiceSpec, Decision]] = {}
    for spec, decision in chosen_profiles():
        if spec.adapters or spec.speculative:
            continue  # their paths are the cluster's; the parser checks their args (below)
        key = (str(decision.precision), int(decision.tensor_parallel_size or 0))
        if key in SERVED:
            out.setdefault(key, (spec, decision))
    return out


DISTINCT = _served_profiles()


def test_the_operator_chooses_every_served_profile() -> None:
    assert sorted(DISTINCT) == sorted(SERVED)


@pytest.mark.parametrize("key", SERVED, ids=[f"{p}-tp{tp}" for p, tp in SERVED])
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
    monkeypatch.delenv("OMP_NUM_THREADS")  # the engine's own rule shares the CPUs among its ranks
    with ServeProcess(args, log_path=tmp_path / "serve.log") as server:
        body = {"model": spec.model_name, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        assert choice["finish_reason"] in ("length", "stop") and isinstance(choice["text"], str)
        if decision.tensor_parallel_size != 1:  # really sharded, over that many gloo ranks
            assert f"tensor parallel over {decision.tensor_parallel_size} ranks" in server.log()
            # Not a thread more than its share of the CPUs, whatever torch would start.
            tp, usable = decision.tensor_parallel_size, cpu_budget()
            chose = re.search(
                rf"torch threads (\d+) a rank \({tp} rank\(s\) on {usable} usable CPUs", server.log()
            )
            assert chose and 1 <= int(chose[1]) <= max(1, usable // tp), server.log()[-2000:]


# --- a model over several pods: LeaderWorkerSet groups ------------------------------------------------


@needs_multi_node_serve
def test_every_group_pods_args_are_its_place_in_the_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The leader's and each worker's args, $(LWS_*) expanded as the kubelet does from what LWS gives the
    container, parsed by the real `pagoda serve`: the group's shape, the pod's rank, rank 0's address and
    port, a worker headless; every profile over several pods the operator can choose."""
    from pagoda.service import cli as serve_cli

    for name in [n for n in os.environ if n.startswith(("PAGODA_", "LWS_"))]:
        monkeypatch.delenv(name)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    for spec, decision in chosen_group_profiles():
        assert decision.gpu is not None
        leader, worker = _group_containers(spec, decision)
        pp, tp, nodes = decision.pipeline_parallel_size, decision.tensor_parallel_size, decision.num_nodes
        for container, index in ((leader, 0), (worker, 1), (worker, nodes - 1)):
            env = {
                "LWS_LEADER_ADDRESS": f"{spec.name}-0.{spec.name}.ns",
                "LWS_GROUP_SIZE": str(nodes),
                "LWS_WORKER_INDEX": str(index),
            }
            where = f"{spec.name} pod {index} of {decision.reason}: {container['args']}"
            with monkeypatch.context() as patch:
                for key, value in env.items():
                    patch.setenv(key, value)
                FakeNvml(decision.gpu).install(patch)
                try:
                    args = _serve_parser().parse_args(
                        _with_values(_expand(container["args"], env), model=str(checkpoint))
                    )
                    server, engine = serve_cli.build_configs(args)
                except (argparse.ArgumentError, SystemExit, ValueError) as exc:
                    raise AssertionError(f"pagoda serve refuses {where}: {exc}") from exc
            assert (engine.pipeline_parallel_size, engine.tensor_parallel_size) == (pp, tp), where
            assert (engine.nnodes, engine.node_rank) == (nodes, index), where
            assert (engine.master_addr, engine.master_port) == (
                env["LWS_LEADER_ADDRESS"],
                manifests.MASTER_PORT,
            )
            assert server.headless == (index > 0), where
            assert engine.served_model_name == spec.model_name, where


@pytest.fixture(scope="session")
def four_layer_llama_ckpt(tmp_path_factory: pytest.TempPathFactory, tokenizer_files: Path) -> Path:
    """Llama with four layers (a stage each up to PP 4) and 8 query / 4 KV heads (TP up to 4)."""
    from transformers import LlamaConfig

    from tests.conftest import _build

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    return _build(tmp_path_factory, "four_layer_llama", tokenizer_files, config, seed=0)


# A group started on the CPU, one `pagoda serve` per pod (gloo between them, over 127.0.0.1): a pipeline of
# three pods, so a middle pod too. Two pods of two ranks each (PP 2 x TP 2) are tests/test_multinode.py's,
# started from the same flags by hand; every group profile's pod args are parsed above.
GROUPS_SERVED = [("fp16", 1, 3)]


def _group_profile(precision: str, tp: int, pp: int) -> tuple[ServiceSpec, Decision]:
    for spec, decision in chosen_group_profiles():
        if (decision.precision, decision.tensor_parallel_size, decision.pipeline_parallel_size) == (
            precision,
            tp,
            pp,
        ) and not (spec.speculative or spec.adapters):
            return spec, decision
    raise AssertionError(f"no profile {precision} TP {tp} x PP {pp} among the operator's choices")


@needs_multi_node_serve
@pytest.mark.parametrize("shape", GROUPS_SERVED, ids=[f"{p}-tp{t}-pp{n}" for p, t, n in GROUPS_SERVED])
def test_the_groups_start_on_the_cpu_and_answer(
    shape: tuple[str, int, int], four_layer_llama_ckpt: Path, tmp_path: Path
) -> None:
    """The rendered leader and worker args, the tiny checkpoint for the model, one process per pod as the
    kubelet would start them (LWS's variables in each one's environment, the leader's address 127.0.0.1,
    the rendezvous on a free port), the workers headless; the leader answers a completion."""
    import socket

    from pagoda.service.serve_process import ServeProcess

    spec, decision = _group_profile(*shape)
    leader, worker = _group_containers(spec, decision)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        master_port = str(probe.getsockname()[1])
    local = {
        "model": str(four_layer_llama_ckpt),
        "host": "127.0.0.1",
        "port": "0",
        "master_port": master_port,
    }
    on_the_cpu = ["--device", "cpu", "--kv-cache-memory-bytes", str(8 << 20)]
    processes = []
    try:
        for index in range(decision.num_nodes):
            container = leader if index == 0 else worker
            env = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": str(decision.num_nodes)}
            env["LWS_WORKER_INDEX"] = str(index)
            values = local | ({"grpc_port": "0"} if index == 0 else {})
            args = _with_values(_expand(container["args"], env), **values) + on_the_cpu
            if "--max-model-len" in args:
                args = _with_values(args, max_model_len="512")
            server = ServeProcess(args, log_path=tmp_path / f"pod-{index}.log", env=env)
            processes.append(server.launch())
        server = processes[0].wait_ready(300)
        body = {"model": spec.model_name, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        assert choice["finish_reason"] in ("length", "stop") and isinstance(choice["text"], str)
    except BaseException:
        for i, p in enumerate(processes):
            print(f"--- pod {i} ---\n{p.log()[-3000:]}")
        raise
    finally:
        for p in reversed(processes):
            p.stop()


def test_the_model_uri_pattern_is_one_with_the_crd() -> None:
    from pagoda.operator.spec import URI_PATTERN

    crd = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    uri = crd["properties"]["spec"]["properties"]["model"]["properties"]["source"]["properties"]["uri"]
    assert uri["pattern"] == URI_PATTERN.pattern


# --- spec.speculative and spec.adapters --------------------------------------------------------------


def _serve_configs(args: list[str]) -> Any:
    """The EngineConfig `pagoda serve` builds from rendered args (the model replaced by one that exists)."""
    from pagoda.service import cli as serve_cli

    parser = argparse.ArgumentParser(exit_on_error=False)
    serve_cli.add_arguments(parser)
    parsed = parser.parse_args(_with_values(args, model=str(ROOT / "examples"), precision="fp16"))
    return serve_cli.build_configs(parsed)[1]


IMAGE_MODEL = {"name": "llama-3.1-8b", "source": {"imagePath": "/models/llama"}}
H100_GROUP = GpuGroup("NVIDIA-H100-80GB-HBM3", (9, 0), 81559, 8, labels=("NVIDIA-H100-80GB-HBM3",))


def _rendered(spec: dict[str, Any]) -> list[str]:
    parsed = parse_spec(_body(spec))
    decision = select_profile(parsed.profile_request(), [H100_GROUP])
    assert decision.is_selected, decision.reason
    return manifests.server_args(parsed, decision, CONFIG)


@pytest.mark.parametrize(
    ("speculative", "expected"),
    [
        ({"method": "ngram"}, {"method": "ngram"}),
        (
            {"method": "ngram", "numSpeculativeTokens": 5, "promptLookupMax": 8, "promptLookupMin": 3,
             "maxBatchTokens": 64, "adaptive": False},
            {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 8, "prompt_lookup_min": 3,
             "max_batch_tokens": 64, "adaptive": False},
        ),
        (
            {"method": "draftModel", "draftModel": "/models/llama-3.2-1b", "numSpeculativeTokens": 4},
            {"method": "draft_model", "model": "/models/llama-3.2-1b", "num_speculative_tokens": 4},
        ),
    ],
)  # fmt: skip
def test_speculative_reaches_the_server_as_the_config_it_means(
    speculative: dict[str, Any], expected: dict[str, Any]
) -> None:
    """Rendered, parsed by the real `pagoda serve`: the SpeculativeConfig the server would build from the
    same JSON written by hand (vLLM's keys; the fields the spec leaves out take the server's defaults)."""
    from pagoda.service.engine.config import SpeculativeConfig

    config = _serve_configs(_rendered({"model": IMAGE_MODEL, "speculative": speculative})).speculative
    assert config == SpeculativeConfig.from_json(json.dumps(expected))


def test_the_operators_speculative_defaults_are_the_servers() -> None:
    """The operator writes every field out (and the CRD's rule compares promptLookupMin with an unset
    promptLookupMax by them): a server default that moves must move here too."""
    from pagoda.service.engine.config import MAX_PROMPT_LOOKUP, SpeculativeConfig

    ours, theirs = Speculative("ngram"), SpeculativeConfig()
    for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "max_batch_tokens"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.adaptive is theirs.adaptive
    assert spec_mod.MAX_PROMPT_LOOKUP == MAX_PROMPT_LOOKUP
    rules = [r["rule"] for r in _spec_schema()["speculative"]["x-kubernetes-validations"]]
    (order,) = [r for r in rules if "<=" in r]
    assert order == (
        f"(has(self.promptLookupMin) ? self.promptLookupMin : {theirs.prompt_lookup_min}) <= "
        f"(has(self.promptLookupMax) ? self.promptLookupMax : {theirs.prompt_lookup_max})"
    )


def test_adapters_reach_the_server_from_every_source() -> None:
    from pagoda.service.engine.config import LoRAConfig, LoRAModule

    adapters = [
        {"name": "sql", "source": {"uri": "hf://org/sql-lora@v1"}},
        {"name": "ft:chat:acme::7", "source": {"pvc": {"claimName": "loras", "path": "chat"}}},
        {"name": "tarot", "source": {"hostPath": "/mnt/loras/tarot"}},
        {"name": "baked", "source": {"imagePath": "/opt/loras/baked"}},
    ]
    spec = {"model": IMAGE_MODEL, "adapters": adapters, "engine": {"maxLoraRank": 64, "maxCpuLoras": 6}}
    lora = _serve_configs(_rendered(spec)).lora
    assert lora == LoRAConfig(
        modules=(
            LoRAModule("sql", "/adapters/uri/sql"),
            LoRAModule("ft:chat:acme::7", "/adapters/pvc/loras/chat"),
            LoRAModule("tarot", "/adapters/host/tarot"),
            LoRAModule("baked", "/opt/loras/baked"),
        ),
        max_loras=4,  # every adapter in a GPU slot
        max_lora_rank=64,
        max_cpu_loras=6,
    )
    # No adapters: no LoRA at all (the server's default, off).
    assert _serve_configs(_rendered({"model": IMAGE_MODEL})).lora is None


def test_the_default_max_loras_is_the_number_of_adapters_up_to_eight() -> None:
    def max_loras(count: int, engine: dict[str, Any] | None = None) -> int:
        adapters = [{"name": f"a{i}", "source": {"imagePath": f"/a/{i}"}} for i in range(count)]
        args = _rendered({"model": IMAGE_MODEL, "adapters": adapters, "engine": engine or {}})
        return int(args[args.index("--max-loras") + 1])

    assert [max_loras(n) for n in (1, 3, 8, 9, 64)] == [1, 3, 8, 8, 8]
    assert max_loras(64, {"maxLoras": 32}) == 32
    rule = next(
        v["rule"] for v in _spec_validations() if "maxCpuLoras >=" in v["rule"]
    )  # the CRD's rule compares maxCpuLoras with the same default
    cap = spec_mod.DEFAULT_MAX_LORAS_CAP
    assert f"(size(self.adapters) < {cap} ? size(self.adapters) : {cap})" in " ".join(rule.split())


def _crd_schema() -> dict[str, Any]:
    return yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _spec_schema() -> dict[str, Any]:
    return _crd_schema()["properties"]["spec"]["properties"]


def _spec_validations() -> list[dict[str, str]]:
    return _crd_schema()["properties"]["spec"]["x-kubernetes-validations"]


def _without_words(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _without_words(v) for k, v in schema.items() if k not in ("description", "message")}
    if isinstance(schema, list):
        return [_without_words(v) for v in schema]
    return schema


def test_an_adapters_source_is_shaped_as_the_models() -> None:
    """The same kinds, patterns and rules: a source kind added to model.source alone would be one that
    an adapter cannot come from."""
    spec = _spec_schema()
    adapter = spec["adapters"]["items"]["properties"]
    assert _without_words(adapter["source"]) == _without_words(spec["model"]["properties"]["source"])


def test_the_crds_bounds_are_the_parsers() -> None:
    spec = _spec_schema()
    adapters, engine = spec["adapters"], spec["engine"]["properties"]
    assert adapters["maxItems"] == spec_mod.MAX_ADAPTERS
    assert adapters["x-kubernetes-list-map-keys"] == ["name"]  # unique names
    assert adapters["items"]["properties"]["name"]["pattern"] == spec_mod.ADAPTER_NAME.pattern
    assert (engine["maxLoras"]["maximum"], engine["maxLoraRank"]["maximum"]) == (
        spec_mod.MAX_ADAPTERS,
        spec_mod.MAX_LORA_RANK,
    )
    assert engine["maxCpuLoras"]["maximum"] == spec_mod.MAX_CPU_LORAS
    speculative = spec["speculative"]["properties"]
    assert speculative["numSpeculativeTokens"]["maximum"] == spec_mod.MAX_SPECULATIVE_TOKENS
    assert speculative["promptLookupMax"]["maximum"] == spec_mod.MAX_PROMPT_LOOKUP
    assert speculative["method"]["enum"] == list(get_args(spec_mod.SpeculativeMethod))
    uri = spec["model"]["properties"]["source"]["properties"]["uri"]
    assert uri["maxLength"] == spec_mod.MAX_URI_LENGTH


HF = {"uri": "hf://org/sql-lora"}
NGRAM = {"method": "ngram"}


# What admission refuses (the CRD's schema and CEL rules: all but the last two were refused by a v1.36.3
# API server when written), and the words parsing refuses it with, for objects that never met one. The
# last two, as the other volume rules, only parsing judges (the CRD keeps volumes open).
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"speculative": {}}, "speculative.method must be ngram or draftModel"),
    ({"speculative": {"method": "eagle"}}, "speculative.method must be ngram or draftModel, got 'eagle'"),
    ({"speculative": {"method": "draftModel"}}, "draftModel is required exactly when method is draftModel"),
    ({"speculative": {"method": "ngram", "draftModel": "/d"}}, "required exactly when method is draftModel"),
    ({"speculative": {"method": "draftModel", "draftModel": "d"}}, "a path the server pod sees"),
    (
        {"speculative": {"method": "draftModel", "draftModel": "/d", "promptLookupMin": 1}},
        "speculative.promptLookupMin is prompt lookup's (method ngram)",
    ),
    ({"speculative": {"method": "ngram", "numSpeculativeTokens": 17}}, "from 1 to 16, got 17"),
    ({"speculative": {"method": "ngram", "numSpeculativeTokens": 0}}, "from 1 to 16, got 0"),
    ({"speculative": NGRAM | {"promptLookupMax": 65}}, "promptLookupMax must be an integer from 1 to 64"),
    ({"speculative": NGRAM | {"promptLookupMin": 5}}, "Min (5) must be at most promptLookupMax (4)"),
    ({"speculative": NGRAM | {"promptLookupMax": 1}}, "Min (2) must be at most promptLookupMax (1)"),
    ({"speculative": {"method": "ngram", "maxBatchTokens": 0}}, "maxBatchTokens must be an integer from 1"),
    ({"speculative": {"method": "ngram", "adaptive": "no"}}, "speculative.adaptive must be true or false"),
    ({"adapters": [{"name": "sql", "source": HF}] * 2}, "adapters[1].name 'sql': another adapter has this"),
    ({"adapters": [{"name": "llama-3.1-8b", "source": HF}]}, "is the served model's name (model.name)"),
    ({"adapters": [{"name": "org/sql", "source": HF}]}, "adapters[0].name 'org/sql': 1-128 letters"),
    ({"adapters": [{"name": "a=b", "source": HF}]}, "adapters[0].name 'a=b'"),
    ({"adapters": [{"name": ".hidden", "source": HF}]}, "starting with a letter or digit"),
    ({"adapters": [{"name": "x", "source": {"uri": "s3://bucket/x.GGUF"}}]}, "a PEFT folder"),
    ({"adapters": [{"name": "x", "source": {"uri": "ftp://host/x"}}]}, "adapters[0].source.uri 'ftp://host/x'"),
    (
        {"adapters": [{"name": "x", "source": {"uri": "hf://a/b", "imagePath": "/a"}}]},
        "adapters[0].source: give exactly one of pvc, hostPath, imagePath or uri",
    ),
    ({"adapters": [{"name": f"a{i}", "source": HF} for i in range(65)]}, "adapters: at most 64, got 65"),
    ({"engine": {"maxLoras": 2}}, "engine.maxLoras: settings of spec.adapters, which has none"),
    ({"adapters": [], "engine": {"maxLoraRank": 8}}, "engine.maxLoraRank: settings of spec.adapters"),
    ({"adapters": [{"name": "x", "source": HF}], "engine": {"maxLoraRank": 513}}, "from 1 to 512, got 513"),
    ({"adapters": [{"name": "x", "source": HF}], "engine": {"maxLoras": 65}}, "from 1 to 64, got 65"),
    (
        {"adapters": [{"name": "x", "source": HF}], "engine": {"maxLoras": 4, "maxCpuLoras": 2}},
        "engine.maxCpuLoras (2) must be at least maxLoras (4)",
    ),
    (
        {"adapters": [{"name": f"a{i}", "source": HF} for i in range(10)], "engine": {"maxCpuLoras": 7}},
        "engine.maxCpuLoras (7) must be at least maxLoras (8)",
    ),
    ({"engine": {"extraArgs": ["--speculative-config={}"]}}, "would override --speculative-config"),
    ({"engine": {"extraArgs": ["--no-enable-lora"]}}, "would override --no-enable-lora"),
    ({"engine": {"extraArgs": ["--max-lora", "4"]}}, "would override --max-loras"),
    ({"env": [{"name": "PAGODA_LORA_MODULES", "value": "a=/b"}]}, "would set --lora-modules"),
    ({"env": [{"name": "PAGODA_SPECULATIVE_CONFIG", "value": "{}"}]}, "would set --speculative-config"),
    ({"pipelineParallelSize": 65}, "pipelineParallelSize must be auto or 1 to 64, got 65"),
    ({"pipelineParallelSize": "x"}, "pipelineParallelSize must be auto or 1 to 64, got 'x'"),
    ({"pipelineParallelSize": 2, "adapters": [{"name": "x", "source": HF}]}, "cannot serve spec.adapters"),
    ({"pipelineParallelSize": 2, "speculative": {"method": "draftModel", "draftModel": "/d"}},
     "pipelineParallelSize above 1 cannot run speculative.method draftModel"),
    ({"engine": {"extraArgs": ["--nnodes=2"]}}, "would override --nnodes"),
    ({"engine": {"extraArgs": ["--head"]}}, "would override --headless"),
    ({"env": [{"name": "PAGODA_NNODES", "value": "2"}]}, "would set --nnodes"),
    ({"volumes": [{"name": "adapter-0", "emptyDir": {}}]}, "adapter-0 is a volume of the operator's"),
    (
        {"volumes": [{"name": "v"}], "volumeMounts": [{"name": "v", "mountPath": "/adapters/x"}]},
        "/adapters/x overlaps a path the operator mounts",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("fragment", "message"), REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_what_admission_refuses_parsing_refuses(fragment: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_spec(_body({"model": IMAGE_MODEL} | fragment))


def test_what_admission_lets_through_parses() -> None:
    """The edges of the same rules: a promptLookupMin raised to the default max, eight default slots
    against eight host slots, a `:` in a name."""
    ok = [
        {"speculative": {"method": "ngram", "promptLookupMin": 4}},
        {"speculative": {"method": "draftModel", "draftModel": "/d", "numSpeculativeTokens": 16}},
        {"adapters": [{"name": f"a{i}", "source": HF} for i in range(10)], "engine": {"maxCpuLoras": 8}},
        {"adapters": [{"name": "ft:gpt-x:org::1", "source": HF}], "engine": {"maxLoras": 64}},
        {"adapters": [{"name": f"a{i}", "source": HF} for i in range(64)]},
        {"adapters": []},
        {"pipelineParallelSize": 2},
        {"pipelineParallelSize": "auto", "adapters": [{"name": "x", "source": HF}]},
        {"pipelineParallelSize": 1, "speculative": {"method": "draftModel", "draftModel": "/d"}},
    ]
    for fragment in ok:
        parse_spec(_body({"model": IMAGE_MODEL} | fragment))
