"""The one torch-heavy engine file: owns the model and the KV cache tensors, turns a
`SchedulerOutput` into one flattened forward pass (no padding), and samples the rows that need it.

A step has three parts so that tensor parallelism can split them: `prepare` (the scheduler's requests
-> a `StepInput` of host arrays), `forward` (on every rank: the same collectives in the same order),
`finish` (rank 0 only: sampling and prompt log-probabilities). One rank runs all three in `execute`,
or queues them in `launch` without waiting for the device: then a `PLACEHOLDER` input (a token the
step before sampled, not read by the host yet) is taken from that step's tokens on the device.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda import kernels
from pagoda.kernels import cudnn_attention
from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.core.request import PLACEHOLDER, Request
from pagoda.service.engine.core.scheduler import GrammarBitmask, SchedulerOutput
from pagoda.service.engine.runner.block_tables import BlockTables
from pagoda.service.engine.runner.cuda_graphs import StepGraphs
from pagoda.service.engine.runner.draft_model import DraftModel, rows_it_lacks
from pagoda.service.engine.runner.lora import LoRARunner
from pagoda.service.engine.runner.pipeline import (
    attention_metadata,
    run_stage,
    split_micro_batches,
    warm_up_stage,
)
from pagoda.service.engine.runner.sampler import SampledBatch, Sampler, SampleResult, to_device
from pagoda.service.engine.runner.spec_verify import verify_drafts
from pagoda.service.model.attention import (
    LONG_CHUNK_TOKENS,
    WHOLE_PROMPT_TOKENS,
    PagedAttention,
    allocate_kv_cache,
    copy_kv_blocks,
    kv_block_bytes,
)
from pagoda.service.model.config import ModelConfig
from pagoda.service.model.fp8 import quantize_model_fp8, run_cublaslt_without_workspace, supports_fp8_matmul
from pagoda.service.model.llama import LlamaForCausalLM
from pagoda.service.model.loader import load_model
from pagoda.service.model.lora import LoRABatch
from pagoda.service.model.parallel import SINGLE_RANK, TPGroup
from pagoda.service.model.pipeline import SINGLE_STAGE, PPGroup

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 512 << 20
_CUDA_RESERVE_BYTES = 512 << 20  # the allocator's fragmentation, cuBLAS workspaces, NCCL buffers


def kv_cache_budget(total: int, free: int, utilization: float, activations: int, cached: int = 0) -> int:
    """Bytes for the KV cache on one GPU, as vLLM's `--gpu-memory-utilization` means it: the engine
    uses `utilization` of the GPU's whole memory, weights and everything else included. What is in use
    already (`total - free`: the weights once loaded, the CUDA context, other processes) comes out of
    that share, then the activations of the largest step and a fixed reserve. `cached`: memory this
    process's allocator holds but no tensor uses (an engine shut down before this one, in the same
    process): the device counts it as taken, this engine can reuse it."""
    return int(total * utilization) - (total - free - cached) - activations - _CUDA_RESERVE_BYTES


def step_activation_bytes(
    config: EngineConfig,
    mc: ModelConfig,
    attention: PagedAttention,
    dtype: torch.dtype,
    device: torch.device,
    draft: ModelConfig | None = None,
) -> int:
    """What a step needs beside the KV cache, which `kv_cache_budget` leaves out of it: the largest
    step's activations and the sampler's float32 logits, a draft model's too (its graphs' pool is its
    own), and, where prompt chunks attend through cuDNN (`--long-prefill-attention cudnn`, budgets of
    LONG_CHUNK_TOKENS or more), the gathered context of a budget-long chunk at the longest context
    (`cudnn_attention.transient_bytes`, which the warm-up's plans allocate too). `attention`: a layer of
    this rank's, for its heads."""
    tokens, size = config.max_num_batched_tokens, dtype.itemsize
    total = 0
    for c in (mc,) if draft is None else (mc, draft):
        total += tokens * (4 * c.hidden_size + 3 * c.intermediate_size) * size
        total += 3 * config.max_num_seqs * c.vocab_size * 4
    q = torch.empty((0, attention.num_heads, attention.head_dim), dtype=dtype, device=device)
    if (
        config.long_prefill_attention == "cudnn"
        and tokens >= LONG_CHUNK_TOKENS
        and cudnn_attention.is_supported(q)
    ):
        context = config.max_model_len or mc.max_position_embeddings
        total += cudnn_attention.transient_bytes(
            tokens, context, attention.num_heads, attention.num_kv_heads, attention.head_dim, dtype
        )
    if (
        config.long_prefill_attention == "cudnn"
        and tokens >= WHOLE_PROMPT_TOKENS
        and cudnn_attention.is_supported(q)
    ):
        # Whole prompts' own K and V beside the rotated q (`PagedAttention._own_rows`), past the step too.
        rows = tokens + cudnn_attention.SHAPE_BUCKET
        total += 2 * rows * attention.num_kv_heads * attention.head_dim * size
    return total


def warm_up_query_lens(budget: int) -> list[list[int]]:
    """The prompt batches the warm-up runs, each as its prompts' lengths, for a step budget of `budget`
    tokens: the budget in one prompt, then single prompts of 16, 32, ... tokens (cuBLAS picks its GEMM
    kernels by shape, and loading each kernel's module the first time costs ~0.1 s on the GPU machine's
    host: CUDA lazy loading), then batches of 4 and 3 prompts. Triton specializes an integer argument on
    being 1 and on being a multiple of 16 (the kernels taking a step's token count): the totals are the
    budget and 19 tokens (15 under a budget of 16); batches of one token are the decode graphs'. The
    decode path's split variants are `PagedAttention.compile_decode_variants`'."""
    singles = [[n] for n in (2**i for i in range(4, 16)) if n < budget]
    return [[budget], *singles, [max(budget // 4, 1)] * 4, [1, 1, max(min(17, budget - 3), 1)]]


InputFill = Callable[[torch.Tensor], None]  # writes inputs the host does not have into a step's input ids
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def v_cache_token_major(kv_dtype: torch.dtype) -> bool:
    """Whether the V cache is kept token-major (`kernels.kv_cache.cache_view`): an fp8 one is, so that
    attention reads its 8-bit V tiles contiguous along P @ V's reduction, as it reads K. The
    PAGODA_V_CACHE_TOKEN_MAJOR environment variable, 0 or 1, overrides it (a benchmark knob)."""
    knob = os.environ.get("PAGODA_V_CACHE_TOKEN_MAJOR", "")
    if knob not in ("", "0", "1"):
        raise ValueError(f"PAGODA_V_CACHE_TOKEN_MAJOR must be 0 or 1, got {knob!r}")
    return knob == "1" if knob else kv_dtype == torch.float8_e4m3fn


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but no CUDA device is available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


@dataclass
class StepResult:
    sampled: dict[str, SampleResult]  # request id -> its next token
    prompt_logprobs: dict[str, tuple[int, list[SampleResult]]]  # request id -> (first position, scores)
    accepted: dict[str, int] = field(default_factory=dict)  # request id -> drafts kept (those that drafted)


@dataclass
class StepInput:
    """One step as every rank runs it: no `Request` objects, only what the forward pass reads."""

    batch: dict[str, np.ndarray]  # the flattened batch, see `ModelRunner.prepare`
    copy_ops: list[tuple[int, int]]  # (src, dst) KV blocks to copy first
    sample_rows: list[int]  # requests whose last row's logits are sampled, in batch order
    # The flattened rows whose logits are computed: each sampled request's last 1 + drafts rows.
    logit_rows: np.ndarray
    num_drafts: list[int]  # per sampled request: its drafts (speculative decoding), verified in `finish`
    prompt_chunks: list[tuple[int, int, int]]  # (request, first row, num rows) scored for prompt logprobs
    # (flattened row, row in the previous step's sampled tokens) of inputs the host does not know yet,
    # and how many tokens that step sampled (under TP, rank 0 broadcasts them to the other ranks).
    placeholders: list[tuple[int, int]]
    num_prev_tokens: int
    lora_loads: list[tuple[int, str, str]] = field(
        default_factory=list
    )  # (slot, adapter, path) to load first


@dataclass
class PendingStep:
    """A step queued on the device. `result()` waits for its sampled tokens only, not for the steps
    queued after it."""

    sampled: SampledBatch | None
    rows: dict[str, int]  # request id -> its row in `sampled.tokens`
    prompt_logprobs: dict[str, tuple[int, list[SampleResult]]]
    verified: dict[str, tuple[SampleResult, int]] = field(default_factory=dict)  # drafted: (token, kept)

    def result(self) -> StepResult:
        sampled = {rid: token for rid, (token, _) in self.verified.items()}
        accepted = {rid: kept for rid, (_, kept) in self.verified.items()}
        if self.sampled is not None:
            results = self.sampled.results()
            sampled.update((rid, results[row]) for rid, row in self.rows.items())
        return StepResult(sampled, self.prompt_logprobs, accepted)


@dataclass
class StepLogits:
    sample: torch.Tensor | None  # [len(sample_rows), vocab] float32
    prompt: list[torch.Tensor]  # [num rows, vocab] float32, one per prompt chunk


@dataclass
class ForwardedStep:
    """A step whose forward pass is queued and whose sampling is not yet: between the two the core
    gives the grammars their turn (`EngineCore.step`)."""

    out: SchedulerOutput
    step: StepInput
    logits: StepLogits


@dataclass(frozen=True)
class KVCacheLayout:
    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


class ModelRunner:
    """One rank's model and KV cache. `agree_num_blocks`: with several ranks, turns this rank's KV block
    count into the one all ranks use (their minimum). `pp`: this rank's pipeline stage, whose layers
    alone it holds and caches."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        eos_token_ids: set[int],
        tp: TPGroup = SINGLE_RANK,
        agree_num_blocks: Callable[[int], int] | None = None,
        pp: PPGroup = SINGLE_STAGE,
    ) -> None:
        self.config = config
        self.tp = tp
        self.pp = pp
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and tp.size * pp.size > 1:
            # rank r on cuda:r of its node: r - k * R on node k (EngineConfig.ranks_per_node)
            self.device = torch.device("cuda", pp.rank % config.ranks_per_node)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        if config.quantization == "fp8":
            # Load in the model dtype on the CPU, quantize layer by layer onto the device: the device
            # never holds more than one layer in 16 bits.
            if self.device.type == "cuda":
                run_cublaslt_without_workspace()
            self.model, self.model_config = load_model(model_path, self.dtype, "cpu", tp, pp)
            count = quantize_model_fp8(self.model, self.device)
            path = "Triton + torch._scaled_mm" if supports_fp8_matmul(self.device) else "float32 emulation"
            logger.info("fp8: %d projections quantized (W8A8, per-row and per-token scales; %s)", count, path)
        else:
            self.model, self.model_config = load_model(model_path, self.dtype, self.device, tp, pp)
        mc = self.model_config
        # LoRA slots before the KV cache, whose budget is what they leave of the GPU's memory.
        self.lora = (
            LoRARunner(self.model, mc, config.lora, tp, self.dtype, self.device)
            if config.lora is not None
            else None
        )
        self.num_kv_heads = self.model.attention_layers()[0].num_kv_heads  # this rank's
        self.num_layers = len(self.model.attention_layers())  # this stage's: the KV cache holds no others
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        self.draft: DraftModel | None = None  # speculative decoding's draft model, on rank 0
        spec = config.speculative
        if spec is not None and spec.model is not None and tp.rank == 0:
            self.draft = DraftModel(spec.model, self.dtype, self.device, config.block_size)
            self.draft.check_vocabulary(mc)
        self.kv = self._kv_cache_layout(agree_num_blocks)
        v_token_major = v_cache_token_major(self.kv_dtype)
        self.kv_cache = allocate_kv_cache(
            self.model.attention_layers(), self.kv.num_blocks, config.block_size, self.kv_dtype, self.device,
            v_token_major,
        )  # fmt: skip
        if self.draft is not None:
            self.draft.allocate(self.kv.num_blocks, self.kv_dtype, v_token_major)
        self.max_model_len = self._max_model_len()
        # Eager steps' prompt chunks this long attend through cuDNN (`--long-prefill-attention cudnn`).
        self.long_chunk_tokens = LONG_CHUNK_TOKENS if config.long_prefill_attention == "cudnn" else None
        self.whole_prompt_tokens = WHOLE_PROMPT_TOKENS if self.long_chunk_tokens is not None else None
        max_blocks = -(-self.max_model_len // config.block_size) + 1  # +1: a fork's copy-on-write slack
        self.block_tables = BlockTables(config.max_num_seqs + 64, max_blocks)
        self.sampler = Sampler(mc.vocab_size, eos_token_ids)
        self.graphs: StepGraphs | None = None
        if self.device.type == "cuda":
            self._warm_up()
        if self.device.type == "cuda" and not config.enforce_eager and pp.size > 1:
            # A graph would hold one stage's part of one micro-batch, its sends and receives included: not
            # built yet. Eager steps here cost the host's launches (~15 ms a step of an 8B model).
            logger.info("pipeline parallelism: CUDA graphs off, every step runs eagerly")
        elif self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = self.step_graphs(self.model, self.lora.batch if self.lora is not None else None)
            self.graphs.capture()
            if self.draft is not None:
                self.draft.use_graphs(self.step_graphs(self.draft.model, None))
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s on %s)",
            self.kv.num_blocks,
            config.block_size,
            self.kv.num_tokens,
            self.kv.num_blocks * self.kv.bytes_per_block / 2**20,
            self.kv_dtype,
            self.device,
        )

    def _max_model_len(self) -> int:
        mc = self.model_config
        limit = self.config.max_model_len or mc.max_position_embeddings
        if limit > mc.max_position_embeddings:
            # Positions past the model's own limit have no rotary embedding: a prompt there would fail.
            raise ValueError(
                f"--max-model-len {limit} is more than the model's max_position_embeddings "
                f"({mc.max_position_embeddings}); use at most that"
            )
        if mc.sliding_window is not None and limit > mc.sliding_window:
            # Attention here is full-context; within the window that is exactly sliding-window attention.
            logger.warning("max_model_len clamped to the sliding window, %d tokens", mc.sliding_window)
            limit = mc.sliding_window
        if limit > self.kv.num_tokens:
            logger.warning("max_model_len clamped to %d: the KV cache holds no more", self.kv.num_tokens)
            limit = self.kv.num_tokens
        return limit

    def _kv_cache_layout(self, agree_num_blocks: Callable[[int], int] | None) -> KVCacheLayout:
        mc, cfg = self.model_config, self.config
        bytes_per_block = kv_block_bytes(
            self.num_layers, cfg.block_size, self.num_kv_heads, mc.head_dim, self.kv_dtype
        )
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            activations = step_activation_bytes(
                cfg, mc, self.model.attention_layers()[0], self.dtype, self.device,
                self.draft.config if self.draft is not None else None,
            )  # fmt: skip
            budget = kv_cache_budget(total, free, cfg.gpu_memory_utilization, activations, cached)
        else:
            budget = _CPU_DEFAULT_KV_BYTES
        # A draft model's cache has as many blocks as the target's: each block costs both.
        draft_bytes = self.draft.bytes_per_block(self.kv_dtype) if self.draft is not None else 0
        num_blocks = budget // (bytes_per_block + draft_bytes)
        if num_blocks < 1:
            raise ValueError(
                f"no room for the KV cache: the budget is {budget / 2**20:.1f} MiB and one block of "
                f"{cfg.block_size} tokens takes {bytes_per_block / 2**20:.2f} MiB (--gpu-memory-utilization "
                f"{cfg.gpu_memory_utilization} is the share of the whole GPU memory, the weights included)"
            )
        if agree_num_blocks is not None:
            num_blocks = agree_num_blocks(int(num_blocks))
        return KVCacheLayout(int(num_blocks), cfg.block_size, bytes_per_block)

    def step_graphs(
        self, model: LlamaForCausalLM, lora: LoRABatch | None, capture: bool = True
    ) -> StepGraphs:
        """CUDA graphs of `model`'s steps at this engine's sizes (the target's, or the draft model's)."""
        cfg = self.config
        return StepGraphs(
            model, self.device, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len,
            cfg.block_size, capture=capture, max_mixed_tokens=cfg.cuda_graph_max_tokens, lora=lora,
            max_capture=cfg.max_cudagraph_capture_size,
        )  # fmt: skip

    # ---- one step ------------------------------------------------------------------------------

    def prepare(self, out: SchedulerOutput, after: PendingStep | None = None) -> StepInput:
        """The flattened batch as host arrays (no padding, one row per scheduled token), and which
        rows' logits the step needs. `after`: the step queued before, if placeholders are inputs."""
        reqs, counts = out.requests, np.asarray(out.num_scheduled_tokens, dtype=np.int64)
        starts = np.asarray([r.num_computed_tokens for r in reqs], dtype=np.int64)
        query_start_loc = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        input_ids = np.fromiter(
            (t for r, s, n in zip(reqs, starts, counts, strict=True) for t in r.token_ids[s : s + n]),
            dtype=np.int64,
            count=total,
        )
        row = np.repeat(np.arange(len(reqs)), counts)
        positions = np.arange(total) - query_start_loc[:-1][row] + starts[row]
        block_tables = self.block_tables.gather(reqs)
        bs = self.kv.block_size
        slot_mapping = block_tables[row, positions // bs].astype(np.int64) * bs + positions % bs
        batch = {
            "input_ids": input_ids,
            "positions": positions,
            "slot_mapping": slot_mapping,
            "block_tables": block_tables,
            "seq_lens": starts + counts,
            "query_start_loc": query_start_loc,
            "max_query_len": counts.max(),
        }
        if self.lora is not None:
            batch["lora_slots"] = np.fromiter((r.lora_slot for r in reqs), dtype=np.int32, count=len(reqs))
        # Logits at position p score the prompt's token p + 1: a chunk scores up to the last prompt token.
        prompt_chunks = []
        for i, req in enumerate(reqs):
            if req.params.prompt_logprobs is not None:
                start = req.num_computed_tokens
                end = min(start + out.num_scheduled_tokens[i], req.num_prompt_tokens - 1)
                if start < end:
                    prompt_chunks.append((i, int(query_start_loc[i]), end - start))
        rows = [i for i in range(len(reqs)) if out.needs_sample(i)]
        num_drafts = [reqs[i].num_drafts for i in rows]
        ends = query_start_loc[1:][rows]
        logit_rows = np.concatenate(
            [np.arange(end - 1 - k, end) for end, k in zip(ends, num_drafts, strict=True)]
        ) if any(num_drafts) else ends - 1  # fmt: skip
        placeholders = np.flatnonzero(input_ids == PLACEHOLDER)
        if len(placeholders) and (after is None or after.sampled is None):
            raise RuntimeError("a step has placeholder inputs but no step queued before it")
        prev_rows = after.rows if after is not None else {}
        return StepInput(
            batch,
            list(out.copy_ops),
            rows,
            logit_rows.astype(np.int64),
            num_drafts,
            prompt_chunks,
            [(int(r), prev_rows[reqs[row[r]].request_id]) for r in placeholders],
            len(prev_rows),
            list(out.lora_loads),
        )

    def _warm_up(self) -> None:
        """Compile the prefill kernels before the first request: on a slow host a Triton compile takes
        about a second, which would land in some user's time to first token. Writes no KV (slot -1)."""
        budget = min(self.config.max_num_batched_tokens, self.max_model_len)
        # With adapters on, the batches run a second time through an adapter slot (zeros until an adapter
        # loads: no output changes), else the first adapter's prompt would compile LoRA's SGMV kernels
        # inside its step, every request in it waiting. A draft model runs them too (its shadow steps).
        lora_passes = (-1, 0) if self.lora is not None else (-1,)
        for query_lens, slot in itertools.product(warm_up_query_lens(budget), lora_passes):
            lens = np.asarray(query_lens, dtype=np.int64)
            starts = np.zeros(len(lens) + 1, dtype=np.int64)
            np.cumsum(lens, out=starts[1:])
            total = int(starts[-1])
            batch = {
                "input_ids": np.zeros(total, dtype=np.int64),
                "positions": np.concatenate([np.arange(n) for n in lens]),
                "slot_mapping": np.full(total, -1, dtype=np.int64),
                "block_tables": np.zeros(
                    (len(lens), -(-int(lens.max()) // self.kv.block_size)), dtype=np.int32
                ),
                "seq_lens": lens,
                "query_start_loc": starts,
                "max_query_len": lens.max(),
            }
            if self.lora is not None:
                self.lora.set_step(batch | {"lora_slots": np.full(len(lens), slot, dtype=np.int32)})
            with torch.inference_mode():
                if self.pp.size > 1:
                    warm_up_stage(self.model, self.pp, batch, self.device, self.dtype)
                    continue
                hidden = self._forward_eager(batch)
                self.model.compute_logits(hidden[self._last_rows(batch, list(range(len(lens))))])
                if self.draft is not None and slot == -1:  # its own shapes: its own kernel variants
                    self.draft.shadow(batch, None)
        with torch.inference_mode():
            # The sampler's kernels: the argmax over float32 logits and over the graphs' (the LM head's
            # dtype), seeded rows' noise with and without the verifier's uniform.
            vocab = self.model_config.vocab_size
            for dtype in (torch.float32, self.dtype):
                kernels.argmax(torch.zeros(1, vocab, dtype=dtype, device=self.device))
            noise, uniform = torch.empty(1, vocab, device=self.device), torch.empty(1, device=self.device)
            seeded = torch.zeros(1, 3, dtype=torch.int32, device=self.device)  # row 0, key 0
            for with_uniform in (None, uniform):
                kernels.fill_seeded_noise(noise, seeded, with_uniform)
            counts = self.model.attention_layers()[0].compile_decode_variants(self.max_model_len, self.dtype)
            if self.draft is not None:
                self.draft.model.attention_layers()[0].compile_decode_variants(self.max_model_len, self.dtype)
        logger.debug("decode kernels compiled for %s splits", counts)
        if self.long_chunk_tokens is not None and budget >= self.long_chunk_tokens and self.pp.size == 1:
            # The budget's chunk behind whole-budget prefixes: cuDNN's plans (the first chunk's was above).
            with torch.inference_mode():
                built = self.model.attention_layers()[0].build_long_chunk_plans(
                    budget, self.max_model_len, self.dtype
                )
            logger.debug("cuDNN plans built for %d-token chunks at contexts %s", budget, built)
        if self.whole_prompt_tokens is not None and budget >= self.whole_prompt_tokens and self.pp.size == 1:
            with torch.inference_mode():
                built = self.model.attention_layers()[0].build_whole_prompt_plans(
                    self.whole_prompt_tokens, budget, self.dtype
                )
            logger.debug("cuDNN plans built for whole prompts of %s tokens", built)
        if self.lora is not None:
            self.lora.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward_eager(
        self, batch: dict[str, np.ndarray], fill_inputs: InputFill | None = None
    ) -> torch.Tensor:  # [num_tokens, hidden]
        meta = attention_metadata(batch, self.device, self.long_chunk_tokens, self.whole_prompt_tokens)
        input_ids = self._input_ids(batch, fill_inputs)
        return self.model(input_ids, to_device(batch["positions"], torch.int64, self.device), meta)

    def _input_ids(self, batch: dict[str, np.ndarray], fill_inputs: InputFill | None) -> torch.Tensor:
        input_ids = to_device(batch["input_ids"], torch.int64, self.device)
        if fill_inputs is not None:
            fill_inputs(input_ids)
        return input_ids

    def _last_rows(self, batch: dict[str, np.ndarray], rows: list[int]) -> torch.Tensor:
        return to_device(batch["query_start_loc"][1:][rows] - 1, torch.int64, self.device)

    def _prompt_logprobs(
        self, out: SchedulerOutput, step: StepInput, logits: StepLogits
    ) -> dict[str, tuple[int, list[SampleResult]]]:
        """For requests that asked for prompt log-probabilities: each prompt token this step scores, as
        (first scored position, results)."""
        result: dict[str, tuple[int, list[SampleResult]]] = {}
        for (i, _, count), chunk_logits in zip(step.prompt_chunks, logits.prompt, strict=True):
            req = out.requests[i]
            k = req.params.prompt_logprobs or 0
            start = req.num_computed_tokens
            logprobs = torch.log_softmax(chunk_logits, -1)
            targets = torch.tensor(req.token_ids[start + 1 : start + count + 1], device=logprobs.device)
            chosen = logprobs.gather(1, targets[:, None])
            # vLLM's rank: 1 + the tokens strictly likelier. The scheduler scores at most
            # PROMPT_SCORE_TOKENS (512) rows a step, so the comparison's bools stay within 512 x vocab.
            ranks = (logprobs > chosen).sum(dim=1) + 1
            top_vals, top_ids = (
                logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], targets[:, None][:, :0])
            )
            result[req.request_id] = (
                start + 1,
                [
                    SampleResult(t, lp, list(zip(ids, vals, strict=True)), rank)
                    for t, lp, ids, vals, rank in zip(
                        targets.tolist(),
                        chosen[:, 0].tolist(),
                        top_ids.tolist(),
                        top_vals.tolist(),
                        ranks.tolist(),
                        strict=True,
                    )
                ],
            )
        return result

    @torch.inference_mode()
    def forward(self, step: StepInput, prev_tokens: torch.Tensor | None = None) -> StepLogits:
        """The step's logits; with several ranks every rank calls this with the same `step` (only rank
        0's logits are real). `prev_tokens` (rank 0): the previous step's sampled tokens, which fill
        this one's placeholders. A draft model runs the same batch after the target, for its KV cache."""
        copy_kv_blocks(self.kv_cache, step.copy_ops)
        if self.pp.size > 1:
            return self._forward_stage(step, prev_tokens)
        fill_inputs = self._placeholder_fill(step, prev_tokens)
        if self.lora is not None:
            self.lora.load(step.lora_loads)
            self.lora.set_step(step.batch)
        logits = self._forward_target(step, fill_inputs)
        if self.draft is not None:
            self.draft.copy_blocks(step.copy_ops)
            batch = step.batch
            # A drafting step's rows the proposal wrote are skipped, unless a copy-on-write just
            # replaced the blocks it wrote them into (a fork), or placeholders address rows by index.
            if any(step.num_drafts) and not step.copy_ops and fill_inputs is None:
                batch = rows_it_lacks(batch, step.sample_rows, step.num_drafts)
            self.draft.shadow(batch, fill_inputs)
        return logits

    def propose_drafts(self, reqs: list[Request], k: list[int]) -> list[list[int]]:
        """The draft model's `k[i]` greedy tokens after each request's last token."""
        if self.draft is None:
            raise ValueError("no draft model: speculative decoding's config names none")
        return self.draft.propose(reqs, self.block_tables.gather(reqs), k)

    def add_lora(self, name: str, path: str) -> None:
        """Read and check a LoRA adapter into host memory (ValueError: why it cannot be served)."""
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled (--enable-lora)")
        self.lora.add(name, path)

    def _forward_target(self, step: StepInput, fill_inputs: InputFill | None) -> StepLogits:
        batch = step.batch
        num_reqs = len(batch["seq_lens"])
        is_decode = batch["max_query_len"] == 1 and len(step.sample_rows) == num_reqs
        if self.graphs is not None and is_decode and num_reqs <= self.graphs.max_batch_size:
            logits = self.graphs.run(
                batch["input_ids"],
                batch["positions"],
                batch["slot_mapping"],
                batch["seq_lens"],
                batch["block_tables"],
                fill_inputs,
                self.lora.token_slots if self.lora is not None else None,
            )
            return StepLogits(logits, [])
        mixed_fits = self.graphs is not None and self.graphs.fits_mixed(len(batch["input_ids"]), num_reqs)
        if self.graphs is not None and mixed_fits and not step.prompt_chunks:
            token_slots = self.lora.token_slots if self.lora is not None else None
            if not step.sample_rows:
                self.graphs.run_mixed(batch, np.zeros(0, dtype=np.int64), fill_inputs, token_slots)
                return StepLogits(None, [])
            return StepLogits(self.graphs.run_mixed(batch, step.logit_rows, fill_inputs, token_slots), [])
        hidden = self._forward_eager(batch, fill_inputs)
        prompt = [self.model.compute_logits(hidden[row : row + n]) for _, row, n in step.prompt_chunks]
        if not step.sample_rows:  # only prompt chunks this step: the KV cache is filled, nothing to sample
            return StepLogits(None, prompt)
        rows = to_device(step.logit_rows, torch.int64, self.device)
        return StepLogits(self.model.compute_logits(hidden[rows]), prompt)

    def _forward_stage(self, step: StepInput, prev_tokens: torch.Tensor | None) -> StepLogits:
        """This rank's part of a pipelined step (`pipeline.run_stage`): the step's logits on rank 0."""
        micro = split_micro_batches(step.batch, step.logit_rows, step.prompt_chunks, self.pp.size)
        input_ids = None
        if self.pp.is_first:  # only stage 0 reads token ids, so only it takes the placeholders' tokens
            input_ids = self._input_ids(step.batch, self._placeholder_fill(step, prev_tokens))
        got = run_stage(self.model, self.pp, micro, input_ids, self.device, self.dtype)
        return StepLogits(got.sample, got.prompt) if got is not None else StepLogits(None, [])

    def _placeholder_fill(self, step: StepInput, prev_tokens: torch.Tensor | None) -> InputFill | None:
        """What writes the previous step's sampled tokens into this step's input ids, on the device.
        Under TP the other ranks get them from rank 0 first (every rank runs this, in the same order)."""
        if not step.placeholders:
            return None
        if self.tp.rank == 0 and prev_tokens is None:
            raise RuntimeError("a step has placeholder inputs but no tokens from the step before")
        tokens = prev_tokens
        if self.tp.size > 1:
            if tokens is None:
                tokens = torch.empty(step.num_prev_tokens, dtype=torch.int64, device=self.device)
            self.tp.broadcast(tokens)
        assert tokens is not None
        dst = to_device([row for row, _ in step.placeholders], torch.int64, self.device)
        src = to_device([prev for _, prev in step.placeholders], torch.int64, self.device)

        def fill(input_ids: torch.Tensor) -> None:
            input_ids.index_copy_(0, dst, tokens.index_select(0, src))

        return fill

    @torch.inference_mode()
    def finish(
        self, out: SchedulerOutput, step: StepInput, logits: StepLogits, grammar: GrammarBitmask | None = None
    ) -> PendingStep:
        """Rank 0: queue the sampling of every request that reached its last token (`grammar`: the
        allowed tokens of those under a grammar, by batch row); compute the prompt log-probabilities of
        those that asked for them (these wait for the device)."""
        prompt_logprobs = self._prompt_logprobs(out, step, logits)
        if logits.sample is None:
            return PendingStep(None, {}, prompt_logprobs)
        if any(step.num_drafts):
            return self._verify(out, step, logits.sample, grammar, prompt_logprobs)
        sample_reqs = [out.requests[i] for i in step.sample_rows]
        if grammar is not None:  # batch rows -> rows of the sampled logits
            position = {batch_row: k for k, batch_row in enumerate(step.sample_rows)}
            grammar = GrammarBitmask([position[row] for row in grammar.rows], grammar.bitmask)
        sampled = self.sampler(logits.sample, sample_reqs, grammar)
        rows = {r.request_id: row for row, r in enumerate(sample_reqs)}
        return PendingStep(sampled, rows, prompt_logprobs)

    def _verify(
        self,
        out: SchedulerOutput,
        step: StepInput,
        logits: torch.Tensor,
        grammar: GrammarBitmask | None,
        prompt_logprobs: dict[str, tuple[int, list[SampleResult]]],
    ) -> PendingStep:
        """A step in which some requests drafted: those without drafts sample as in any step (their
        last logits row), those with drafts go through the verifier (all 1 + k rows). Waits for the
        device: a drafting step runs in turn."""
        first = np.cumsum([0, *(k + 1 for k in step.num_drafts)])
        plain = [j for j, k in enumerate(step.num_drafts) if k == 0]
        drafting = [j for j, k in enumerate(step.num_drafts) if k > 0]
        pending = PendingStep(None, {}, prompt_logprobs)
        plain_grammar, draft_grammar = _split_grammar(grammar, step, plain, drafting)
        if plain:
            plain_reqs = [out.requests[step.sample_rows[j]] for j in plain]
            rows = to_device(first[plain], torch.int64, logits.device)
            pending.sampled = self.sampler(logits.index_select(0, rows), plain_reqs, plain_grammar)
            pending.rows = {r.request_id: row for row, r in enumerate(plain_reqs)}
        drafted_reqs = [out.requests[step.sample_rows[j]] for j in drafting]
        rows = to_device(
            np.concatenate([np.arange(first[j], first[j + 1]) for j in drafting]), torch.int64, logits.device
        )
        verdicts = verify_drafts(self.sampler, logits.index_select(0, rows), drafted_reqs, draft_grammar)
        for req, (token, kept) in zip(drafted_reqs, verdicts, strict=True):
            pending.verified[req.request_id] = (SampleResult(token), kept)
        return pending

    def launch_forward(self, out: SchedulerOutput, after: PendingStep | None = None) -> ForwardedStep:
        """Queue one step's forward pass on this rank alone; `sample` queues its sampling."""
        step = self.prepare(out, after)
        prev_tokens = after.sampled.tokens if after and after.sampled else None
        return ForwardedStep(out, step, self.forward(step, prev_tokens))

    def sample(self, forwarded: ForwardedStep, grammar: GrammarBitmask | None = None) -> PendingStep:
        return self.finish(forwarded.out, forwarded.step, forwarded.logits, grammar)

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step on this rank alone."""
        return self.sample(self.launch_forward(out)).result()


def _split_grammar(
    grammar: GrammarBitmask | None, step: StepInput, plain: list[int], drafting: list[int]
) -> tuple[GrammarBitmask | None, GrammarBitmask | None]:
    """A drafting step's grammar rows (by batch row and position) -> those of the plain requests' sampled
    logits, and those of the drafting requests' verification rows (`plain`, `drafting`: indices into
    `step.sample_rows`)."""
    if grammar is None:
        return None, None
    positions = grammar.positions or [0] * len(grammar.rows)
    plain_row = {step.sample_rows[j]: k for k, j in enumerate(plain)}
    starts = np.cumsum([0, *(step.num_drafts[j] + 1 for j in drafting)])[:-1]
    first_row = dict(zip((step.sample_rows[j] for j in drafting), starts, strict=True))
    plain_rows, plain_masks, draft_rows, draft_masks = [], [], [], []
    for m, (row, j) in enumerate(zip(grammar.rows, positions, strict=True)):
        if row in plain_row:
            plain_rows.append(plain_row[row])
            plain_masks.append(m)
        else:
            draft_rows.append(int(first_row[row]) + j)
            draft_masks.append(m)
    return (
        GrammarBitmask(plain_rows, grammar.bitmask[plain_masks]) if plain_rows else None,
        GrammarBitmask(draft_rows, grammar.bitmask[draft_masks]) if draft_rows else None,
    )
