"""Steps replayed from CUDA graphs: decode batches, and mixed batches of prefill chunks and decodes.

On a GPU a step of an 8B model is a few milliseconds of kernels but hundreds of Python-launched ops;
on a slow host CPU the launches dominate (the GPU machine's host needs ~15 ms to launch one eager
step). So the runner captures, once at start-up, the whole forward pass plus the logits over static
input buffers, for two ladders of sizes:

- decode: `bs` rows of one token each, for batch sizes 1, 2, 4, 8, 16, ... up to `max_num_seqs` or
  `--max-cudagraph-capture-size` (1024 by default; larger batches replay a mixed graph or run eagerly);
- mixed: `T` tokens of up to `max_num_seqs` sequences, any of them prefill chunks, for token counts
  up to the step budget. Under load, requests arrive while others decode, so most steps carry a
  prefill chunk or two beside hundreds of decodes; without these graphs every such step runs eager.

A step pads to the next captured size. Padding tokens write nowhere (slot -1) and belong to no
sequence; padding sequences have no query tokens (every attention kernel skips them) and a context
of 0 (mixed) or 1 (decode). Rows are independent in every other op, so padding never reaches a real
row. The attention grids are sized for `max_model_len` (the kernels stop at each row's real length),
so one graph serves every context length.

With LoRA adapters (`lora`), each token's slot is one more static input (padding: -1, no adapter),
and the adapters' kernels run their one-token-at-a-time form (BGMV) in both ladders, whose grids do
not depend on how tokens group into sequences.

`capture=False` runs the same padded forward eagerly: how tests on the CPU check the padding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from pagoda.service.model.attention import AttentionMetadata
from pagoda.service.model.llama import LlamaForCausalLM
from pagoda.service.model.lora import LoRABatch

logger = logging.getLogger(__name__)
Hidden = torch.Tensor | None  # a mixed graph's hidden states (the LM head's input); a decode graph keeps none


def graph_batch_sizes(max_num_seqs: int, max_capture: int = 1024) -> list[int]:
    """The decode graphs' batch sizes: 1, 2, 4, 8, then every 16 to 256 and every 128 past it, up to
    the first that holds `max_num_seqs` rows, none above `max_capture`
    (`EngineConfig.max_cudagraph_capture_size`).

    Past 256 the steps are whole 128-row tiles of the fp8 GEMMs: on an H100 a 448-row decode graph's
    projections took 1.23x a 512-row one's (BENCHMARKS.md, 2026-12-06, fifteenth session). The first
    size past `max_num_seqs` is kept so that a full batch still replays a decode graph (padded) rather
    than a mixed graph, which pads to its token ladder and launches the prefill kernel too."""
    ladder = [1, 2, 4, 8, *range(16, 257, 16), *range(384, max(max_num_seqs, 384) + 128, 128)]
    holds = next(bs for bs in ladder if bs >= max_num_seqs)
    return [bs for bs in ladder if bs <= min(holds, max_capture)]


def mixed_token_sizes(max_num_batched_tokens: int, limit: int = 2048) -> list[int]:
    """Token counts of the mixed graphs (`limit`: `EngineConfig.cuda_graph_max_tokens`). Past about
    2k tokens a step's kernels outlast its eager launches on the GPU machine's host, so a graph
    would gain little there."""
    ladder = [128, 256, 384, 512, 768, 1024, 1536, 2048]
    return [t for t in ladder if t <= min(max_num_batched_tokens, limit)]


def _put(dst: torch.Tensor, src: np.ndarray) -> None:
    """Host -> device without waiting for queued work (page-locked, non-blocking)."""
    host = torch.from_numpy(np.ascontiguousarray(src))
    if dst.is_cuda:
        dst.copy_(host.pin_memory(), non_blocking=True)
    else:
        dst.copy_(host)


class StepGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        device: torch.device,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        capture: bool = True,
        max_mixed_tokens: int = 2048,
        lora: LoRABatch | None = None,
        max_capture: int = 256,
    ) -> None:
        self.model = model
        self.lora = lora
        self.device = device
        self.max_model_len = max_model_len
        self.capture_graphs = capture
        self.sizes = graph_batch_sizes(max_num_seqs, max_capture)
        self.mixed_sizes = mixed_token_sizes(max_num_batched_tokens, max_mixed_tokens)
        self.max_seqs = max_num_seqs
        max_tokens = max([self.sizes[-1], *self.mixed_sizes])
        width = -(-max_model_len // block_size)

        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        # Token inputs, shared by both ladders (each replay writes every row it reads).
        self.input_ids = zeros(max_tokens, dtype=torch.int64)
        self.positions = zeros(max_tokens, dtype=torch.int64)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)  # LoRA
        # Decode: row i is sequence i, so query_start_loc never changes.
        max_bs = self.sizes[-1]
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.block_tables = zeros(max_bs, width)
        # Mixed: sequence metadata for up to max_num_seqs sequences, and the rows to score.
        self.mixed_seq_lens = zeros(max_num_seqs)
        self.mixed_query_start_loc = zeros(max_num_seqs + 1)
        self.mixed_block_tables = zeros(max_num_seqs, width)
        self.logits_rows = zeros(max_num_seqs, dtype=torch.int64)
        # Every graph writes its logits, in the LM head's dtype, into this one buffer outside the graphs'
        # pool: a replay's logits are read (sampled, on the device's queue) before the next replay
        # overwrites them. Kept per graph, as float32, they took ~0.5 MB a row at Llama-3's vocabulary
        # in every graph: ~1.1 GB over the decode ladder to 256, and max_num_seqs rows in each of the 8
        # mixed graphs. The sampler widens them only where a row needs more than their argmax.
        head = model.lm_head.weight.dtype if model.lm_head is not None else torch.float32
        self.logits = torch.empty(
            (max(max_bs, max_num_seqs), model.config.vocab_size), dtype=head, device=device
        )
        # For a mixed graph, the hidden states its logits came from (`run_mixed`), kept in the graphs'
        # memory pool: 8 KB a token row at an 8B's width in bf16, ~55 MB over the default ladder's 8 sizes
        # (128 .. 2,048 tokens).
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, Hidden]] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def fits_mixed(self, num_tokens: int, num_seqs: int) -> bool:
        """Whether a mixed graph holds the step (any number of its rows' logits: see `run_mixed`)."""
        return bool(self.mixed_sizes) and num_tokens <= self.mixed_sizes[-1] and num_seqs <= self.max_seqs

    def _decode_forward(self, bs: int) -> tuple[torch.Tensor, Hidden]:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            decode_rows=True,
        )
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], meta)
        # A decode step scores every row: no hidden states kept.
        return self.model.compute_logits(hidden, out=self.logits[:bs]), None

    def _mixed_forward(self, num_tokens: int) -> tuple[torch.Tensor, Hidden]:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=self.mixed_block_tables,
            seq_lens=self.mixed_seq_lens,
            query_start_loc=self.mixed_query_start_loc,
            max_query_len=num_tokens,  # > 1: the prefill kernel runs (its grid does not depend on it)
            max_seq_len=self.max_model_len,
            decode_rows=True,  # a replay's rows are the step's: some may decode
        )
        hidden = self.model(self.input_ids[:num_tokens], self.positions[:num_tokens], meta)
        rows = hidden.index_select(0, self.logits_rows)
        return self.model.compute_logits(rows, out=self.logits[: len(self.logits_rows)]), hidden

    def _forward(self, key: tuple[str, int]) -> tuple[torch.Tensor, Hidden]:  # logits, hidden
        kind, size = key
        if self.lora is not None:  # the adapters read the static slots (every call: the runner's
            self.lora.token_slots = self.token_slots[:size]  # eager steps point them elsewhere)
            self.lora.segments = None
            self.lora.active = True
        return self._decode_forward(size) if kind == "decode" else self._mixed_forward(size)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph (the largest first, so smaller graphs reuse its memory pool). Without
        `capture`, there is nothing to do: each replay runs its forward eagerly."""
        if not self.capture_graphs:
            return
        start = time.perf_counter()
        pool = None
        keys = [("mixed", t) for t in reversed(self.mixed_sizes)]
        keys += [("decode", b) for b in reversed(self.sizes)]
        for key in keys:
            self._forward(key)  # warm-up: compiles the Triton kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits, hidden = self._forward(key)
            pool = graph.pool()
            self.graphs[key] = (graph, logits, hidden)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs for decode batches of %s and mixed steps of %s tokens in %.1f s",
            self.sizes,
            self.mixed_sizes,
            time.perf_counter() - start,
        )

    def _replay(self, key: tuple[str, int]) -> tuple[torch.Tensor, Hidden]:  # logits, hidden
        if not self.capture_graphs:
            return self._forward(key)
        graph, logits, hidden = self.graphs[key]
        graph.replay()
        return logits, hidden

    def _put_tokens(
        self,
        size: int,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        fill_inputs: Callable[[torch.Tensor], None] | None,
        token_slots: np.ndarray | None = None,
    ) -> None:
        n = len(input_ids)
        _put(self.input_ids[:n], input_ids)
        if fill_inputs is not None:
            fill_inputs(self.input_ids[:n])
        _put(self.positions[:n], positions)
        _put(self.slot_mapping[:n], slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        if self.lora is not None:
            if token_slots is None:
                raise ValueError("a graph with LoRA slots replayed without each token's slot")
            _put(self.token_slots[:n], token_slots)
            self.token_slots[n:size].fill_(-1)

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        fill_inputs: Callable[[torch.Tensor], None] | None = None,
        token_slots: np.ndarray | None = None,
    ) -> torch.Tensor:  # [bs, vocab] logits in the LM head's dtype
        """Replay the smallest decode graph that holds this batch (rows of one token each).
        `fill_inputs` writes, on the device, the input ids the host does not know yet; `token_slots`:
        each token's LoRA slot (with adapters)."""
        bs = len(input_ids)
        graph_bs = next(s for s in self.sizes if s >= bs)
        self._put_tokens(graph_bs, input_ids, positions, slot_mapping, fill_inputs, token_slots)
        _put(self.seq_lens[:bs], seq_lens.astype(np.int32))
        self.seq_lens[bs:graph_bs].fill_(1)
        _put(self.block_tables[:bs, : block_tables.shape[1]], block_tables)
        return self._replay(("decode", graph_bs))[0][:bs]

    def run_mixed(
        self,
        batch: dict[str, np.ndarray],
        logits_rows: np.ndarray,
        fill_inputs: Callable[[torch.Tensor], None] | None = None,
        token_slots: np.ndarray | None = None,
    ) -> torch.Tensor:  # [len(logits_rows), vocab] logits (the LM head's dtype; float32 past the rows)
        """Replay the smallest mixed graph that holds this flattened batch (`ModelRunner.prepare`'s
        layout) and return the logits of the token rows `logits_rows`. The graphs compute the logits of
        up to `max_num_seqs` rows (one a sequence); a speculative verify step scores each drafting
        sequence's 1 + k rows, so past that its logits come from the graph's hidden states after the
        replay (one eager LM head), not from an eager forward of the whole step."""
        num_tokens, num_seqs = len(batch["input_ids"]), len(batch["seq_lens"])
        size = next(t for t in self.mixed_sizes if t >= num_tokens)
        self._put_tokens(
            size, batch["input_ids"], batch["positions"], batch["slot_mapping"], fill_inputs, token_slots
        )
        _put(self.mixed_seq_lens[:num_seqs], batch["seq_lens"].astype(np.int32))
        self.mixed_seq_lens[num_seqs:].fill_(0)
        _put(self.mixed_query_start_loc[: num_seqs + 1], batch["query_start_loc"].astype(np.int32))
        self.mixed_query_start_loc[num_seqs + 1 :].fill_(num_tokens)
        block_tables = batch["block_tables"]
        _put(self.mixed_block_tables[:num_seqs, : block_tables.shape[1]], block_tables)
        if len(logits_rows) > len(self.logits_rows):
            self.logits_rows.fill_(0)  # rows within every graph's tokens (stale ones may not be)
            hidden = self._replay(("mixed", size))[1]
            assert hidden is not None
            rows = torch.empty(len(logits_rows), dtype=torch.int64, device=self.device)
            _put(rows, logits_rows.astype(np.int64))
            return self.model.compute_logits(hidden.index_select(0, rows))
        _put(self.logits_rows[: len(logits_rows)], logits_rows.astype(np.int64))
        self.logits_rows[len(logits_rows) :].fill_(0)
        return self._replay(("mixed", size))[0][: len(logits_rows)]
