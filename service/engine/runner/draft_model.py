"""A draft model for speculative decoding (`--speculative-config '{"model": DRAFT, ...}'`), on rank 0.

The draft keeps its own paged KV cache with the target's block ids: the same block tables and slot
mapping address both caches, so the block manager needs to know nothing of it. Every step it runs the
target's batch too (`shadow`: prompt chunks, decodes, verified drafts), so its cache holds every token
the target has computed; a step that drafts first runs it k times on one row per drafting sequence
(`propose`), each time on the token it chose before, greedily. An argmax draft is a one-hot q, so the
verifier (spec_verify.py) keeps the target's distribution with the same rule as for prompt lookup.

Unsharded: under tensor parallelism only rank 0 holds it (it has no collectives). On a GPU it has
CUDA graphs of its own (`use_graphs`, the target's two ladders): each proposal round replays a decode
graph and each shadow run a decode or mixed one, else every drafting step would pay k + 1 eager
forwards of host launches (~30 ms each for an 8B model on the GPU machine's host). Steps that fit no
graph run eagerly. It must share the target's vocabulary (checked at load).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from pagoda import kernels
from pagoda.service.engine.core.request import Request
from pagoda.service.engine.runner.cuda_graphs import StepGraphs
from pagoda.service.engine.runner.pipeline import attention_metadata
from pagoda.service.engine.runner.sampler import to_device
from pagoda.service.model.attention import allocate_kv_cache, copy_kv_blocks, kv_block_bytes
from pagoda.service.model.config import ModelConfig
from pagoda.service.model.loader import load_model

logger = logging.getLogger(__name__)


def rows_it_lacks(
    batch: dict[str, np.ndarray], sample_rows: list[int], num_drafts: list[int]
) -> dict[str, np.ndarray]:
    """The part of a verify step's batch whose KV the draft's cache lacks: of a drafting sequence's
    1 + k rows (its last real token, then its drafts) only the last, since its proposal rounds wrote
    the others with the same tokens at the same positions; every other sequence's rows whole. A pure
    drafting step becomes one row a sequence: a decode-shaped shadow run instead of a k + 1-row one.
    `sample_rows`, `num_drafts`: `StepInput`'s (the sampled sequences, their drafts)."""
    qsl = batch["query_start_loc"]
    keep = np.ones(len(batch["input_ids"]), dtype=bool)
    for seq, k in zip(sample_rows, num_drafts, strict=True):
        if k:
            keep[qsl[seq] : qsl[seq + 1] - 1] = False
    counts = np.add.reduceat(keep, qsl[:-1])  # every sequence of a step has a row
    sub = {name: batch[name][keep] for name in ("input_ids", "positions", "slot_mapping")}
    sub["query_start_loc"] = np.concatenate([[0], np.cumsum(counts)]).astype(qsl.dtype)
    sub["max_query_len"] = np.asarray(counts.max(), dtype=np.int64)
    sub["seq_lens"], sub["block_tables"] = batch["seq_lens"], batch["block_tables"]
    return sub


class DraftModel:
    def __init__(self, path: str, dtype: torch.dtype, device: torch.device, block_size: int) -> None:
        self.model, self.config = load_model(path, dtype, device)
        self.device = device
        self.block_size = block_size
        self.kv_cache: torch.Tensor | None = None
        self.graphs: StepGraphs | None = None

    def use_graphs(self, graphs: StepGraphs) -> None:
        """Run through these graphs (built over `self.model`) where a step fits them; captures them
        (a `StepGraphs(capture=False)` runs the same padded forwards eagerly: the CPU tests' way)."""
        self.graphs = graphs
        graphs.capture()

    def bytes_per_block(self, kv_dtype: torch.dtype) -> int:
        layers = self.model.attention_layers()
        return kv_block_bytes(
            len(layers), self.block_size, layers[0].num_kv_heads, layers[0].head_dim, kv_dtype
        )

    def check_vocabulary(self, target: ModelConfig) -> None:
        if self.config.vocab_size != target.vocab_size:
            raise ValueError(
                f"--speculative-config: the draft model's vocabulary ({self.config.vocab_size} tokens) is "
                f"not the target's ({target.vocab_size}); a draft must use the target's tokenizer"
            )

    def allocate(self, num_blocks: int, kv_dtype: torch.dtype, v_token_major: bool) -> None:
        """Its KV cache: as many blocks as the target's, the same layout."""
        mc = self.config
        layers = self.model.attention_layers()
        self.kv_cache = allocate_kv_cache(
            layers, num_blocks, self.block_size, kv_dtype, self.device, v_token_major
        )
        logger.info("draft model: %d layers, KV cache of %d blocks beside the target's", mc.num_hidden_layers,
                    num_blocks)  # fmt: skip

    def copy_blocks(self, copy_ops: list[tuple[int, int]]) -> None:
        assert self.kv_cache is not None
        copy_kv_blocks(self.kv_cache, copy_ops)

    @torch.inference_mode()
    def shadow(
        self, batch: dict[str, np.ndarray], fill_inputs: Callable[[torch.Tensor], None] | None
    ) -> None:
        """Run the target's flattened batch, for the KV it writes (no logits)."""
        graphs = self.graphs
        num_tokens, num_seqs = len(batch["input_ids"]), len(batch["seq_lens"])
        if graphs is not None and num_tokens == num_seqs <= graphs.max_batch_size:
            graphs.run(batch["input_ids"], batch["positions"], batch["slot_mapping"], batch["seq_lens"],
                       batch["block_tables"], fill_inputs)  # fmt: skip
            return
        if graphs is not None and graphs.fits_mixed(num_tokens, num_seqs):
            graphs.run_mixed(batch, np.zeros(0, dtype=np.int64), fill_inputs)
            return
        input_ids = to_device(batch["input_ids"], torch.int64, self.device)
        if fill_inputs is not None:
            fill_inputs(input_ids)
        self.model(
            input_ids,
            to_device(batch["positions"], torch.int64, self.device),
            attention_metadata(batch, self.device),
        )

    @torch.inference_mode()
    def propose(self, reqs: list[Request], block_tables: np.ndarray, k: list[int]) -> list[list[int]]:
        """`k[i]` greedy tokens after each request's last real token. The tokens past it are its
        drafts' slots, which the scheduler has allocated; their KV, but the last's, is written here.
        `block_tables`: the requests'. (Right after a fork the step's copy-on-write has not run yet,
        so such a draft reads a stale block: a worse draft, never a wrong output.)"""
        lengths = np.asarray([r.num_tokens - r.num_drafts for r in reqs], dtype=np.int64)  # before the drafts
        last = [r.token_ids[n - 1] for r, n in zip(reqs, lengths.tolist(), strict=True)]
        tokens = to_device(last, torch.int64, self.device)
        rounds: list[tuple[list[int], torch.Tensor]] = []
        bs = self.block_size
        for j in range(max(k)):
            rows = [i for i, n in enumerate(k) if n > j]
            positions = lengths[rows] - 1 + j
            batch = {
                "input_ids": np.zeros(len(rows), dtype=np.int64),  # `tokens`, on the device
                "positions": positions,
                "slot_mapping": block_tables[rows, positions // bs].astype(np.int64) * bs + positions % bs,
                "block_tables": block_tables[rows],
                "seq_lens": positions + 1,
                "query_start_loc": np.arange(len(rows) + 1, dtype=np.int64),
                "max_query_len": np.ones(1, dtype=np.int64),
            }
            chosen = kernels.argmax(self._decode_logits(batch, tokens))
            rounds.append((rows, chosen))
            # The next round's rows (none after the last).
            keep = [n for n, i in enumerate(rows) if k[i] > j + 1]
            tokens = chosen[to_device(keep, torch.int64, self.device)]
        drafts: list[list[int]] = [[] for _ in reqs]
        for rows, chosen in rounds:  # one wait for the device, after the last round
            for row, token in zip(rows, chosen.tolist(), strict=True):
                drafts[row].append(token)
        return drafts

    def _decode_logits(self, batch: dict[str, np.ndarray], tokens: torch.Tensor) -> torch.Tensor:
        """Logits of a batch of one token per row whose input ids are `tokens` (on the device)."""
        if self.graphs is not None and len(tokens) <= self.graphs.max_batch_size:
            return self.graphs.run(
                batch["input_ids"], batch["positions"], batch["slot_mapping"], batch["seq_lens"],
                batch["block_tables"], lambda ids: ids.copy_(tokens),
            )  # fmt: skip
        hidden = self.model(
            tokens,
            to_device(batch["positions"], torch.int64, self.device),
            attention_metadata(batch, self.device),
        )
        return self.model.compute_logits(hidden)
