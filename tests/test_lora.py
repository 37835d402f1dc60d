"""Multi-LoRA serving against transformers + PEFT, token for token (fp32, random checkpoints and random
adapters), and the refusals: what does not fit the model or the limits, and what is not loaded."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pagoda.service.engine.core.lora_slots import LoRASlots
from pagoda.service.llm import LLM, LoRARequest
from pagoda.service.sampling_params import SamplingParams
from tests.test_engine_greedy import random_prompts

NEW_TOKENS = 16
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(base: Path, folder: Path, seed: int, **lora: Any) -> Path:
    """A PEFT LoRA adapter of `base` with random A and B (PEFT starts B at zero: no change at all)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**lora))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapters(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        # Every projection, rank 8; and q/v only, rank 4, rsLoRA's scaling.
        "every": write_adapter(llama_ckpt, root / "every", 1, r=8, lora_alpha=16, target_modules=ALL_MODULES),
        "qv": write_adapter(
            llama_ckpt,
            root / "qv",
            2,
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            use_rslora=True,
        ),
        "too_wide": write_adapter(
            llama_ckpt, root / "too_wide", 3, r=32, lora_alpha=32, target_modules=["q_proj"]
        ),
    }


def _peft_greedy(
    base: Path, adapter: Path | None, prompts: list[list[int]], hf_greedy: Any
) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    return hf_greedy(model, prompts, NEW_TOKENS)


def test_a_mixed_batch_of_two_adapters_and_the_base_equals_peft(
    llama_ckpt: Path, adapters: dict[str, Path], hf_greedy: Any
) -> None:
    """One batch: base-model prompts and prompts under two adapters of different ranks and modules,
    interleaved (so runs of tokens switch adapters inside a step), chunked prefill, then decode;
    greedy output equals transformers + PEFT for each prompt under its own adapter."""
    prompts = random_prompts([5, 19, 8, 33, 12, 3], seed=4)
    kinds: list[str | None] = [None, "every", "qv", "every", None, "qv"]
    expected = {
        kind: _peft_greedy(llama_ckpt, adapters[kind] if kind else None, prompts, hf_greedy)
        for kind in (None, "every", "qv")
    }
    llm = LLM(
        str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=32,
        enable_lora=True, max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    requests = [LoRARequest(k, i, str(adapters[k])) if k else None for i, k in enumerate(kinds, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=requests)]
    assert got == [expected[k][i] for i, k in enumerate(kinds)]
    stats = llm.engine.core.stats()  # per adapter, as pagoda_lora_*_total
    assert stats.lora_requests_total == {"every": 2, "qv": 2}
    tokens = {
        k: sum(len(t) for t, kind in zip(got, kinds, strict=True) if kind == k) for k in ("every", "qv")
    }
    assert stats.lora_generation_tokens_total == tokens
    # The adapters change the output: a base-model engine would not pass.
    assert expected["every"] != expected[None] and expected["qv"] != expected[None]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_an_adapter_is_loaded_at_run_time_then_unloaded(
    llama_ckpt: Path, adapters: dict[str, Path], hf_greedy: Any
) -> None:
    """One slot, two adapters: the second waits for the first's requests, takes its slot, and is
    right; after unloading, a request for it is refused. The prefix cache never serves one adapter's
    blocks to another's request (the same prompt under each)."""
    prompt = random_prompts([40], seed=9)
    llm = LLM(
        str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20, enable_lora=True, max_loras=1,
        max_lora_rank=8,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    every = LoRARequest("every", 1, str(adapters["every"]))
    qv = LoRARequest("qv", 2, str(adapters["qv"]))
    started = time.monotonic()
    got = llm.generate(prompt * 3, params, lora_request=[every, qv, None])
    wall = time.monotonic() - started
    # pagoda_lora_load_seconds_total: each adapter's read and check, inside the call that asked for it
    loads = llm.engine.core.stats().lora_load_seconds_total
    assert set(loads) == {"every", "qv"} and 0 < loads["every"] + loads["qv"] <= wall, (loads, wall)
    assert min(loads.values()) > 0
    assert [o.outputs[0].token_ids for o in got] == [
        _peft_greedy(llama_ckpt, adapters["every"], prompt, hf_greedy)[0],
        _peft_greedy(llama_ckpt, adapters["qv"], prompt, hf_greedy)[0],
        _peft_greedy(llama_ckpt, None, prompt, hf_greedy)[0],
    ]
    assert set(llm.engine.stats().lora_adapters) == {"every", "qv"}
    llm.unload_lora("qv")
    assert set(llm.engine.stats().lora_adapters) == {"every"}
    with pytest.raises(ValueError, match="no LoRA adapter 'qv' is loaded"):
        llm.unload_lora("qv")
    llm.engine.add_request("gone", prompt[0], params, lora_name="qv")
    outputs = llm.engine.step()
    assert [o.request_id for o in outputs] == ["gone"] and outputs[0].finished


def test_unloading_an_adapter_ends_only_its_own_running_requests(
    llama_ckpt: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(
        str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20, enable_lora=True, max_loras=2,
        max_lora_rank=8,
    )  # fmt: skip
    for name in ("every", "qv"):
        assert llm.engine.core.lora_op(name, str(adapters[name])) is None
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for name in ("every", "qv", None):  # "every" sorts before "qv", the base after neither
        llm.engine.add_request(f"r-{name}", [5, 6, 7], params, lora_name=name)
    llm.engine.step()
    llm.unload_lora("qv")
    finals = {}
    for _ in range(20):  # bounded: a request left unfinished fails the test, not the run
        finals |= {o.request_id: o for o in llm.engine.step() if o.finished}
        if not llm.engine.has_unfinished:
            break
    assert not llm.engine.has_unfinished
    assert {r: o.outputs[0].finish_reason for r, o in finals.items()} == {
        "r-every": "length", "r-qv": "error", "r-None": "length",
    }  # fmt: skip
    assert finals["r-qv"].error == "the LoRA adapter 'qv' was unloaded"
    assert [len(finals[r].outputs[0].token_ids) for r in ("r-every", "r-None")] == [6, 6]


def test_stats_count_waiting_requests_and_name_the_running_and_waiting_adapters(
    llama_ckpt: Path, adapters: dict[str, Path]
) -> None:
    """One sequence at a time: the engine's stats (`/metrics`' num_requests_waiting and
    lora_requests_info) count the queued requests and name the adapters running and waiting, the
    base model's requests under none."""
    llm = LLM(
        str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20, enable_lora=True, max_loras=2,
        max_lora_rank=8, max_num_seqs=1,
    )  # fmt: skip
    for name in ("every", "qv"):
        assert llm.engine.core.lora_op(name, str(adapters[name])) is None
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, name in enumerate(("every", "qv", None, "qv")):
        llm.engine.add_request(f"r{i}", [5, 6, 7], params, lora_name=name)
    llm.engine.step()
    stats = llm.engine.core.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 3)
    assert (stats.lora_running, stats.lora_waiting) == (["every"], ["qv"])


def test_adapters_that_do_not_fit_are_refused_with_the_reason(
    llama_ckpt: Path, qwen2_ckpt: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    llm = LLM(
        str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20, enable_lora=True, max_lora_rank=16
    )
    core = llm.engine.core
    assert "rank 32 is above --max-lora-rank 16" in (core.lora_op("wide", str(adapters["too_wide"])) or "")
    assert "no adapter_config.json" in (core.lora_op("none", str(tmp_path)) or "")
    embed = write_adapter(llama_ckpt, tmp_path / "embed", 4, r=4, target_modules=["q_proj", "embed_tokens"])
    assert "embed_tokens" in (core.lora_op("embed", str(embed)) or "")
    # An adapter of a model with other shapes (Qwen2 here has the same sizes: widen one).
    from transformers import LlamaConfig

    other = LlamaConfig.from_pretrained(llama_ckpt)
    other.intermediate_size = 96
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(other).save_pretrained(tmp_path / "other")
    mismatched = write_adapter(
        tmp_path / "other", tmp_path / "mismatched", 5, r=4, target_modules=["up_proj"]
    )
    assert "another model" in (core.lora_op("mismatched", str(mismatched)) or "")
    assert core.lora_op("every", str(adapters["every"])) is None
    assert "already loaded" in (core.lora_op("every", str(adapters["every"])) or "")
    assert set(llm.engine.stats().lora_adapters) == {"every"}
    plain = LLM(str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert "not enabled" in (plain.engine.core.lora_op("every", str(adapters["every"])) or "")


def test_slots_go_to_the_least_recently_used_adapter_no_running_request_holds() -> None:
    slots = LoRASlots(2)
    for name in "abc":
        slots.register(name, f"/{name}")
    assert slots.place("a", set()) == 0 and slots.place("b", {"a"}) == 1
    assert slots.take_loads() == [(0, "a", "/a"), (1, "b", "/b")]
    assert slots.place("c", {"a", "b"}) is None  # both in use
    assert slots.place("a", {"b"}) == 0  # placed already: no load, and now the most recent
    assert slots.place("c", {"b"}) == 0  # a is not in use: it leaves, though b is older
    assert slots.take_loads() == [(0, "c", "/c")]
    assert slots.place("b", {"b", "c"}) == 1  # its own adapter in use is no obstacle
    slots.register("c", "/elsewhere")  # re-pointed: loaded again at its next use
    assert slots.place("c", set()) == 0 and slots.take_loads() == [(0, "c", "/elsewhere")]
    slots.unregister("b")
    assert slots.place("a", {"c"}) == 1 and slots.take_loads() == [(1, "a", "/a")]
    assert slots.slot_loads_total == {"a": 2, "b": 1, "c": 2}
    slots.register("b", "/b")
    assert slots.place("b", {"a"}) == 0  # c is not in use
    slots.unregister("b")  # before the step took its load: the load goes too, and the slot is free
    assert slots.take_loads() == [] and slots.place("c", {"a"}) == 0
    assert slots.take_loads() == [(0, "c", "/elsewhere")]


def test_an_adapter_unloaded_before_its_step_drops_only_its_own_load() -> None:
    slots = LoRASlots(3)
    for name in ("one", "two", "zoo"):
        slots.register(name, f"/{name}")
    assert [slots.place(name, set()) for name in ("one", "two", "zoo")] == [0, 1, 2]
    slots.unregister("".join(["t", "wo"]))  # the API's name: equal, not the same object
    assert slots.take_loads() == [(0, "one", "/one"), (2, "zoo", "/zoo")]  # names both sides of "two"
    assert slots.adapters == {"one": "/one", "zoo": "/zoo"}
    slots.register("ten", "/ten")
    assert slots.place("ten", {"one", "zoo"}) == 1  # its slot is free again


def test_tensor_parallel_adapters_give_the_single_rank_output(
    llama_ckpt: Path, adapters: dict[str, Path]
) -> None:
    """TP 2 (gloo): q/k/v and gate/up keep their rows of B, o and down their columns of A (the shrink
    summed over ranks); with an n = 2 request whose forks share its adapter."""
    prompts = random_prompts([6, 21, 11], seed=5)
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS),
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, n=2),
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS),
    ]
    requests = [
        LoRARequest("every", 1, str(adapters["every"])),
        LoRARequest("qv", 2, str(adapters["qv"])),
        None,
    ]
    common: dict[str, Any] = {
        "dtype": "float32", "kv_cache_memory_bytes": 8 << 20, "enable_lora": True, "max_loras": 2,
        "max_lora_rank": 8,
    }  # fmt: skip
    one = [
        [c.token_ids for c in o.outputs]
        for o in LLM(str(llama_ckpt), **common).generate(prompts, params, requests)
    ]
    with LLM(str(llama_ckpt), tensor_parallel_size=2, **common) as tp2:
        two = [[c.token_ids for c in o.outputs] for o in tp2.generate(prompts, params, requests)]
    assert two == one
    assert one[1][0] == one[1][1]  # greedy forks under one adapter agree


def test_pagoda_serve_adapters_through_the_openai_client(
    llama_ckpt: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """`pagoda serve --enable-lora --lora-modules`: /v1/models lists the base and each adapter with its
    parent; a completion naming an adapter is the offline engine's under it; an adapter loaded at run
    time serves, a bad one is a 400 saying why, an unloaded one a 404."""
    import grpc
    import httpx
    import openai

    from pagoda.service.grpc_gen import inference_pb2 as pb
    from pagoda.service.grpc_gen import inference_pb2_grpc as pb_grpc
    from pagoda.service.serve_process import ServeProcess

    prompt = random_prompts([13], seed=6)[0]
    offline = LLM(
        str(llama_ckpt),
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    expected = {
        name: offline.generate([prompt], greedy, LoRARequest(name, 1, str(adapters[name])))[0].outputs[0].text
        for name in ("every", "qv")
    }
    args = [
        "--model", str(llama_ckpt), "--served-model-name", "tiny", "--kv-cache-memory-bytes", str(8 << 20),
        "--enable-lora", "--lora-modules", f"every={adapters['every']}", "--max-loras", "2",
        "--max-lora-rank", "8",
    ]  # fmt: skip
    with ServeProcess(args, log_path=tmp_path / "serve.log") as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"tiny", "every"}
        assert models["every"].model_extra == {
            "max_model_len": models["tiny"].model_extra["max_model_len"],  # type: ignore[index]
            "root": str(adapters["every"]),
            "parent": "tiny",
        }
        done = client.completions.create(model="every", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        assert done.model == "every" and done.choices[0].text == expected["every"]
        with grpc.insecure_channel(server.grpc_target) as channel:  # gRPC names the adapter the same way
            stub = pb_grpc.InferenceStub(channel)
            sampling = pb.SamplingParameters(temperature=0.0, max_new_tokens=NEW_TOKENS)
            request = pb.GenerateRequest(model="every", token_ids=pb.TokenIds(ids=prompt), sampling=sampling)
            responses = list(stub.Generate(request, timeout=60))
            assert "".join(r.text for r in responses) == expected["every"]
            grpc_tokens = sum(len(r.token_ids) for r in responses)
            with pytest.raises(grpc.RpcError) as missing:
                list(stub.Generate(pb.GenerateRequest(model="nope", text="x", sampling=sampling), timeout=60))
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND

        base = server.base_url
        refused = httpx.post(
            f"{base}/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(adapters["too_wide"])}
        )
        assert refused.status_code == 400 and "rank 32 is above --max-lora-rank 8" in refused.text
        loaded = httpx.post(
            f"{base}/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": str(adapters["qv"])}
        )
        assert loaded.status_code == 200, loaded.text
        stream = client.completions.create(
            model="qv", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected["qv"]

        assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 200
        gone = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "qv"})
        assert gone.status_code == 404 and "no LoRA adapter 'qv'" in gone.text
        with pytest.raises(openai.NotFoundError, match="'qv' does not exist"):
            client.completions.create(model="qv", prompt=prompt, max_tokens=4)
        assert {m.id for m in client.models.list().data} == {"tiny", "every"}
        metrics = httpx.get(f"{base}/metrics").text

    def series(name: str, adapter: str) -> float:
        found = re.search(rf'^{name}{{lora_name="{adapter}",model_name="tiny"}} (\S+)$', metrics, re.M)
        assert found is not None, (name, adapter, metrics)
        return float(found.group(1))

    assert series("pagoda_lora_requests_total", "every") == 2  # HTTP and gRPC
    assert series("pagoda_lora_requests_total", "qv") == 1
    assert done.usage is not None
    assert (
        series("pagoda_lora_generation_tokens_total", "every") == done.usage.completion_tokens + grpc_tokens
    )
    assert series("pagoda_lora_loads_total", "qv") == 1 and series("pagoda_lora_load_seconds_total", "qv") > 0
    assert series("pagoda_lora_slot_loads_total", "qv") == 1
    assert re.search(
        r'^vllm:lora_requests_info\{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""\} ',
        metrics,
        re.M,
    )


def test_graph_steps_with_adapters_give_the_eager_outputs(
    llama_ckpt: Path, adapters: dict[str, Path]
) -> None:
    """The CUDA-graph paths with LoRA slots, on the CPU (`StepGraphs(capture=False)`: the same padded
    forward over the same static buffers as a replay): each token's slot is a static input, padding
    has none, and both ladders give the eager engine's output."""
    from pagoda.service.engine.config import EngineConfig, LoRAConfig
    from pagoda.service.engine.llm_engine import LLMEngine
    from pagoda.service.engine.runner.cuda_graphs import StepGraphs

    config = EngineConfig(
        model=str(llama_ckpt), dtype="float32", max_num_batched_tokens=160, max_num_seqs=16,
        kv_cache_memory_bytes=8 << 20, lora=LoRAConfig((), max_loras=2, max_lora_rank=8),
    )  # fmt: skip
    prompts = random_prompts([9, 140, 3, 60, 27, 1, 88, 14], seed=8)
    names = ["every", None, "qv", "every", "qv", None, "every", "qv"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(engine: LLMEngine) -> dict[str, list[int]]:
        for name in ("every", "qv"):
            assert engine.core.lora_op(name, str(adapters[name])) is None
        finals: dict[str, list[int]] = {}
        pending = list(enumerate(zip(prompts, names, strict=True)))
        while pending or engine.has_unfinished:
            for _ in range(2):
                if pending:
                    i, (prompt, name) = pending.pop(0)
                    engine.add_request(f"r{i}", prompt, params, lora_name=name)
            finals.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        return finals

    expected = run(LLMEngine(config))
    engine = LLMEngine(config)
    runner = engine.runner.runner
    assert runner.lora is not None
    runner.graphs = StepGraphs(
        runner.model, runner.device, config.max_num_seqs, config.max_num_batched_tokens, runner.max_model_len,
        config.block_size, capture=False, lora=runner.lora.batch,
    )  # fmt: skip
    assert run(engine) == expected


def test_pagoda_bench_lora_table(llama_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pagoda bench lora` on the CPU: its adapters (written without PEFT) load, and each batch gets a
    row with the base and the adapters' rates; `--busy-steps` profiles steady steps of each batch, the
    base's requests and the adapters' (each profiled request counted under its adapter)."""
    from pagoda.bench import offline

    profiled: list[dict[str, int]] = []
    real_busy = offline.decode_busy

    def busy(llm: Any, *args: Any) -> tuple[float, float, float]:
        before = dict(llm.engine.core.stats().lora_requests_total)
        got = real_busy(llm, *args)
        after = llm.engine.core.stats().lora_requests_total
        profiled.append(
            {name: n - before.get(name, 0) for name, n in after.items() if n > before.get(name, 0)}
        )
        return got

    monkeypatch.setattr(offline, "decode_busy", busy)
    out = tmp_path / "lora.md"
    args = ["lora", "--model", str(llama_ckpt), "--dtype", "float32", "--num-adapters", "3", "--rank", "4"]
    args += ["--batches", "1,5", "--input-len", "8", "--output-len", "4", "--busy-steps", "3"]
    assert offline.main([*args, "--output", str(out)]) == 0
    lines = out.read_text().splitlines()
    rows = [line for line in lines if line.startswith("| ") and line[2].isdigit() and line.count("|") == 5]
    busy_rows = [line.split(" | ")[:2] for line in lines if line.startswith("| ") and line.count("|") == 6]
    assert busy_rows[2:] == [["| 1", "none"], ["| 1", "1 of rank 4"], ["| 5", "none"], ["| 5", "3 of rank 4"]]
    assert profiled == [{}, {"a0": 1}, {}, {"a0": 2, "a1": 2, "a2": 1}]
    assert [row.split(" | ")[0] for row in rows] == ["| 1", "| 5"]
    for row in rows:
        base, adapted, ratio = (float(cell) for cell in row.strip("| ").split(" | ")[1:])
        assert base > 0 and adapted > 0 and ratio == pytest.approx(adapted / base, rel=0.02)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_adapters_under_speculative_decoding_give_the_same_greedy_output(
    llama_ckpt: Path, adapters: dict[str, Path], method: str
) -> None:
    """Drafts verified under each sequence's adapter, beside the base model's: the same tokens as
    without speculation. A draft model drafts without the adapters (the base as its own draft here),
    so it is kept less often, never wrongly."""
    spec: dict[str, Any] = {"num_speculative_tokens": 3, "adaptive": False}
    spec |= (
        {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        if method == "ngram"
        else {"model": str(llama_ckpt)}
    )
    common: dict[str, Any] = {
        "dtype": "float32", "kv_cache_memory_bytes": 8 << 20, "enable_lora": True, "max_loras": 2,
        "max_lora_rank": 8,
    }  # fmt: skip
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6, [12, 13] * 8]
    kinds = ["every", None, "qv"]
    requests = [LoRARequest(k, i, str(adapters[k])) if k else None for i, k in enumerate(kinds, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = LLM(str(llama_ckpt), **common).generate(prompts, params, lora_request=requests)
    llm = LLM(str(llama_ckpt), speculative_config=spec, **common)
    got = llm.generate(prompts, params, lora_request=requests)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.core.stats()
    assert stats.spec_num_accepted_tokens_total > 0  # drafts were made and kept
    assert stats.spec_num_draft_tokens_total > stats.spec_num_accepted_tokens_total  # and some refused


def test_the_warm_up_runs_its_prompts_through_an_adapter_slot_and_leaves_none_active(
    llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With adapters on, the warm-up (a GPU's, called here by hand) runs its prompt batches a second time
    through slot 0, over runs of tokens (LoRA's SGMV kernels, which a first adapter prompt would
    otherwise compile inside its step); slot 0 still holds zeros, and no adapter is active after it:
    greedy tokens are those of an engine without the warm-up."""
    from pagoda import kernels
    from pagoda.service.engine.runner.model_runner import warm_up_query_lens

    prompt = random_prompts([20], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    common = {"dtype": "float32", "kv_cache_memory_bytes": 8 << 20, "max_num_batched_tokens": 64}
    want = LLM(str(llama_ckpt), enable_lora=True, **common).generate(prompt, params)[0].outputs[0].token_ids
    llm = LLM(str(llama_ckpt), enable_lora=True, **common)
    runner = llm.engine.core.executor.runner
    shrinks: list[tuple[bool, list[int]]] = []
    real = kernels.lora_shrink

    def recorded(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, segments: Any = None) -> Any:
        shrinks.append((segments is not None, token_slots.unique().tolist()))
        return real(x, a, token_slots, segments)

    monkeypatch.setattr(kernels, "lora_shrink", recorded)
    runner._warm_up()
    layers = len(runner.model.model.layers)
    batches = len(warm_up_query_lens(64))  # [64], [16], [32], 4 x [16], [1, 1, 17]
    assert batches == 5 and len(shrinks) == 4 * layers * batches  # qkv, o, gate_up, down a layer
    assert all(runs and slots == [0] for runs, slots in shrinks)
    assert not runner.lora.batch.active and not len(runner.lora.token_slots)
    assert all(
        not layer.a[0].any() and not layer.b[0].any() for d in runner.lora.layers for layer in d.values()
    )
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == want
    assert len(shrinks) == 4 * layers * batches  # no adapter: the shrink ran no more
