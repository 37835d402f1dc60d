"""The InferenceService spec as typed, frozen values, and the operator's own settings.

The API server has already checked the object against the CRD schema and CEL rules; parsing here
only fills defaults and turns a few shapes (TP `auto`, the model source) into Python values. What
the schema cannot know (a model name outside the catalogue without a size) raises ValueError, and so
do the CRD's rules on extraArgs, env, speculative and adapters, repeated here for objects that never
met the API server (unit tests, a CRD installed before the rule).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from pagoda.operator import reserved
from pagoda.operator.catalogue import ModelShape, resolve
from pagoda.operator.profile import (
    DEFAULT_KV_CACHE_FRACTION,
    MAX_PIPELINE_PARALLEL,
    PRECISIONS,
    GpuPreference,
    KvCacheDtype,
    ProfileRequest,
)

SourceKind = Literal["pvc", "hostPath", "imagePath", "uri"]

GROUP = "serving.pagoda.dev"
VERSION = "v1alpha1"
PLURAL = "inferenceservices"
KIND = "InferenceService"

# model.source.uri: the CRD holds the same pattern (tests/test_operator_contract.py).
URI_PATTERN = re.compile(
    r"^(hf://[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+(@[A-Za-z0-9_./-]+)?"
    r"|(s3|gs)://[a-z0-9][a-z0-9._-]{1,62}/[^\s]+"
    r"|https?://[^\s/]+/[^\s]+\.gguf)$"
)
MAX_URI_LENGTH = 8192  # the CRD's maxLength (which bounds the cost of its CEL rules on adapters' URIs)
URI_FORMS = (
    "give hf://org/name[@revision], s3://bucket/path, gs://bucket/path or http(s)://host/path/file.gguf"
)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    kind: SourceKind
    location: str  # claim name, host path, image path, or a URI (operator/sources.py)
    path: str = ""  # inside the PVC
    token_secret: tuple[str, str] | None = None  # (secret name, key): HF_TOKEN for an hf:// source
    credentials_secret: str | None = None  # a Secret whose keys the download gets as environment


@dataclasses.dataclass(frozen=True)
class ModelCache:
    """model.cache: a PVC the operator fills once per model and revision (operator/cache.py)."""

    size: str
    storage_class_name: str | None = None
    access_mode: str = "ReadWriteMany"  # replicas on several nodes read it
    # The download Job's own; None: the service's placement, and 1 CPU / 1 GiB requested.
    node_selector: Mapping[str, str] | None = None
    tolerations: tuple[Mapping[str, Any], ...] | None = None
    resources: Mapping[str, Any] | None = None


SpeculativeMethod = Literal["ngram", "draftModel"]


@dataclasses.dataclass(frozen=True)
class Speculative:
    """spec.speculative: `pagoda serve --speculative-config` (docs/speculative.md). The defaults are the
    server's (service/engine/config.py SpeculativeConfig; tests/test_operator_contract.py holds them
    equal), written out so the pod spec says what runs. Off unless the spec asks: docs/operator.md."""

    method: SpeculativeMethod
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    draft_model: str | None = None  # a path the pod sees (an imagePath, a volume of spec.volumes)
    max_batch_tokens: int = 128
    adaptive: bool = True

    def config_json(self) -> str:
        """The flag's JSON, in vLLM's snake_case keys."""
        fields: dict[str, Any] = {"method": "ngram"}
        if self.method == "draftModel":
            fields = {"method": "draft_model", "model": self.draft_model}
        fields["num_speculative_tokens"] = self.num_speculative_tokens
        if self.method == "ngram":
            fields |= {
                "prompt_lookup_max": self.prompt_lookup_max,
                "prompt_lookup_min": self.prompt_lookup_min,
            }
        fields |= {"max_batch_tokens": self.max_batch_tokens, "adaptive": self.adaptive}
        return json.dumps(fields)


MAX_SPECULATIVE_TOKENS = 16  # the server's bounds (SpeculativeConfig)
MAX_PROMPT_LOOKUP = 64


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One of spec.adapters: a LoRA adapter (a PEFT folder: adapter_config.json and
    adapter_model.safetensors) served beside the model under its own name."""

    name: str
    source: ModelSource


# spec.adapters[].name: the `model` clients send. OpenAI's model ids' characters (`ft:gpt-4o:org::id`),
# no `/` or leading dot (it names the adapter's folder too), no `=` (`--lora-modules NAME=PATH`).
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
MAX_ADAPTERS = 64
# --max-loras when the spec leaves it: every adapter in a GPU slot, up to 8 (NIM's NIM_MAX_GPU_LORAS).
# A step serves requests of at most max_loras adapters, so fewer slots than adapters queues requests of
# the others behind; each slot costs KV cache (8 x rank 16 of an 8B model: 640 MiB; of a 70B: 3.1 GiB).
DEFAULT_MAX_LORAS_CAP = 8
DEFAULT_MAX_LORA_RANK = 16  # the server's and vLLM's
MAX_LORA_RANK = 512
MAX_CPU_LORAS = 1024


ROUTER_POLICIES = ("cache_aware", "power_of_two", "round_robin", "consistent_hash", "random")


@dataclasses.dataclass(frozen=True)
class Router:
    """spec.router: vllm-router in front of the server pods (docs/routing.md). Without `enabled` in the
    spec it is on exactly when the service may run more than one replica (docs/routing.md says why)."""

    enabled: bool = False
    policy: str = "cache_aware"
    replicas: int = 2


@dataclasses.dataclass(frozen=True)
class HttpRoute:
    """spec.httpRoute: a Gateway API HTTPRoute (gateway.networking.k8s.io/v1) from the cluster's
    Gateway(s) to the Service's http port; the cluster's Gateway controller serves it."""

    parent_refs: tuple[Mapping[str, Any], ...]
    hostnames: tuple[str, ...] = ()
    path: str = "/"
    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Ingress:
    """spec.ingress: a networking.k8s.io/v1 Ingress to the Service's http port (an ingress controller
    of the cluster serves it)."""

    host: str | None = None
    class_name: str | None = None
    path: str = "/"
    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tls_secret_name: str | None = None


@dataclasses.dataclass(frozen=True)
class Autoscaling:
    min_replicas: int
    max_replicas: int
    target_queue_depth: int
    target_kv_cache_usage: float
    target_gpu_activity: float | None = None
    behavior: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    kv_cache_dtype: KvCacheDtype | None = None  # None: the server's default (auto)
    api_server_count: int | None = None  # None: the server's default (1)
    kv_cache_fraction: float = DEFAULT_KV_CACHE_FRACTION
    is_prefix_caching: bool = True
    extra_args: tuple[str, ...] = ()
    # LoRA (with spec.adapters only): GPU slots (0: no adapters), the largest rank, adapters kept in host
    # memory (None: the server's default, max_loras).
    max_loras: int = 0
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int | None = None


@dataclasses.dataclass(frozen=True)
class ServiceSpec:
    name: str
    namespace: str
    model_name: str
    model: ModelShape
    source: ModelSource
    precision: str = "auto"
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None  # None: auto (profile.py)
    preferences: tuple[GpuPreference, ...] = ()
    replicas: int = 1
    autoscaling: Autoscaling | None = None
    engine: EngineSettings = EngineSettings()
    image: str | None = None
    image_pull_policy: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    resources: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    env: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    runtime_class_name: str | None = None
    priority_class_name: str | None = None
    service_account_name: str | None = None
    cache: ModelCache | None = None
    api_key_secret: tuple[str, str] | None = None  # (secret name, key): PAGODA_API_KEY
    pod_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)  # added to the operator's
    pod_annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    service_type: str = "ClusterIP"
    service_annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    volumes: tuple[Mapping[str, Any], ...] = ()  # core/v1 Volume, added to the pod
    volume_mounts: tuple[Mapping[str, Any], ...] = ()  # core/v1 VolumeMount, added to the server container
    ingress: Ingress | None = None
    http_route: HttpRoute | None = None
    router: Router = Router()
    speculative: Speculative | None = None
    adapters: tuple[Adapter, ...] = ()

    def profile_request(self) -> ProfileRequest:
        return ProfileRequest(
            model=self.model,
            precision=self.precision,  # type: ignore[arg-type]  # enum checked by the CRD
            tensor_parallel_size=self.tensor_parallel_size,
            preferences=self.preferences,
            kv_cache_fraction=self.engine.kv_cache_fraction,
            max_model_len=self.engine.max_model_len,
            kv_cache_dtype=self.engine.kv_cache_dtype or "auto",
            lora_slots=self.engine.max_loras,
            max_lora_rank=self.engine.max_lora_rank if self.engine.max_loras else 0,
            pipeline_parallel_size=self.pipeline_parallel_size,
            has_draft_model=self.speculative is not None and self.speculative.draft_model is not None,
        )


def _source(raw: Mapping[str, Any], where: str = "model.source") -> ModelSource:
    if sum(kind in raw for kind in ("pvc", "hostPath", "imagePath", "uri")) != 1:
        raise ValueError(f"{where}: give exactly one of pvc, hostPath, imagePath or uri")
    if "pvc" in raw:
        return ModelSource("pvc", raw["pvc"]["claimName"], path=raw["pvc"].get("path", "").strip("/"))
    for kind in ("hostPath", "imagePath"):
        if kind in raw:
            return ModelSource(kind, raw[kind])  # type: ignore[arg-type]
    uri = str(raw["uri"])
    if len(uri) > MAX_URI_LENGTH:
        raise ValueError(f"{where}.uri: at most {MAX_URI_LENGTH} characters, got {len(uri)}")
    if not URI_PATTERN.match(uri):  # the CRD's pattern, for objects that never met the API server
        raise ValueError(f"{where}.uri {uri!r}: {URI_FORMS}")
    secret = raw.get("tokenSecret")
    token = (secret["name"], secret.get("key", "token")) if secret else None
    credentials = (raw.get("credentialsSecret") or {}).get("name")
    return ModelSource("uri", uri, token_secret=token, credentials_secret=credentials)


def _cache(raw: Mapping[str, Any] | None, source: ModelSource) -> ModelCache | None:
    if raw is None:
        return None
    if source.kind != "uri":  # the CRD's rule, for objects that never met the API server
        raise ValueError("model.cache is only used with model.source.uri (a model to download)")
    tolerations = raw.get("tolerations")
    return ModelCache(
        str(raw["size"]),
        raw.get("storageClassName"),
        raw.get("accessMode", "ReadWriteMany"),
        node_selector=raw.get("nodeSelector"),
        tolerations=None if tolerations is None else tuple(tolerations),
        resources=raw.get("resources"),
    )


def _autoscaling(raw: Mapping[str, Any] | None) -> Autoscaling | None:
    if raw is None:
        return None
    return Autoscaling(
        min_replicas=int(raw.get("minReplicas", 1)),
        max_replicas=int(raw["maxReplicas"]),
        target_queue_depth=int(raw.get("targetQueueDepth", 8)),
        target_kv_cache_usage=float(raw.get("targetKvCacheUsage", 0.8)),
        target_gpu_activity=raw.get("targetGpuActivity"),
        behavior=raw.get("behavior"),
    )


def _secret_key(raw: Mapping[str, Any] | None, default_key: str) -> tuple[str, str] | None:
    return (raw["name"], raw.get("key") or default_key) if raw else None


def _several_replicas(spec: Mapping[str, Any]) -> bool:
    autoscaling = spec.get("autoscaling")
    if autoscaling is not None:
        return int(autoscaling.get("maxReplicas", 1)) > 1
    return int(spec.get("replicas", 1)) > 1


def _router(raw: Mapping[str, Any] | None, several_replicas: bool) -> Router:
    """`several_replicas`: the spec allows more than one server replica (replicas, or the HPA's max)."""
    raw = raw or {}
    enabled = raw.get("enabled")
    router = Router(
        several_replicas if enabled is None else bool(enabled),
        str(raw.get("policy", "cache_aware")),
        int(raw.get("replicas", 2)),
    )
    if router.policy not in ROUTER_POLICIES:  # the CRD's enum, for objects that never met the API server
        raise ValueError(f"router.policy {router.policy!r}: one of {', '.join(ROUTER_POLICIES)}")
    if router.replicas < 1:
        raise ValueError(f"router.replicas must be at least 1, got {router.replicas}")
    return router


def _http_route(raw: Mapping[str, Any] | None) -> HttpRoute | None:
    if raw is None:
        return None
    refs = raw.get("parentRefs") or ()
    if not refs or not all(isinstance(r, Mapping) and r.get("name") for r in refs):
        raise ValueError("httpRoute.parentRefs: at least one Gateway, each with a name")
    return HttpRoute(
        parent_refs=tuple(dict(r) for r in refs),
        hostnames=tuple(raw.get("hostnames") or ()),
        path=raw.get("path", "/"),
        annotations=reserved.string_map(raw.get("annotations"), "httpRoute.annotations", ()),
    )


def _ingress(raw: Mapping[str, Any] | None) -> Ingress | None:
    if raw is None:
        return None
    return Ingress(
        host=raw.get("host"),
        class_name=raw.get("className"),
        path=raw.get("path", "/"),
        annotations=reserved.string_map(raw.get("annotations"), "ingress.annotations", ()),
        tls_secret_name=raw.get("tlsSecretName"),
    )


def _precision(value: str | None, where: str) -> str | None:
    # Objects stored before int8 left the CRD's enum still carry it.
    if value is not None and value not in PRECISIONS:
        raise ValueError(f"{where} {value!r}: pagoda serve runs {', '.join(PRECISIONS)}")
    return value


def _int(raw: Mapping[str, Any], key: str, default: int, low: int, high: int, where: str) -> int:
    """An integer field within the CRD's bounds (repeated for objects that never met the API server)."""
    value = raw.get(key, default)
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{where}.{key} must be an integer from {low} to {high}, got {value!r}")
    return value


def _speculative(raw: Mapping[str, Any] | None) -> Speculative | None:
    """spec.speculative: the CRD's bounds and rules, repeated (the server would refuse the same values
    at start, in a crash loop, with its own flag's words)."""
    if raw is None:
        return None
    where = "speculative"
    method = raw.get("method")
    if method not in ("ngram", "draftModel"):
        raise ValueError(f"{where}.method must be ngram or draftModel, got {method!r}")
    draft = raw.get("draftModel")
    if (method == "draftModel") != (draft is not None):
        raise ValueError(f"{where}.draftModel is required exactly when method is draftModel")
    if draft is not None and not str(draft).startswith("/"):
        raise ValueError(f"{where}.draftModel {draft!r}: a path the server pod sees, starting with /")
    lookup_keys = sorted({"promptLookupMax", "promptLookupMin"} & raw.keys())
    if method == "draftModel" and lookup_keys:
        raise ValueError(f"{where}.{lookup_keys[-1]} is prompt lookup's (method ngram), not a draft model's")
    lookup_min = _int(raw, "promptLookupMin", Speculative.prompt_lookup_min, 1, MAX_PROMPT_LOOKUP, where)
    lookup_max = _int(raw, "promptLookupMax", Speculative.prompt_lookup_max, 1, MAX_PROMPT_LOOKUP, where)
    if lookup_min > lookup_max:
        raise ValueError(
            f"{where}.promptLookupMin ({lookup_min}) must be at most promptLookupMax ({lookup_max}); "
            f"unset, they are {Speculative.prompt_lookup_min} and {Speculative.prompt_lookup_max}"
        )
    adaptive = raw.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ValueError(f"{where}.adaptive must be true or false, got {adaptive!r}")
    return Speculative(
        method,
        num_speculative_tokens=_int(
            raw, "numSpeculativeTokens", Speculative.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS, where
        ),
        prompt_lookup_max=lookup_max,
        prompt_lookup_min=lookup_min,
        draft_model=None if draft is None else str(draft),
        max_batch_tokens=_int(raw, "maxBatchTokens", Speculative.max_batch_tokens, 1, 2**31 - 1, where),
        adaptive=adaptive,
    )


def _adapters(raw: list[Mapping[str, Any]] | None, model_name: str) -> tuple[Adapter, ...]:
    adapters: list[Adapter] = []
    for i, item in enumerate(raw or ()):
        name = str(item.get("name", ""))
        where = f"adapters[{i}]"
        if not ADAPTER_NAME.match(name):
            raise ValueError(
                f"{where}.name {name!r}: 1-128 letters, digits, '.', '_', ':' or '-', starting with a letter "
                "or digit (clients send it as `model`)"
            )
        if name == model_name:
            raise ValueError(
                f"{where}.name {name!r} is the served model's name (model.name): clients name one or the "
                "other in `model`"
            )
        if any(a.name == name for a in adapters):
            raise ValueError(f"{where}.name {name!r}: another adapter has this name")
        source = _source(item.get("source") or {}, f"{where}.source")
        if source.kind == "uri" and source.location.lower().endswith(".gguf"):
            raise ValueError(
                f"{where}.source.uri {source.location!r}: an adapter is a PEFT folder (adapter_config.json, "
                "adapter_model.safetensors), not a .gguf file"
            )
        adapters.append(Adapter(name, source))
    if len(adapters) > MAX_ADAPTERS:
        raise ValueError(f"adapters: at most {MAX_ADAPTERS}, got {len(adapters)}")
    return tuple(adapters)


def _engine(raw: Mapping[str, Any], num_adapters: int = 0) -> EngineSettings:
    lora_keys = sorted({"maxLoras", "maxLoraRank", "maxCpuLoras"} & raw.keys())
    max_loras, max_cpu_loras = 0, None
    if lora_keys and not num_adapters:
        raise ValueError(f"engine.{', '.join(lora_keys)}: settings of spec.adapters, which has none")
    if num_adapters:
        max_loras = _int(raw, "maxLoras", min(num_adapters, DEFAULT_MAX_LORAS_CAP), 1, MAX_ADAPTERS, "engine")
        if "maxCpuLoras" in raw:
            max_cpu_loras = _int(raw, "maxCpuLoras", max_loras, 1, MAX_CPU_LORAS, "engine")
            if max_cpu_loras < max_loras:
                raise ValueError(
                    f"engine.maxCpuLoras ({max_cpu_loras}) must be at least maxLoras ({max_loras}): the "
                    "adapters in GPU slots are kept in host memory too"
                )
    return EngineSettings(
        max_model_len=raw.get("maxModelLen"),
        max_num_seqs=raw.get("maxNumSeqs"),
        kv_cache_dtype=raw.get("kvCacheDtype"),
        api_server_count=raw.get("apiServerCount"),
        kv_cache_fraction=float(raw.get("kvCacheFraction", DEFAULT_KV_CACHE_FRACTION)),
        is_prefix_caching=bool(raw.get("prefixCaching", True)),
        extra_args=reserved.extra_args(raw.get("extraArgs")),
        max_loras=max_loras,
        max_lora_rank=_int(raw, "maxLoraRank", DEFAULT_MAX_LORA_RANK, 1, MAX_LORA_RANK, "engine"),
        max_cpu_loras=max_cpu_loras,
    )


def _pipeline_parallel_size(
    raw: Any, adapters: tuple[Adapter, ...], speculative: Speculative | None
) -> int | None:
    """spec.pipelineParallelSize: None for auto; the CRD's bounds and rules, repeated."""
    if raw in (None, "auto"):
        return None
    if type(raw) is not int or not 1 <= raw <= MAX_PIPELINE_PARALLEL:
        raise ValueError(f"pipelineParallelSize must be auto or 1 to {MAX_PIPELINE_PARALLEL}, got {raw!r}")
    if raw > 1 and adapters:
        raise ValueError(
            "pipelineParallelSize above 1 cannot serve spec.adapters: pagoda serve refuses LoRA under "
            "pipeline parallelism"
        )
    if raw > 1 and speculative is not None and speculative.draft_model is not None:
        raise ValueError(
            "pipelineParallelSize above 1 cannot run speculative.method draftModel: pagoda serve refuses a "
            "draft model under pipeline parallelism"
        )
    return raw


def parse_spec(body: Mapping[str, Any]) -> ServiceSpec:
    """An InferenceService object (as the API returns it) -> ServiceSpec; ValueError on what cannot work."""
    meta, spec = body["metadata"], body.get("spec") or {}
    model = spec.get("model") or {}
    tp = spec.get("tensorParallelSize", "auto")
    preferences = tuple(
        GpuPreference(
            p["product"],
            _precision(p.get("precision"), "gpuPreferences.precision"),
            p.get("tensorParallelSize"),
        )
        for p in spec.get("gpuPreferences") or ()
    )
    source = _source(model.get("source") or {})
    volumes, volume_mounts = reserved.volumes(spec)
    adapters = _adapters(spec.get("adapters"), model["name"])
    speculative = _speculative(spec.get("speculative"))
    return ServiceSpec(
        name=meta["name"],
        namespace=meta.get("namespace", "default"),
        model_name=model["name"],
        model=resolve(model["name"], model.get("parameters")),
        source=source,
        cache=_cache(model.get("cache"), source),
        precision=_precision(spec.get("precision", "auto"), "precision") or "auto",
        tensor_parallel_size=None if tp in (None, "auto") else int(tp),
        pipeline_parallel_size=_pipeline_parallel_size(
            spec.get("pipelineParallelSize"), adapters, speculative
        ),
        preferences=preferences,
        replicas=int(spec.get("replicas", 1)),
        autoscaling=_autoscaling(spec.get("autoscaling")),
        engine=_engine(spec.get("engine") or {}, len(adapters)),
        image=spec.get("image"),
        image_pull_policy=spec.get("imagePullPolicy"),
        image_pull_secrets=tuple(s["name"] for s in spec.get("imagePullSecrets") or ()),
        resources=spec.get("resources") or {},
        env=reserved.env(spec.get("env")),
        node_selector=spec.get("nodeSelector") or {},
        tolerations=tuple(spec.get("tolerations") or ()),
        affinity=spec.get("affinity"),
        runtime_class_name=spec.get("runtimeClassName"),
        priority_class_name=spec.get("priorityClassName"),
        service_account_name=spec.get("serviceAccountName"),
        api_key_secret=_secret_key(spec.get("apiKeySecret"), "api-key"),
        pod_labels=reserved.string_map(spec.get("podLabels"), "podLabels", reserved.OPERATOR_POD_LABELS),
        pod_annotations=reserved.string_map(
            spec.get("podAnnotations"), "podAnnotations", reserved.OPERATOR_POD_ANNOTATIONS
        ),
        service_type=(spec.get("service") or {}).get("type", "ClusterIP"),
        service_annotations=reserved.string_map(
            (spec.get("service") or {}).get("annotations"), "service.annotations", ()
        ),
        volumes=volumes,
        volume_mounts=volume_mounts,
        ingress=_ingress(spec.get("ingress")),
        http_route=_http_route(spec.get("httpRoute")),
        router=_router(spec.get("router"), _several_replicas(spec)),
        speculative=speculative,
        adapters=adapters,
    )


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    """The operator process's settings: built once by `pagoda operator` from flags/env."""

    server_image: str = "ghcr.io/pagoda-serving/pagoda-server:0.1.0"
    downloader_image: str = ""  # the init container of uncached hf:// models; empty: the server image
    kernel_cache_pvc: str | None = None  # a shared RWX claim; an emptyDir per pod otherwise
    resync_seconds: float = 60.0
    startup_timeout_seconds: int = 1800  # the startup probe's budget for a model load
    drain_seconds: int = 120  # how long in-flight requests may take after SIGTERM
    cluster_domain: str = "cluster.local"

    def __post_init__(self) -> None:
        if self.resync_seconds <= 0:
            raise ValueError(f"resync interval {self.resync_seconds}: must be positive")
        if self.startup_timeout_seconds < 10:
            raise ValueError(f"startup timeout {self.startup_timeout_seconds}s: must be at least 10")
        if self.drain_seconds < 0:
            raise ValueError(f"drain seconds {self.drain_seconds}: must not be negative")
