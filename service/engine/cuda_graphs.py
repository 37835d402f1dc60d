"""Decode steps replayed from CUDA graphs.

On a GPU a decode step of an 8B model is ~4 ms of kernels but hundreds of Python-launched ops; on a
slow host CPU the launches dominate. So the runner captures, once at start-up, the whole forward pass
plus the logits for a ladder of batch sizes, over static input buffers. A decode-only step of `bs`
rows pads to the next captured size (padding rows write nowhere: slot -1) and replays.

The attention grid is sized for `max_model_len` (the kernels stop at each row's real length), so one
graph serves every context length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from pagoda.service.model.attention import AttentionMetadata
from pagoda.service.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    ladder = [1, 2, 4, 8, *range(16, 257, 16)]
    return [bs for bs in ladder if bs <= max_num_seqs] or [1]


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
    ) -> None:
        self.model = model
        self.device = device
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_num_seqs)
        max_bs = self.sizes[-1]
        width = -(-max_model_len // block_size)

        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(max_bs, dtype=torch.int64)
        self.positions = zeros(max_bs, dtype=torch.int64)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.block_tables = zeros(max_bs, width)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            self._forward(bs)  # warm-up: compiles the Triton kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s",
            self.sizes,
            time.perf_counter() - start,
        )

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        fill_inputs: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:  # [bs, vocab] float32 logits
        """Replay the smallest graph that holds this decode batch (rows of one token each).
        `fill_inputs` writes, on the device, the input ids the host does not know yet."""
        bs = len(input_ids)
        graph_bs = next(s for s in self.sizes if s >= bs)

        def put(dst: torch.Tensor, src: np.ndarray) -> None:  # page-locked: no wait for queued work
            dst.copy_(torch.from_numpy(src).pin_memory(), non_blocking=True)

        put(self.input_ids[:bs], input_ids)
        if fill_inputs is not None:
            fill_inputs(self.input_ids[:bs])
        put(self.positions[:bs], positions)
        put(self.slot_mapping[:bs], slot_mapping)
        self.slot_mapping[bs:graph_bs].fill_(-1)
        put(self.seq_lens[:bs], seq_lens.astype(np.int32))
        self.seq_lens[bs:graph_bs].fill_(1)
        put(self.block_tables[:bs, : block_tables.shape[1]], block_tables)
        graph, logits = self.graphs[graph_bs]
        graph.replay()
        return logits[:bs]
