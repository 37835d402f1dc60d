"""Profile selection as a table: model x GPUs -> precision, TP, or the reason nothing fits."""

from __future__ import annotations

import json

import pytest

from pagoda.cli import main
from pagoda.operator.catalogue import catalogue_key, parse_num_params, resolve
from pagoda.operator.gpus import base_product, gpu_groups, is_schedulable, matches_product
from pagoda.operator.profile import GpuPreference, ProfileRequest, select_profile

# product label, compute capability, memory MiB, GPUs per node: what GPU Feature Discovery reports.
CATALOGUE = {
    "H200": ("NVIDIA-H200", (9, 0), 143771, 8),
    "H100": ("NVIDIA-H100-80GB-HBM3", (9, 0), 81559, 8),
    "A100-80": ("NVIDIA-A100-SXM4-80GB", (8, 0), 81920, 4),
    "A100-40": ("NVIDIA-A100-SXM4-40GB", (8, 0), 40960, 8),
    "L40S": ("NVIDIA-L40S", (8, 9), 46068, 4),
    "L4": ("NVIDIA-L4", (8, 9), 23034, 1),
    "T4": ("Tesla-T4", (7, 5), 15360, 1),
    "B200": ("NVIDIA-B200", (10, 0), 183359, 8),
}


def node(
    kind: str,
    name: str | None = None,
    *,
    product: str | None = None,
    allocatable: int | None = None,
    taints: list | None = None,
    labels: dict | None = None,
) -> dict:
    default_product, (major, minor), memory, count = CATALOGUE[kind]
    return {
        "metadata": {
            "name": name or f"gpu-{kind.lower()}",
            "labels": {
                "nvidia.com/gpu.product": product or default_product,
                "nvidia.com/gpu.family": "whatever",  # never read: cc is the key
                "nvidia.com/gpu.compute.major": str(major),
                "nvidia.com/gpu.compute.minor": str(minor),
                "nvidia.com/gpu.memory": str(memory),
                "nvidia.com/gpu.count": str(count),
                **(labels or {}),
            },
        },
        "spec": {"taints": taints or []},
        "status": {
            "allocatable": {"nvidia.com/gpu": str(count if allocatable is None else allocatable)},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


CPU_NODE = {"metadata": {"name": "cpu", "labels": {}}, "status": {"allocatable": {"cpu": "8"}}}
ALL = [node(kind) for kind in CATALOGUE if kind != "B200"] + [CPU_NODE]


def decide(model: str, nodes: list[dict], **kwargs):
    return select_profile(ProfileRequest(resolve(model), **kwargs), gpu_groups(nodes))


@pytest.mark.parametrize(
    ("model", "kinds", "precision", "want"),
    [
        # Llama-3.1-8B: fp8 TP 1 where cc >= 8.9, bf16 on Ampere, does not fit one T4 at fp16.
        ("llama-3.1-8b", ["H200"], "auto", ("NVIDIA-H200", "fp8", 1)),
        ("llama-3.1-8b", ["H100"], "auto", ("NVIDIA-H100-80GB-HBM3", "fp8", 1)),
        ("llama-3.1-8b", ["A100-80"], "auto", ("NVIDIA-A100-SXM4-80GB", "bf16", 1)),
        ("llama-3.1-8b", ["A100-40"], "auto", ("NVIDIA-A100-SXM4-40GB", "bf16", 1)),
        ("llama-3.1-8b", ["L40S"], "auto", ("NVIDIA-L40S", "fp8", 1)),
        ("llama-3.1-8b", ["L4"], "auto", ("NVIDIA-L4", "fp8", 1)),
        ("llama-3.1-8b", ["B200"], "auto", ("NVIDIA-B200", "fp8", 1)),
        ("llama-3.1-8b", ["T4"], "auto", "8B fp16 needs 2 x 15 GiB; largest node has 1 x 15 GiB"),
        ("llama-3.1-8b", ["H100"], "bf16", ("NVIDIA-H100-80GB-HBM3", "bf16", 1)),
        # Small models fit a T4 in fp16.
        ("llama-3.2-3b", ["T4"], "auto", ("Tesla-T4", "fp16", 1)),
        ("llama-3.2-1b", ["T4"], "auto", ("Tesla-T4", "fp16", 1)),
        ("llama-3.2-1b", ["T4"], "bf16", "bf16 needs compute capability >= 8.0; the newest GPU is Tesla-T4"),
        # 70B: bf16 needs TP 4 on 80 GB parts, fp8 TP 2; one H200 holds it in fp8.
        ("llama-3.1-70b", ["H100"], "bf16", ("NVIDIA-H100-80GB-HBM3", "bf16", 4)),
        ("llama-3.1-70b", ["H100"], "auto", ("NVIDIA-H100-80GB-HBM3", "fp8", 2)),
        ("llama-3.1-70b", ["H200"], "bf16", ("NVIDIA-H200", "bf16", 2)),
        ("llama-3.1-70b", ["H200"], "auto", ("NVIDIA-H200", "fp8", 1)),
        ("llama-3.1-70b", ["A100-80"], "auto", ("NVIDIA-A100-SXM4-80GB", "bf16", 4)),
        ("llama-3.1-70b", ["A100-40"], "auto", ("NVIDIA-A100-SXM4-40GB", "bf16", 8)),
        ("llama-3.1-70b", ["L4"], "bf16", "70B bf16 needs 8 x 22 GiB; largest node has 1 x 22 GiB"),
        ("llama-3.1-70b", ["L4", "T4"], "auto", "70B fp8 needs 4 x 22 GiB; largest node has 1 x 22 GiB"),
        ("llama-3.1-405b", ["H100"], "bf16", "405B bf16 needs 832 GiB, more than 8 x 80 GiB"),
        ("llama-3.1-405b", ["H100"], "auto", ("NVIDIA-H100-80GB-HBM3", "fp8", 8)),
        # No preference: fewest GPUs, then newest compute capability, then most memory.
        ("llama-3.1-8b", list(CATALOGUE)[:-1], "auto", ("NVIDIA-H200", "fp8", 1)),
        ("llama-3.1-70b", ["H100", "A100-80", "L40S"], "bf16", ("NVIDIA-H100-80GB-HBM3", "bf16", 4)),
        ("llama-3.1-8b", [], "auto", "no schedulable GPU nodes"),
        ("llama-3.1-8b", ["T4"], "fp8", "fp8 needs compute capability >= 8.9; the newest GPU is Tesla-T4"),
    ],
)
def test_profile_table(model: str, kinds: list[str], precision: str, want: tuple | str) -> None:
    decision = decide(model, [node(k) for k in kinds] + [CPU_NODE], precision=precision)
    if isinstance(want, str):
        assert not decision.is_selected
        assert want in decision.reason
        return
    assert decision.is_selected, decision.reason
    assert decision.gpu is not None
    assert (decision.gpu.product, decision.precision, decision.tensor_parallel_size) == want


def test_preferences_are_followed_in_order() -> None:
    prefs = (
        GpuPreference("B200"),  # none in this cluster
        GpuPreference("A100", tensor_parallel_size=2),
        GpuPreference("L40S", precision="fp8"),
    )
    decision = decide("llama-3.1-8b", ALL, preferences=prefs)
    assert decision.gpu is not None
    # Both A100 groups fit at TP 2; the one with more memory wins the tie.
    assert (decision.gpu.product, decision.precision, decision.tensor_parallel_size) == (
        "NVIDIA-A100-SXM4-80GB",
        "bf16",
        2,
    )
    assert "preference 2" in decision.reason
    assert [r.candidate for r in decision.rejected] == ["B200"]


def test_preference_skips_what_does_not_fit_and_explains() -> None:
    prefs = (GpuPreference("L4"), GpuPreference("T4"), GpuPreference("L40S", precision="fp8"))
    decision = decide("llama-3.1-70b", ALL, preferences=prefs)
    assert decision.gpu is not None
    assert (decision.gpu.product, decision.precision, decision.tensor_parallel_size) == (
        "NVIDIA-L40S",
        "fp8",
        2,
    )
    reasons = {r.candidate: r.reason for r in decision.rejected}
    assert "does not fit 1 x NVIDIA-L4" in reasons["1 x NVIDIA-L4 (22 GiB, cc 8.9)"]
    assert "does not fit 1 x Tesla-T4" in reasons["1 x Tesla-T4 (15 GiB, cc 7.5)"]


def test_fixed_tp_and_precision() -> None:
    d = decide("llama-3.1-8b", [node("H100")], tensor_parallel_size=2, precision="bf16")
    assert (d.precision, d.tensor_parallel_size) == ("bf16", 2)
    d = decide("llama-3.1-8b", [node("L4")], tensor_parallel_size=2)
    assert not d.is_selected
    assert "TP 2 needs 2 GPUs in one node; these have 1" in d.rejected[0].reason
    d = decide("qwen2.5-7b", [node("H100")], tensor_parallel_size=8)  # 28 heads
    assert "does not divide the model's 28 attention heads" in d.rejected[0].reason


def test_long_context_reserves_one_full_sequence() -> None:
    # 8B bf16 on one L4: 32768 tokens of KV fit, one 131072-token sequence (16 GiB) does not.
    assert decide("llama-3.1-8b", [node("L4")], precision="bf16").is_selected
    d = decide("llama-3.1-8b", [node("L4")], precision="bf16", max_model_len=131072)
    assert not d.is_selected


@pytest.mark.parametrize(
    "product",
    ["NVIDIA-A100-SXM4-40GB-SHARED", "NVIDIA-A100-SXM4-40GB-MIG-3g.20gb", "NVIDIA-A100-SXM4-40GB"],
)
def test_product_suffixes_are_tolerated(product: str) -> None:
    groups = gpu_groups([node("A100-40", product=product, allocatable=16 if "SHARED" in product else None)])
    assert len(groups) == 1
    assert groups[0].product == "NVIDIA-A100-SXM4-40GB"
    assert groups[0].labels == (product,)  # node affinity matches the raw label
    assert groups[0].num_gpus == 8  # time-slicing replicas are not GPUs
    d = select_profile(ProfileRequest(resolve("llama-3.1-8b"), preferences=(GpuPreference("A100"),)), groups)
    assert d.is_selected


def test_product_matching_is_token_wise() -> None:
    assert matches_product("NVIDIA-H100-80GB-HBM3", "H100")
    assert matches_product("NVIDIA-A100-SXM4-80GB-MIG-1g.10gb", "a100-80gb")
    assert not matches_product("NVIDIA-A100-SXM4-80GB", "A10")
    assert base_product("NVIDIA-H100-80GB-HBM3-SHARED") == "NVIDIA-H100-80GB-HBM3"


def test_unschedulable_nodes_are_not_candidates() -> None:
    cordoned = node("H200", "cordoned")
    cordoned["spec"]["unschedulable"] = True
    tainted = node(
        "H100", "tainted", taints=[{"key": "dedicated", "value": "training", "effect": "NoSchedule"}]
    )
    gpu_tainted = node("L4", "gpu-tainted", taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}])
    assert [g.product for g in gpu_groups([cordoned, tainted, gpu_tainted])] == ["NVIDIA-L4"]
    toleration = {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"}
    assert is_schedulable(tainted, [toleration])
    assert [g.product for g in gpu_groups([tainted], tolerations=[toleration])] == ["NVIDIA-H100-80GB-HBM3"]


def test_node_selector_narrows_candidates() -> None:
    nodes = [node("H100", labels={"pool": "a"}), node("L4", labels={"pool": "b"})]
    assert [g.product for g in gpu_groups(nodes, node_selector={"pool": "b"})] == ["NVIDIA-L4"]


def test_catalogue_names_and_sizes() -> None:
    assert catalogue_key("meta-llama/Llama-3.1-8B-Instruct") == "llama-3.1-8b"
    assert parse_num_params("135M") == 135_000_000
    assert parse_num_params("1.5B") == 1_500_000_000
    custom = resolve("my-org/custom-model", "13B")
    assert (custom.num_params, custom.size_label, custom.num_attention_heads) == (13_000_000_000, "13B", 0)
    with pytest.raises(ValueError, match="not in the built-in catalogue"):
        resolve("my-org/custom-model")
    with pytest.raises(ValueError, match="expected a parameter count"):
        parse_num_params("lots")


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["profile", "--model", "llama-3.1-70b", "--gpu", "NVIDIA-H100-80GB-HBM3", "--count", "8"])
    assert rc == 0
    assert "tp         2" in capsys.readouterr().out
    rc = main(["profile", "--model", "llama-3.1-8b", "--gpu", "T4", "--output", "json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert out["selected"] is False
    assert out["reason"].startswith("8B fp16 needs 2 x 15 GiB")
    assert out["rejected"]
    rc = main(["profile", "--model", "x", "--parameters", "7B", "--gpu", "RTX-9999", "--output", "json"])
    assert rc == 2
    rc = main(
        ["profile", "--model", "x", "--parameters", "7B", "--gpu", "RTX-9999", "--compute-capability", "8.9"]
    )
    assert rc == 2
    args = ["--compute-capability", "8.9", "--memory-mib", "24564", "--output", "json"]
    rc = main(["profile", "--model", "x", "--parameters", "7B", "--gpu", "RTX-9999", *args])
    assert rc == 0
    decision = json.loads(capsys.readouterr().out)
    # The server's fp8 quantizes the projections only: its KV cache stays 16-bit, and is sized so.
    assert decision["precision"] == "fp8" and decision["kvCacheDtype"] == "bf16"


def test_an_fp8_kv_cache_is_reported_and_sized_at_one_byte(capsys: pytest.CaptureFixture[str]) -> None:
    """engine.kvCacheDtype fp8 (`--kv-cache-dtype fp8`): status.profile says so, and the KV reserve halves."""
    assert decide("llama-3.1-8b", [node("H100")]).kv_cache_dtype == "bf16"
    d = decide("llama-3.1-8b", [node("H100")], kv_cache_dtype="fp8")
    assert d.to_dict()["kvCacheDtype"] == "fp8" and "2.0 GiB KV reserve" in d.reason
    # 128k tokens of bf16 KV do not fit one L4 beside the fp8 weights; of fp8 KV they do.
    assert not decide("llama-3.1-8b", [node("L4")], max_model_len=131072).is_selected
    d = decide("llama-3.1-8b", [node("L4")], max_model_len=131072, kv_cache_dtype="fp8")
    assert (d.precision, d.tensor_parallel_size, d.kv_cache_dtype) == ("fp8", 1, "fp8")
    rc = main(
        ["profile", "--model", "llama-3.1-8b", "--gpu", "L4", "--kv-cache-dtype", "fp8", "--output", "json"]
    )
    assert rc == 0 and json.loads(capsys.readouterr().out)["kvCacheDtype"] == "fp8"
    # Before Ada there is no e4m3 in hardware: the A100 is rejected with the reason, the H100 taken.
    assert not decide("llama-3.1-8b", [node("A100-80")], kv_cache_dtype="fp8").is_selected
    d = decide("llama-3.1-8b", [node("A100-80"), node("H100")], kv_cache_dtype="fp8")
    assert d.gpu is not None and "H100" in d.gpu.product
    assert any("fp8 KV cache needs compute capability" in r.reason for r in d.rejected)


def test_nothing_fits_explains_the_preferred_gpus() -> None:
    d = decide("llama-3.1-8b", ALL, preferences=(GpuPreference("T4"),))
    assert d.reason == (
        "8B fp16 needs 2 x 15 GiB; largest node has 1 x 15 GiB (Tesla-T4); over several nodes: "
        "1 x Tesla-T4 (15 GiB, cc 7.5): 8B fp16 TP 1 x PP 2 needs 2 pods of 1 GPU; 1 node of 1 x Tesla-T4 "
        "has room for 1"
    )
    d = decide("llama-3.1-8b", ALL, preferences=(GpuPreference("B200"), GpuPreference("GB200")))
    assert d.reason == "no schedulable node has a preferred GPU (B200, GB200)"


def test_int8_is_not_offered(capsys: pytest.CaptureFixture[str]) -> None:
    """The engine has no int8 kernels, so neither the table nor `pagoda profile` offers int8."""
    with pytest.raises(SystemExit):
        main(["profile", "--model", "llama-3.1-8b", "--gpu", "T4", "--precision", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    for model in ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b"):
        for precision in ("auto", "bf16", "fp16", "fp8"):
            d = decide(model, ALL, precision=precision)
            assert d.precision != "int8" and d.kv_cache_dtype in (None, "bf16", "fp16")


# Capacity and stability: (model, nodes as (kind, name, GPUs in use by others), current, want).
# `current` is what runs now (spec unchanged); want is (node, precision, TP) or the words of the reason.
CAPACITY = [
    # Free capacity decides: the H200 node is full, so the 8B goes to the H100 node.
    ("llama-3.1-8b", [("H200", "h200", 8), ("H100", "h100", 0)], None, ("h100", "fp8", 1)),
    # Partly used: 7 of 8 in use still leaves one GPU for TP 1.
    ("llama-3.1-8b", [("H200", "h200", 7), ("H100", "h100", 0)], None, ("h200", "fp8", 1)),
    # The 70B fp8 needs TP 2 on H100: one free GPU on each of two nodes is not two on one node.
    ("llama-3.1-70b", [("H100", "a", 7), ("H100", "b", 7)], None, "TP 2 needs 2 free GPUs on one node"),
    # Hysteresis: a running H100 profile stays although the (better-ranked) H200 is free.
    ("llama-3.1-8b", [("H200", "h200", 0), ("H100", "h100", 0)], ("NVIDIA-H100-80GB-HBM3", "fp8", 1),
     ("h100", "fp8", 1)),
    # ... but not when its GPUs are taken by others: then the free H200 is chosen.
    ("llama-3.1-8b", [("H200", "h200", 0), ("H100", "h100", 8)], ("NVIDIA-H100-80GB-HBM3", "fp8", 1),
     ("h200", "fp8", 1)),
    # ... nor when its product is gone (cordoned nodes are not in the groups at all).
    ("llama-3.1-8b", [("H100", "h100", 0)], ("NVIDIA-H200", "fp8", 1), ("h100", "fp8", 1)),
    # Nothing free anywhere: each candidate says so.
    ("llama-3.1-8b", [("L4", "l4", 1), ("T4", "t4", 1)], None, "NVIDIA-L4 (22 GiB, cc 8.9): 8B fp8 TP 1"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "nodes", "current", "want"), CAPACITY)
def test_capacity_and_stability_table(
    model: str, nodes: list, current: tuple | None, want: tuple | str
) -> None:
    from pagoda.operator.profile import CurrentProfile

    used = {name: n for _, name, n in nodes}
    groups = gpu_groups([node(kind, name) for kind, name, _ in nodes], used=used)
    d = select_profile(ProfileRequest(resolve(model)), groups, CurrentProfile(*current) if current else None)
    if isinstance(want, str):
        assert not d.is_selected and want in d.reason, d.reason
        return
    assert d.is_selected, d.reason
    assert (
        d.gpu is not None
        and (d.gpu.node_names[0] if len(d.gpu.node_names) == 1 else d.gpu.node_names) == want[0]
    )
    assert (d.precision, d.tensor_parallel_size) == want[1:]


@pytest.mark.parametrize(
    ("precision", "preferences", "says"),
    [
        ("auto", (), "fp8 (auto: compute capability 9.0)"),
        ("fp8", (), "fp8 (requested)"),
        # A preference naming the precision for this GPU is a request; one for another GPU is not.
        ("auto", (GpuPreference("H100", "fp8"),), "fp8 (requested)"),
        (
            "auto",
            (GpuPreference("H200", "bf16"), GpuPreference("H100")),
            "fp8 (auto: compute capability 9.0)",
        ),
    ],
)
def test_a_kept_profile_says_how_its_precision_was_chosen(
    precision: str, preferences: tuple, says: str
) -> None:
    """A kept profile is evaluated with its precision as a preference; it was chosen as the spec said."""
    from pagoda.operator.profile import CurrentProfile

    groups = gpu_groups([node("H200", "h200"), node("H100", "h100")], used={})
    request = ProfileRequest(resolve("llama-3.1-8b"), precision=precision, preferences=preferences)  # type: ignore[arg-type]
    d = select_profile(request, groups, CurrentProfile("NVIDIA-H100-80GB-HBM3", "fp8", 1))
    assert d.is_selected and d.gpu is not None and d.gpu.node_names == ("h100",), d.reason
    assert f"8B {says}, TP 1" in d.reason and d.reason.endswith("kept: the current profile still fits"), (
        d.reason
    )


def test_a_fixed_tp_that_no_node_has_says_so_at_the_top() -> None:
    d = decide("llama-3.1-8b", [node("L4")], tensor_parallel_size=8)
    assert not d.is_selected
    assert (
        d.reason == "no GPU fits: 1 x NVIDIA-L4 (22 GiB, cc 8.9): TP 8 needs 8 GPUs in one node; these have 1"
    )


def test_excluded_gpu_nodes_are_not_called_unlabelled() -> None:
    from pagoda.operator.gpus import why_no_gpu_nodes

    cordoned = node("H200", "cordoned", labels={"pool": "b"})
    cordoned["spec"]["unschedulable"] = True
    nodes = [cordoned, node("H100", labels={"pool": "a"})]
    assert why_no_gpu_nodes(nodes, {"pool": "b"}) == (
        "no schedulable GPU nodes: 2 GPU nodes, 1 excluded by the nodeSelector, "
        "1 cordoned, not ready or tainted without a toleration"
    )
    assert (
        why_no_gpu_nodes([CPU_NODE]) == "no schedulable GPU nodes (none has the nvidia.com/gpu.product label)"
    )


def test_requested_gpus_count_bound_unfinished_pods() -> None:
    from pagoda.operator.gpus import requested_gpus

    def pod(node: str | None, gpus: str, phase: str = "Running", init: str = "0") -> dict:
        res = {"limits": {"nvidia.com/gpu": gpus}}
        spec = {"nodeName": node, "containers": [{"resources": res}, {"resources": {}}],
                "initContainers": [{"resources": {"requests": {"nvidia.com/gpu": init}}}]}  # fmt: skip
        return {"spec": spec, "status": {"phase": phase}}

    pods = [pod("a", "2"), pod("a", "1"), pod("b", "4", "Succeeded"), pod(None, "8"), pod("c", "1", init="3")]
    assert requested_gpus(pods) == {"a": 3, "c": 3}


@pytest.mark.parametrize(
    ("model", "kinds", "kwargs", "used", "cause"),
    [
        ("llama-3.1-8b", ["H100"], {}, 0, None),
        ("llama-3.1-8b", [], {}, 0, "NoGpuNodes"),
        ("llama-3.1-8b", ["T4"], {}, 0, "Memory"),
        ("llama-3.1-405b", ["H100"], {"precision": "bf16"}, 0, "Memory"),
        ("llama-3.2-1b", ["T4"], {"precision": "bf16"}, 0, "ComputeCapability"),
        ("llama-3.1-8b", ["H100"], {"preferences": (GpuPreference("B200"),)}, 0, "NoPreferredGpu"),
        ("llama-3.1-8b", ["L4"], {"tensor_parallel_size": 8}, 0, "TensorParallel"),
        ("qwen2.5-7b", ["H100"], {"tensor_parallel_size": 8}, 0, "TensorParallel"),
        ("llama-3.1-70b", ["H100"], {}, 7, "Capacity"),
        # Busy L4s and T4s too small: the candidate nearest to fitting (the L4, busy) names the cause.
        ("llama-3.1-8b", ["L4", "T4"], {}, 1, "Capacity"),
    ],
)
def test_every_refusal_names_its_cause(model: str, kinds: list, kwargs: dict, used: int, cause: str) -> None:
    """The closed set the operator's metrics label by: Decision.reason stays the words for people."""
    nodes = [node(k) for k in kinds]
    groups = gpu_groups(nodes, used={n["metadata"]["name"]: used for n in nodes})
    d = select_profile(ProfileRequest(resolve(model), **kwargs), groups)
    assert d.is_selected == (cause is None), d.reason
    assert d.cause == cause, d.reason


def test_a_reason_states_sizes_how_the_precision_was_chosen_and_which_preference() -> None:
    from pagoda.operator.profile import GIB, KV_RESERVE_TOKENS

    shape = resolve("llama-3.1-8b")
    weights = shape.num_params  # fp8: one byte a parameter
    kv = max(shape.kv_bytes_per_token(2) * KV_RESERVE_TOKENS, 0.10 * weights)  # a 16-bit KV cache
    sizes = f"{weights / GIB:.1f} GiB weights + {kv / GIB:.1f} GiB KV reserve"
    auto = decide("llama-3.1-8b", [node("H100")])
    assert (
        auto.reason
        == f"8B fp8 (auto: compute capability 9.0), TP 1: {sizes} fits 1 x NVIDIA-H100-80GB-HBM3 (80 GiB)"
    )
    assert "fp8 (requested), TP 1" in decide("llama-3.1-8b", [node("H100")], precision="fp8").reason
    preferred = decide("llama-3.1-8b", [node("H100"), node("L40S")], preferences=(GpuPreference("L40S"),))
    assert preferred.reason.endswith("; preference 1: L40S"), preferred.reason


def test_the_kv_cache_keeps_the_precisions_16_bit_type_unless_fp8_is_asked() -> None:
    from pagoda.operator.profile import kv_cache_dtype

    assert [kv_cache_dtype(p) for p in ("fp16", "bf16", "fp8", "fp32")] == ["fp16", "bf16", "bf16", "bf16"]
    assert kv_cache_dtype("fp16", "fp8") == "fp8"


def test_among_fitting_groups_the_newer_minor_capability_ranks_first_and_the_others_are_named() -> None:
    """Same TP and major capability: 8.9 before 8.6; every other fitting group is a rejection saying so."""
    ampere = node("L40S", "a6000", product="NVIDIA-RTX-A6000")
    ampere["metadata"]["labels"]["nvidia.com/gpu.compute.minor"] = "6"
    d = decide("llama-3.1-8b", [ampere, node("L40S")], precision="bf16")
    assert d.is_selected and d.gpu is not None and d.gpu.product == "NVIDIA-L40S", d.reason
    (rejected,) = d.rejected
    assert "NVIDIA-RTX-A6000" in rejected.candidate and rejected.reason == "fits at TP 1, ranked lower"


def test_nothing_fits_names_the_node_with_the_most_memory_in_all() -> None:
    """Eight 22 GiB GPUs hold more than one 80 GiB GPU: the message names the larger node."""
    d = decide("llama-3.1-405b", [node("H100", "one", allocatable=1), node("L4", "eight", allocatable=8)])
    assert not d.is_selected
    assert "largest node has 8 x 22 GiB (NVIDIA-L4)" in d.reason, d.reason


def test_a_lora_slot_is_every_projections_a_and_b_at_the_largest_rank() -> None:
    """Llama-3.1-8B (hidden 4096, 8 KV heads of 128, intermediate 14336, 32 layers), rank 16, bf16: per
    layer r x (q 4096+4096, k and v 4096+1024 each, o 4096+4096, gate and up 4096+14336 each, down
    14336+4096) = 16 x 81920 parameters, 80 MiB in all. At TP 2 each GPU holds the split factor's half
    and the other whole."""
    shape = resolve("llama-3.1-8b")
    assert shape.lora_slot_bytes(16) == 32 * 16 * 81920 * 2 == 80 * 1024**2
    assert shape.lora_slot_bytes(64) == 4 * shape.lora_slot_bytes(16)  # linear in the rank
    per_layer_tp2 = 2 * (4096 + 2048) + 2 * (4096 + 512) + 3 * (4096 + 7168)
    assert shape.lora_slot_bytes(16, tensor_parallel_size=2) == 32 * 16 * per_layer_tp2 * 2
    # Qwen2.5-7B has 4 KV heads: at TP 8 each rank still holds one whole (replicated, not a half).
    qwen = resolve("qwen2.5-7b")
    per_layer_tp8 = 2 * (3584 + 448) + 2 * (3584 + 128) + 3 * (3584 + 18944 // 8)
    assert qwen.lora_slot_bytes(1, tensor_parallel_size=8) == 28 * per_layer_tp8 * 2


def test_lora_slots_come_out_of_the_kv_room() -> None:
    """70B fp8 runs at TP 2 on H100s; 64 slots of rank 64 (51-67 GiB a GPU) leave no KV reserve there,
    so TP 4; on one L4 an 8B with 64 slots of rank 64 (20 GiB) does not fit at all. Ignoring the
    slots, the server would start with a KV cache too small to batch, or fail to allocate them."""
    h100 = [node("H100")]
    assert decide("llama-3.1-70b", h100).tensor_parallel_size == 2
    slots = {"lora_slots": 64, "max_lora_rank": 64}
    with_adapters = decide("llama-3.1-70b", h100, **slots)
    assert with_adapters.is_selected and with_adapters.tensor_parallel_size == 4, with_adapters.reason
    per_gpu = 64 * resolve("llama-3.1-70b").lora_slot_bytes(64, tensor_parallel_size=4) / 1024**3
    assert f"KV reserve + {per_gpu:.1f} GiB per GPU of LoRA slots (64 x rank 64) fits 4 x" in (
        with_adapters.reason
    )
    assert decide("llama-3.1-8b", [node("L4")], lora_slots=8, max_lora_rank=16).is_selected
    too_many = decide("llama-3.1-8b", [node("L4")], **slots)
    assert not too_many.is_selected and too_many.reason.startswith(
        "8B fp8 with 64 LoRA slots of rank 64 needs 2 x 22 GiB"
    ), too_many.reason
    assert "20.0 GiB per GPU of LoRA slots (64 x rank 64)" in too_many.rejected[0].reason
    assert "LoRA" not in decide("llama-3.1-70b", h100).reason  # nothing said without adapters


def test_the_spec_asks_the_profile_for_its_adapters_slots() -> None:
    from pagoda.operator.spec import parse_spec

    def request(**spec: object) -> ProfileRequest:
        model = {"name": "llama-3.1-8b", "source": {"imagePath": "/m"}}
        body = {"metadata": {"name": "x"}, "spec": {"model": model, **spec}}
        return parse_spec(body).profile_request()

    assert (request().lora_slots, request().max_lora_rank) == (0, 0)
    adapters = [{"name": f"a{i}", "source": {"imagePath": f"/a/{i}"}} for i in range(12)]
    assert (request(adapters=adapters).lora_slots, request(adapters=adapters).max_lora_rank) == (8, 16)
    asked = request(adapters=adapters, engine={"maxLoras": 12, "maxLoraRank": 128})
    assert (asked.lora_slots, asked.max_lora_rank) == (12, 128)


# Over several nodes: (model, {kind: number of nodes}, request fields, want). want is (product, precision,
# TP, PP) or the words of the reason. PP > 1 is a LeaderWorkerSet group of PP pods of TP GPUs each.
MULTI_NODE = [
    # 405B bf16 (756 GiB) fits no 8 x 80 GiB node: TP 8 inside each of two H100 nodes, PP 2 across them.
    ("llama-3.1-405b", {"H100": 2}, {"precision": "bf16"}, ("NVIDIA-H100-80GB-HBM3", "bf16", 8, 2)),
    # ... three nodes are no better than two: the fewest nodes that hold it.
    ("llama-3.1-405b", {"H100": 3}, {"precision": "bf16"}, ("NVIDIA-H100-80GB-HBM3", "bf16", 8, 2)),
    # ... one node is not enough, and says how many pods the group needs.
    ("llama-3.1-405b", {"H100": 1}, {"precision": "bf16"},
     "405B bf16 TP 8 x PP 2 needs 2 pods of 8 GPUs; 1 node of 8 x NVIDIA-H100-80GB-HBM3 has room for 1"),
    # Where one node holds it, one node it is: fp8 fits eight H100s; an H200 node holds even bf16.
    ("llama-3.1-405b", {"H100": 2}, {}, ("NVIDIA-H100-80GB-HBM3", "fp8", 8, 1)),
    ("llama-3.1-405b", {"H100": 2, "H200": 1}, {"precision": "bf16"}, ("NVIDIA-H200", "bf16", 8, 1)),
    # Four-GPU nodes: TP 4, and three of them.
    ("llama-3.1-405b", {"A100-80": 4}, {"precision": "bf16"}, ("NVIDIA-A100-SXM4-80GB", "bf16", 4, 3)),
    # One-GPU nodes: TP 1 over four L4 nodes for a 70B in fp8.
    ("llama-3.1-70b", {"L4": 4}, {}, ("NVIDIA-L4", "fp8", 1, 4)),
    # No deeper than MAX_AUTO_NODES by itself: 405B fp8 would take 22 L4 nodes.
    ("llama-3.1-405b", {"L4": 30}, {}, "405B fp8 needs 416 GiB, more than 8 x 22 GiB"),
    # Asked for: PP 2 of the smallest TP that fits, two pods on one node where it has the GPUs.
    ("llama-3.1-8b", {"H100": 1}, {"pipeline_parallel_size": 2}, ("NVIDIA-H100-80GB-HBM3", "fp8", 1, 2)),
    ("llama-3.1-70b", {"H100": 2}, {"pipeline_parallel_size": 2, "precision": "bf16"},
     ("NVIDIA-H100-80GB-HBM3", "bf16", 2, 2)),
    ("llama-3.1-70b", {"H100": 2}, {"pipeline_parallel_size": 2, "tensor_parallel_size": 8},
     ("NVIDIA-H100-80GB-HBM3", "fp8", 8, 2)),
    # PP 1 asked for: one node or nothing.
    ("llama-3.1-405b", {"H100": 2}, {"pipeline_parallel_size": 1, "precision": "bf16"},
     "405B bf16 needs 832 GiB, more than 8 x 80 GiB"),
    ("smollm2-135m", {"L4": 1}, {"pipeline_parallel_size": 31},
     "PP 31 needs a layer per stage; the model has 30"),
    # The engine serves no LoRA and no draft model under pipeline parallelism: never chosen for them.
    ("llama-3.1-8b", {"H100": 1}, {"pipeline_parallel_size": 2, "lora_slots": 1, "max_lora_rank": 8},
     "PP 2: LoRA adapters are not served under pipeline parallelism"),
    ("llama-3.1-405b", {"H100": 2}, {"precision": "bf16", "lora_slots": 1, "max_lora_rank": 8},
     "LoRA adapters are not served under pipeline parallelism"),
    ("llama-3.1-405b", {"H100": 2}, {"precision": "bf16", "has_draft_model": True},
     "a draft model is not served under pipeline parallelism"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "kinds", "kwargs", "want"), MULTI_NODE)
def test_multi_node_table(model: str, kinds: dict[str, int], kwargs: dict, want: tuple | str) -> None:
    nodes = [node(kind, f"{kind.lower()}-{i}") for kind, count in kinds.items() for i in range(count)]
    d = decide(model, nodes, **kwargs)
    if isinstance(want, str):
        assert not d.is_selected and want in d.reason, d.reason
        return
    assert d.is_selected and d.gpu is not None, d.reason
    got = (d.gpu.product, d.precision, d.tensor_parallel_size, d.pipeline_parallel_size)
    assert got == want, d.reason
    assert d.to_dict()["pipelineParallelSize"] == want[3] and d.num_nodes == want[3]


def test_a_multi_node_reason_says_why_one_node_is_not_enough() -> None:
    from pagoda.operator.profile import GIB

    d = decide("llama-3.1-405b", [node("H100", "a"), node("H100", "b")], precision="bf16")
    weights = resolve("llama-3.1-405b").num_params * 2
    assert d.reason == (
        f"405B bf16 (requested), TP 8 x PP 2: {weights / GIB:.1f} GiB weights + "
        f"{0.1 * weights / GIB:.1f} GiB KV reserve does not fit one node of 8 x NVIDIA-H100-80GB-HBM3; "
        "fits 2 x 8 x NVIDIA-H100-80GB-HBM3 (80 GiB), one pipeline stage per pod"
    )
    asked = decide("llama-3.1-8b", [node("H100")], pipeline_parallel_size=2)
    assert "8B fp8 (auto: compute capability 9.0), TP 1 x PP 2 (requested): " in asked.reason


def test_a_group_needs_free_gpus_for_every_pod() -> None:
    """Two H100 nodes, one with a GPU taken: the two 8-GPU pods of a 405B bf16 group do not fit now."""
    nodes = [node("H100", "a"), node("H100", "b")]
    groups = gpu_groups(nodes, used={"a": 1, "b": 0})
    d = select_profile(ProfileRequest(resolve("llama-3.1-405b"), precision="bf16"), groups)
    assert not d.is_selected and d.cause == "Capacity", d.reason
    assert "needs 2 pods of 8 GPUs; the free GPUs have room for 1" in d.reason


def test_a_running_group_keeps_its_profile() -> None:
    from pagoda.operator.profile import CurrentProfile

    nodes = [node("H100", "a"), node("H100", "b"), node("H200", "c")]
    groups = gpu_groups(nodes, used={})
    request = ProfileRequest(resolve("llama-3.1-405b"), precision="bf16")
    assert select_profile(request, groups).gpu.product == "NVIDIA-H200"  # type: ignore[union-attr]
    d = select_profile(request, groups, CurrentProfile("NVIDIA-H100-80GB-HBM3", "bf16", 8, 2))
    assert (d.tensor_parallel_size, d.pipeline_parallel_size) == (8, 2), d.reason
    assert d.reason.endswith("kept: the current profile still fits")


def test_cli_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "profile",
        "--model",
        "llama-3.1-405b",
        "--gpu",
        "H100-80GB",
        "--count",
        "8",
        "--precision",
        "bf16",
    ]
    assert main(args) == 1
    capsys.readouterr()
    assert main([*args, "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "tp         8" in out and "pp         2 (pods of one replica)" in out
