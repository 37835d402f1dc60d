"""Profile selection: which GPU, precision and tensor-parallel degree a model runs with. Pure.

The rules, in order:
- precision `auto` is fp8 where compute capability >= 8.9 (Ada, Hopper, Blackwell), bf16 on 8.x
  (Ampere), fp16 below; an explicit precision the GPU cannot run rejects that GPU.
- tensor parallelism stays inside one node: the smallest degree in 1, 2, 4, 8 (at most the node's
  GPUs, dividing the attention heads) whose GPUs hold the weights, a per-GPU runtime overhead, and a
  KV reserve: room for 32768 tokens of KV cache (or one `max_model_len` sequence if longer; 16-bit,
  or 8-bit with `kv_cache_dtype` fp8), and never less than 10% of the weight bytes, so a model that
  only just fits is not chosen with a KV cache too small to batch (70B bf16 on 2 x 80 GB would leave
  ~10 GiB). LoRA adapters' GPU slots (`max_loras` x the largest rank's A and B of every projection of
  every layer, 16-bit) come out of the same room: they are held for the server's whole life, so the KV
  reserve must fit beside them.
- a model that no node holds runs over several (a LeaderWorkerSet group, one pod per node): pipeline
  parallelism across the nodes, tensor parallelism inside each, at the largest degree the node has (its
  GPUs talk over NVLink; only the stages' point-to-point hops cross nodes), and the fewest nodes, at most
  MAX_AUTO_NODES, whose GPUs hold the same weights + overhead + KV reserve. The engine refuses LoRA
  adapters and a draft model under pipeline parallelism, so those specs never get it. A spec may ask for
  `pipeline_parallel_size` P itself: P pods of one stage each, TP the smallest that fits P x TP GPUs.
  A group needs P pods of TP GPUs each: on P nodes, or fewer where a node has room for several.
- with a preference list, the first entry that fits wins; without one, the fitting candidate with the
  fewest GPUs (one node before several), then the newest compute capability, then the most memory.
- capacity: where the groups carry free GPU counts, a candidate needs TP free GPUs on one node.
- stability: the current profile (of a running workload, spec unchanged) is kept while it still fits,
  even when a better GPU appears; each move reloads the weights, so a cordon or an uncordon moves nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, get_args

from pagoda.operator.catalogue import ModelShape
from pagoda.operator.gpus import GpuGroup, matches_product

# What `pagoda serve --precision` runs: the CRD enums and service/cli.py PRECISIONS agree
# (tests/test_operator_contract.py). int8 is not offered: the engine has no int8 kernels.
Precision = Literal["auto", "bf16", "fp16", "fp8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
# What `pagoda serve --kv-cache-dtype` takes (the CRD's engine.kvCacheDtype enum): auto is the model's dtype.
KvCacheDtype = Literal["auto", "fp8"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
TP_DEGREES = (1, 2, 4, 8)
# The deepest pipeline the operator picks by itself: each stage adds a network hop per micro-batch and a
# node that can take the group down; a model that needs more than 8 nodes of a GPU is better served on
# larger GPUs (or asked for explicitly).
MAX_AUTO_NODES = 8
MAX_PIPELINE_PARALLEL = 64  # the CRD's bound on spec.pipelineParallelSize
GIB = 1024**3
OVERHEAD_BYTES = GIB  # per GPU: CUDA context, activations, CUDA graphs
KV_RESERVE_TOKENS = 32768
KV_RESERVE_WEIGHT_FRACTION = 0.10
DEFAULT_KV_CACHE_FRACTION = 0.9

_WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}
# The lowest compute capability that runs each precision's kernels.
_MIN_CC = {"fp8": (8, 9), "bf16": (8, 0), "fp16": (7, 0)}


@dataclasses.dataclass(frozen=True)
class GpuPreference:
    product: str  # matched token-wise: "H100" matches NVIDIA-H100-80GB-HBM3
    precision: Precision | None = None
    tensor_parallel_size: int | None = None

    def describe(self) -> str:
        extra = [
            x for x in (self.precision, self.tensor_parallel_size and f"TP {self.tensor_parallel_size}") if x
        ]
        return self.product + (f" ({', '.join(extra)})" if extra else "")


@dataclasses.dataclass(frozen=True)
class ProfileRequest:
    model: ModelShape
    precision: Precision = "auto"
    tensor_parallel_size: int | None = None  # None: the smallest that fits
    preferences: tuple[GpuPreference, ...] = ()
    kv_cache_fraction: float = DEFAULT_KV_CACHE_FRACTION
    max_model_len: int | None = None
    kv_cache_dtype: KvCacheDtype = "auto"
    lora_slots: int = 0  # --max-loras; 0: no adapters
    max_lora_rank: int = 0  # --max-lora-rank: each slot is sized for it
    pipeline_parallel_size: int | None = None  # None: 1 where one node holds the model, else the fewest
    has_draft_model: bool = False  # speculative decoding with a draft model (refused under PP)

    def pipeline_refusal(self) -> str | None:
        """Why the engine would refuse pipeline parallelism for this spec (docs/parallelism.md), if so."""
        if self.lora_slots:
            return "LoRA adapters are not served under pipeline parallelism"
        if self.has_draft_model:
            return "a draft model is not served under pipeline parallelism"
        return None

    def lora_bytes_per_gpu(self, tensor_parallel_size: int) -> int:
        if not self.lora_slots:
            return 0
        return self.lora_slots * self.model.lora_slot_bytes(self.max_lora_rank, tensor_parallel_size)

    def describe_lora(self, tensor_parallel_size: int) -> str:
        """` + 1.3 GiB per GPU of LoRA slots (8 x rank 16)`, or nothing without adapters."""
        if not self.lora_slots:
            return ""
        size = _gib(self.lora_bytes_per_gpu(tensor_parallel_size))
        return f" + {size} per GPU of LoRA slots ({self.lora_slots} x rank {self.max_lora_rank})"


@dataclasses.dataclass(frozen=True)
class CurrentProfile:
    """What the workload runs now (the Deployment's profile)."""

    product: str
    precision: str
    tensor_parallel_size: int
    pipeline_parallel_size: int = 1

    def describe(self) -> str:
        pp = f" x PP {self.pipeline_parallel_size}" if self.pipeline_parallel_size > 1 else ""
        return f"{self.product} {self.precision} TP {self.tensor_parallel_size}{pp}"


# Why nothing fits, as a closed set (Decision.reason says it in words): metrics label by it.
NoFitCause = Literal[
    "NoGpuNodes", "NoPreferredGpu", "ComputeCapability", "TensorParallel", "Memory", "Capacity"
]
NO_FIT_CAUSES: tuple[str, ...] = get_args(NoFitCause)


@dataclasses.dataclass(frozen=True)
class Rejection:
    candidate: str
    reason: str
    cause: NoFitCause | None = None  # None: it fits, but ranked lower
    pipeline_parallel_size: int = 1  # > 1: the reason is about a group over several pods

    @classmethod
    def of(cls, candidate: str, decision: Decision) -> Rejection:
        return cls(candidate, decision.reason, decision.cause, decision.pipeline_parallel_size)


@dataclasses.dataclass(frozen=True)
class Decision:
    is_selected: bool
    reason: str
    gpu: GpuGroup | None = None
    precision: str | None = None
    tensor_parallel_size: int | None = None
    kv_cache_dtype: str | None = None
    rejected: tuple[Rejection, ...] = ()
    cause: NoFitCause | None = None  # set when nothing is selected for a GPU reason
    pipeline_parallel_size: int = 1  # > 1: that many pods of tensor_parallel_size GPUs (a LeaderWorkerSet)

    @property
    def num_nodes(self) -> int:
        """Pods of one replica: one per pipeline stage (one per node unless a node has room for several)."""
        return self.pipeline_parallel_size

    @property
    def is_multi_node(self) -> bool:
        return self.pipeline_parallel_size > 1

    def to_dict(self) -> dict[str, Any]:
        """The shape of `status.profile` in the CRD (and of `pagoda profile --output json`)."""
        out: dict[str, Any] = {"selected": self.is_selected, "reason": self.reason}
        if self.gpu is not None:
            out["gpu"] = {
                "product": self.gpu.product,
                "computeCapability": self.gpu.cc,
                "memoryMiB": self.gpu.memory_mib,
                "count": self.gpu.num_gpus,
                "nodes": list(self.gpu.node_names),
            }
            out |= {
                "precision": self.precision,
                "tensorParallelSize": self.tensor_parallel_size,
                "pipelineParallelSize": self.pipeline_parallel_size,
                "kvCacheDtype": self.kv_cache_dtype,
            }
        out["rejected"] = [{"candidate": r.candidate, "reason": r.reason} for r in self.rejected]
        return out


def auto_precision(cc: tuple[int, int]) -> str:
    if cc >= (8, 9):
        return "fp8"
    return "bf16" if cc >= (8, 0) else "fp16"


def kv_cache_dtype(precision: str, requested: KvCacheDtype = "auto") -> str:
    # `pagoda serve --precision fp8` quantizes the projections only; its KV cache stays 16-bit unless
    # `--kv-cache-dtype fp8` (engine.kvCacheDtype) asks for e4m3, whatever the precision.
    if requested == "fp8":
        return "fp8"
    return "fp16" if precision == "fp16" else "bf16"


@dataclasses.dataclass(frozen=True)
class _Need:
    weight_bytes: int
    kv_reserve_bytes: int


def _need(request: ProfileRequest, precision: str) -> _Need:
    model = request.model
    weight_bytes = model.num_params * _WEIGHT_BYTES[precision]
    kv_dtype_bytes = 1 if kv_cache_dtype(precision, request.kv_cache_dtype) == "fp8" else 2
    tokens = max(KV_RESERVE_TOKENS, request.max_model_len or 0)
    kv = max(model.kv_bytes_per_token(kv_dtype_bytes) * tokens, KV_RESERVE_WEIGHT_FRACTION * weight_bytes)
    return _Need(weight_bytes, int(kv))


def _fits(request: ProfileRequest, need: _Need, memory_mib: int, tp: int, pp: int = 1) -> bool:
    """Do tp x pp GPUs hold the weights, the overhead, LoRA slots and the KV reserve?

    Under pipeline parallelism each stage holds its share of the layers and their KV cache, so the sums
    divide over every GPU of the group as over TP alone. The first and last stage also hold the
    embedding and the LM head (4.2 GB each for a 405B in bf16, 0.5 GB a GPU at TP 8): inside the reserve.
    """
    world = tp * pp
    usable_per_gpu = memory_mib * 1024**2 * request.kv_cache_fraction
    lora = request.lora_bytes_per_gpu(tp)
    kv_room = world * (usable_per_gpu - need.weight_bytes / world - OVERHEAD_BYTES - lora)
    return kv_room >= need.kv_reserve_bytes


def _smallest_tp(request: ProfileRequest, need: _Need, memory_mib: int, max_gpus: int) -> int | None:
    for tp in TP_DEGREES:
        if tp <= max_gpus and request.model.can_split(tp) and _fits(request, need, memory_mib, tp):
            return tp
    return None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


def _evaluate(
    request: ProfileRequest, group: GpuGroup, pref: GpuPreference | None, is_auto: bool | None = None
) -> Decision:
    """Does the model run on this group, and how; a Decision with is_selected False says why not.

    is_auto: whether the spec left the precision to the operator (None: unless the preference or the
    request names one); a kept profile passes its precision as a preference but was chosen as before.
    """
    model = request.model
    wanted = (pref.precision if pref and pref.precision else None) or request.precision
    if is_auto is None:
        is_auto = wanted == "auto"
    precision = auto_precision(group.compute_capability) if wanted == "auto" else wanted
    if group.compute_capability < _MIN_CC[precision]:
        need_cc = ".".join(map(str, _MIN_CC[precision]))
        return Decision(
            False,
            f"{precision} needs compute capability >= {need_cc}; {group.product} is {group.cc}",
            cause="ComputeCapability",
        )
    if request.kv_cache_dtype == "fp8" and group.compute_capability < (8, 9):
        return Decision(
            False,
            f"an fp8 KV cache needs compute capability >= 8.9; {group.product} is {group.cc}",
            cause="ComputeCapability",
        )
    need = _need(request, precision)
    why = f"{precision} " + (f"(auto: compute capability {group.cc})" if is_auto else "(requested)")
    fixed_tp = (pref.tensor_parallel_size if pref else None) or request.tensor_parallel_size
    if fixed_tp is not None:
        if fixed_tp > group.num_gpus:
            return Decision(
                False,
                f"TP {fixed_tp} needs {fixed_tp} GPUs in one node; these have {group.num_gpus}",
                cause="TensorParallel",
            )
        if not model.can_split(fixed_tp):
            heads = model.num_attention_heads
            reason = f"TP {fixed_tp} does not divide the model's {heads} attention heads"
            return Decision(False, reason, cause="TensorParallel")
    fixed_pp = request.pipeline_parallel_size
    if fixed_pp is not None and fixed_pp > 1:
        decision = _over_nodes(request, group, need, precision, why, fixed_tp, fixed_pp)
        assert decision is not None  # an explicit pipeline is always decided
        return decision
    if fixed_tp is not None:
        tp: int | None = fixed_tp if _fits(request, need, group.memory_mib, fixed_tp) else None
    else:
        tp = _smallest_tp(request, need, group.memory_mib, group.num_gpus)
    sizes = f"{_gib(need.weight_bytes)} weights + {_gib(need.kv_reserve_bytes)} KV reserve"
    if tp is None:
        at_most = fixed_tp or max(t for t in TP_DEGREES if t <= group.num_gpus)
        sizes += request.describe_lora(at_most)
        fits = f"{at_most} x {group.product} ({group.memory_gib:.0f} GiB)"
        reason = f"{model.size_label} {precision} ({sizes}) does not fit {fits}"
        if fixed_pp is None:  # no node holds it: over several, if the engine may split it so
            if (refusal := request.pipeline_refusal()) is not None:
                return Decision(False, f"{reason}; {refusal}", cause="Memory")
            multi = _over_nodes(request, group, need, precision, why, fixed_tp, None)
            if multi is not None:
                said = multi.reason if multi.is_selected else f"{reason}{OVER_NODES}{multi.reason}"
                return dataclasses.replace(multi, reason=said)
        return Decision(False, reason, cause="Memory")
    if group.max_free < tp:
        in_use = f"{group.max_free} of {group.num_gpus} free on the freest node"
        return Decision(
            False,
            f"{model.size_label} {precision} TP {tp} needs {tp} free GPUs on one node; {in_use}",
            cause="Capacity",
        )
    sizes += request.describe_lora(tp)
    reason = (
        f"{model.size_label} {why}, TP {tp}: {sizes} fits {tp} x {group.product} ({group.memory_gib:.0f} GiB)"
    )
    return Decision(
        True,
        reason,
        gpu=group,
        precision=precision,
        tensor_parallel_size=tp,
        kv_cache_dtype=kv_cache_dtype(precision, request.kv_cache_dtype),
    )


def _over_nodes(
    request: ProfileRequest,
    group: GpuGroup,
    need: _Need,
    precision: str,
    why: str,
    fixed_tp: int | None,
    fixed_pp: int | None,
) -> Decision | None:
    """Pipeline stages over pods of TP GPUs each (a LeaderWorkerSet group): fixed_pp, or the fewest up to
    MAX_AUTO_NODES at the node's whole TP. None where no pipeline of the auto path fits either (the
    one-node reason then stands)."""
    model = request.model
    sizes = f"{_gib(need.weight_bytes)} weights + {_gib(need.kv_reserve_bytes)} KV reserve"
    splittable = [t for t in TP_DEGREES if t <= group.num_gpus and model.can_split(t)]
    if fixed_pp is not None:
        if (refusal := request.pipeline_refusal()) is not None:
            return Decision(False, f"PP {fixed_pp}: {refusal}", cause="TensorParallel")
        if fixed_pp > model.num_layers:
            reason = f"PP {fixed_pp} needs a layer per stage; the model has {model.num_layers}"
            return Decision(False, reason, cause="TensorParallel")
        degrees = [fixed_tp] if fixed_tp is not None else splittable
        tp = next((t for t in degrees if _fits(request, need, group.memory_mib, t, fixed_pp)), None)
        if tp is None:
            widest = max(degrees, default=1)
            fits = f"{fixed_pp} x {widest} x {group.product} ({group.memory_gib:.0f} GiB)"
            return Decision(
                False, f"{model.size_label} {precision} ({sizes}) does not fit {fits}", cause="Memory"
            )
        pp = fixed_pp
        said = f"{model.size_label} {why}, TP {tp} x PP {pp} (requested): {sizes} fits"
    else:
        tp = fixed_tp if fixed_tp is not None else max(splittable, default=None)  # type: ignore[call-overload]
        if tp is None:
            return None
        depths = range(2, min(MAX_AUTO_NODES, model.num_layers) + 1)
        found = next((p for p in depths if _fits(request, need, group.memory_mib, tp, p)), None)
        if found is None:
            return None
        pp = found
        node = f"{group.num_gpus} x {group.product}"
        said = f"{model.size_label} {why}, TP {tp} x PP {pp}: {sizes} does not fit one node of {node}; fits"
    shape = f"{model.size_label} {precision} TP {tp} x PP {pp} needs {pp} pods of {_count(tp, 'GPU')}"
    room = group.room_for(tp)
    if room is not None and room < pp:
        nodes = f"{_count(len(group.node_names), 'node')} of {group.num_gpus} x {group.product}"
        reason = f"{shape}; {nodes} {'has' if len(group.node_names) == 1 else 'have'} room for {room}"
        return Decision(False, reason, cause="Memory", pipeline_parallel_size=pp)
    free = group.room_for(tp, is_free=True)
    if free is not None and free < pp:
        reason = f"{shape}; the free GPUs have room for {free}"
        return Decision(False, reason, cause="Capacity", pipeline_parallel_size=pp)
    reason = f"{said} {pp} x {tp} x {group.product} ({group.memory_gib:.0f} GiB), one pipeline stage per pod"
    return Decision(
        True,
        reason,
        gpu=group,
        precision=precision,
        tensor_parallel_size=tp,
        kv_cache_dtype=kv_cache_dtype(precision, request.kv_cache_dtype),
        pipeline_parallel_size=pp,
    )


OVER_NODES = "; over nodes, "  # joins a one-node reason and why a group over several nodes fails too
_NEAREST: tuple[str, ...] = ("Capacity", "Memory", "TensorParallel", "ComputeCapability", "NoPreferredGpu")


def _rank(decision: Decision) -> tuple[bool, int, tuple[int, int], int]:
    gpu = decision.gpu
    assert gpu is not None and decision.tensor_parallel_size is not None  # only fitting decisions
    return (
        decision.is_multi_node,
        decision.tensor_parallel_size * decision.pipeline_parallel_size,
        (-gpu.compute_capability[0], -gpu.compute_capability[1]),
        -gpu.memory_mib,
    )


def _nothing_fits(request: ProfileRequest, groups: list[GpuGroup], rejected: list[Rejection]) -> Decision:
    if not groups:
        reason = "no schedulable GPU nodes (none has the nvidia.com/gpu.product label)"
        return Decision(False, reason, cause="NoGpuNodes")
    if request.preferences:
        wanted_products = [p.product for p in request.preferences]
        preferred = [g for g in groups if any(matches_product(g.product, w) for w in wanted_products)]
        if not preferred:
            reason = f"no schedulable node has a preferred GPU ({', '.join(wanted_products)})"
            return Decision(False, reason, rejected=tuple(rejected), cause="NoPreferredGpu")
        groups = preferred
    fixed_tp = request.tensor_parallel_size or any(p.tensor_parallel_size for p in request.preferences)
    fixed_tp = fixed_tp or (request.pipeline_parallel_size or 1) > 1
    is_capacity = any(r.cause == "Capacity" for r in rejected)
    if rejected and (
        fixed_tp or is_capacity
    ):  # the sizes below would not be why: say each candidate's reason
        reasons = "; ".join(f"{r.candidate}: {r.reason}" for r in rejected)
        # The cause of the candidate nearest to fitting: busy GPUs, then too little memory, then the rest.
        cause = min((r.cause for r in rejected if r.cause), key=_NEAREST.index, default=None)
        return Decision(False, f"no GPU fits: {reasons}", rejected=tuple(rejected), cause=cause)
    largest = max(groups, key=lambda g: (g.num_gpus * g.memory_mib, g.memory_mib))
    precision: str = request.precision
    if precision == "auto":
        precision = auto_precision(largest.compute_capability)
    able = [g for g in groups if g.compute_capability >= _MIN_CC[precision]]
    if not able:
        newest = max(groups, key=lambda g: g.compute_capability)
        need_cc = ".".join(map(str, _MIN_CC[precision]))
        newest_gpu = f"{newest.product} ({newest.cc})"
        reason = f"{precision} needs compute capability >= {need_cc}; the newest GPU is {newest_gpu}"
        return Decision(False, reason, rejected=tuple(rejected), cause="ComputeCapability")
    widest = max(able, key=lambda g: g.memory_mib)
    need = _need(request, precision)
    tp = _smallest_tp(request, need, widest.memory_mib, max(TP_DEGREES))
    if tp is not None:
        needs = f"{tp} x {widest.memory_gib:.0f} GiB"
    else:
        widest_tp = max(TP_DEGREES)
        total = need.weight_bytes + need.kv_reserve_bytes + widest_tp * request.lora_bytes_per_gpu(widest_tp)
        needs = f"{math.ceil(total / GIB)} GiB, more than 8 x {widest.memory_gib:.0f} GiB"
    lora = (
        f" with {request.lora_slots} LoRA slots of rank {request.max_lora_rank}" if request.lora_slots else ""
    )
    reason = (
        f"{request.model.size_label} {precision}{lora} needs {needs}; "
        f"largest node has {largest.num_gpus} x {largest.memory_gib:.0f} GiB ({largest.product})"
    )
    if tp is None and (refusal := request.pipeline_refusal()) is not None:
        reason += f"; over several nodes: {refusal}"
    if over_nodes := [r for r in rejected if r.pipeline_parallel_size > 1]:  # too few nodes for a group
        said = (f"{r.candidate}: {r.reason.rpartition(OVER_NODES)[2]}" for r in over_nodes)
        reason += "; over several nodes: " + "; ".join(said)
    return Decision(False, reason, rejected=tuple(rejected), cause="Memory")


def _keep(request: ProfileRequest, groups: list[GpuGroup], current: CurrentProfile) -> Decision | None:
    """The current profile, if a group of its exact product still fits it (capacity included)."""
    pref = GpuPreference(current.product, current.precision, current.tensor_parallel_size)  # type: ignore[arg-type]
    request = dataclasses.replace(request, pipeline_parallel_size=current.pipeline_parallel_size)
    asked = next(
        (
            p.precision
            for p in request.preferences
            if p.precision and matches_product(current.product, p.product)
        ),
        request.precision,
    )
    for group in groups:
        if group.product == current.product:
            decision = _evaluate(request, group, pref, is_auto=asked == "auto")
            if decision.is_selected:
                return dataclasses.replace(
                    decision, reason=f"{decision.reason}; kept: the current profile still fits"
                )
    return None


def select_profile(
    request: ProfileRequest, groups: list[GpuGroup], current: CurrentProfile | None = None
) -> Decision:
    """Choose the GPU group, precision and TP for a model; explain the choice and every rejection.

    current: what runs now, for an unchanged spec; kept while it fits (see the module docstring).
    """
    if current is not None and (kept := _keep(request, groups, current)) is not None:
        return kept
    rejected: list[Rejection] = []
    if not request.preferences:
        outcomes = [(g, _evaluate(request, g, None)) for g in groups]
        fitting = sorted((d for _, d in outcomes if d.is_selected), key=_rank)
        for group, d in outcomes:
            if not d.is_selected:
                rejected.append(Rejection.of(group.describe(), d))
        if fitting:
            best = fitting[0]
            for other in fitting[1:]:
                assert other.gpu is not None
                pp = f" x PP {other.pipeline_parallel_size}" if other.is_multi_node else ""
                rejected.append(
                    Rejection(
                        other.gpu.describe(), f"fits at TP {other.tensor_parallel_size}{pp}, ranked lower"
                    )
                )
            return dataclasses.replace(best, rejected=tuple(rejected))
        return _nothing_fits(request, groups, rejected)

    for pref in request.preferences:
        matching = [g for g in groups if matches_product(g.product, pref.product)]
        if not matching:
            rejected.append(Rejection(pref.describe(), "no schedulable node has this GPU", "NoPreferredGpu"))
            continue
        outcomes = [(g, _evaluate(request, g, pref)) for g in matching]
        fitting = sorted((d for _, d in outcomes if d.is_selected), key=_rank)
        if fitting:
            best = fitting[0]
            reason = f"{best.reason}; preference {request.preferences.index(pref) + 1}: {pref.describe()}"
            return dataclasses.replace(best, reason=reason, rejected=tuple(rejected))
        rejected.extend(Rejection.of(g.describe(), d) for g, d in outcomes if not d.is_selected)
    return _nothing_fits(request, groups, rejected)
