"""One rank's part of a pipelined step: the step's micro-batches through this stage's layers.

Rank 0 prepares the whole step and sends it to every rank as under tensor parallelism; each rank cuts
it into the same micro-batches: up to one per stage, contiguous runs of requests of about equal token
counts, each with its own attention layout (rebased `query_start_loc`, its rows of the token arrays,
its requests' block tables and lengths). Stage 0 runs every micro-batch in turn and queues each to
stage 1 as it finishes; stage s receives micro-batch m from stage s - 1, runs it and queues it to
s + 1, so while stage s runs m, stage s + 1 runs m - 1. Hidden state and residual travel together,
one [2, tokens, hidden] tensor. The last stage computes the logits each micro-batch needs (the sampled
rows, the prompt chunks scored for log-probabilities) and its tp rank 0 sends them to rank 0, which
concatenates them in batch order: the step's logits, as one stage would have computed them.

Requests never span micro-batches, and a micro-batch reads the KV cache only of its own requests, so
the order in which stages run them changes no number. Every rank derives the micro-batches and the
shapes of what it receives from the `StepInput` alone: nothing but tensors goes between stages.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from pagoda.service.engine.runner.sampler import to_device
from pagoda.service.model.attention import AttentionMetadata, LongChunk
from pagoda.service.model.llama import LlamaForCausalLM
from pagoda.service.model.pipeline import PPGroup

# Per-request arrays of the flattened batch (`ModelRunner.prepare`): a micro-batch takes its requests' rows.
_PER_REQUEST = ("block_tables", "seq_lens", "lora_slots")
_PER_TOKEN = ("input_ids", "positions", "slot_mapping")


@dataclass
class MicroBatch:
    tokens: slice  # its rows of the step's flattened tokens
    batch: dict[str, np.ndarray]  # the step's batch cut to its requests, rows rebased to 0
    logit_rows: np.ndarray  # its rows (rebased) whose logits are sampled, in batch order
    prompt_chunks: list[tuple[int, int]]  # (first row rebased, num rows) scored for prompt logprobs

    @property
    def num_tokens(self) -> int:
        return self.tokens.stop - self.tokens.start

    @property
    def num_logit_rows(self) -> int:
        return len(self.logit_rows) + sum(n for _, n in self.prompt_chunks)


def split_micro_batches(
    batch: dict[str, np.ndarray],
    logit_rows: np.ndarray,
    prompt_chunks: list[tuple[int, int, int]],
    max_num: int,
) -> list[MicroBatch]:
    """At most `max_num` (and at most one per request) contiguous runs of requests, cut at the request
    boundaries nearest to equal shares of the step's tokens. `logit_rows`, `prompt_chunks`: the
    step's (`StepInput`), in batch order, so the micro-batches' logits concatenated are the step's."""
    starts = batch["query_start_loc"]
    num_reqs, total = len(starts) - 1, int(starts[-1])
    num = min(max_num, num_reqs)
    cuts = [0]
    for k in range(1, num):
        share = total * k / num
        cut = int(np.searchsorted(starts, share))  # the first request boundary at or past the share
        if share - starts[cut - 1] < starts[cut] - share:  # or the one before it, if nearer
            cut -= 1
        cuts.append(min(max(cut, cuts[-1] + 1), num_reqs - (num - k)))  # each keeps one request at least
    cuts.append(num_reqs)
    micro = []
    for a, b in itertools.pairwise(cuts):
        t0, t1 = int(starts[a]), int(starts[b])
        part = {name: batch[name][t0:t1] for name in _PER_TOKEN}
        part |= {name: batch[name][a:b] for name in _PER_REQUEST if name in batch}
        part["query_start_loc"] = starts[a : b + 1] - t0
        part["max_query_len"] = np.diff(part["query_start_loc"]).max()
        rows = logit_rows[(logit_rows >= t0) & (logit_rows < t1)] - t0
        chunks = [(row - t0, n) for i, row, n in prompt_chunks if a <= i < b]
        micro.append(MicroBatch(slice(t0, t1), part, rows, chunks))
    return micro


def attention_metadata(
    batch: dict[str, np.ndarray],
    device: torch.device,
    long_chunk_tokens: int | None = None,
    whole_prompt_tokens: int | None = None,
) -> AttentionMetadata:
    """A flattened batch's attention layout on the device (a whole step's, a micro-batch's, or the draft
    model's). With `long_chunk_tokens` (`LONG_CHUNK_TOKENS` where the engine attends long chunks through
    cuDNN), sequences with that many query tokens or more become `LongChunk`s, as do whole prompts (no
    cached prefix) of `whole_prompt_tokens` or more, and the others get the layout of each run between
    them too."""

    def dev(name: str, dtype: torch.dtype) -> torch.Tensor:
        return to_device(batch[name], dtype, device)

    meta = AttentionMetadata(
        slot_mapping=dev("slot_mapping", torch.int64),
        block_tables=dev("block_tables", torch.int32),
        seq_lens=dev("seq_lens", torch.int32),
        query_start_loc=dev("query_start_loc", torch.int32),
        max_query_len=int(np.max(batch["max_query_len"])),
        max_seq_len=int(batch["seq_lens"].max()),
        decode_rows=bool((np.diff(batch["query_start_loc"]) == 1).any()),
    )
    if long_chunk_tokens is None:
        return meta
    whole = long_chunk_tokens if whole_prompt_tokens is None else min(whole_prompt_tokens, long_chunk_tokens)
    if meta.max_query_len < whole:
        return meta
    starts, seq_lens = batch["query_start_loc"], batch["seq_lens"]
    lens = np.diff(starts)
    long_rows = np.flatnonzero((lens >= long_chunk_tokens) | ((lens >= whole) & (lens == seq_lens)))
    if not len(long_rows):
        return meta
    meta.long_chunks = tuple(
        LongChunk(int(r), int(starts[r]), int(starts[r + 1]), int(seq_lens[r])) for r in long_rows
    )
    runs = []
    for first, end in zip([0, *(long_rows + 1)], [*long_rows, len(seq_lens)], strict=True):
        if first < end:
            run = {
                "slot_mapping": batch["slot_mapping"][starts[first] : starts[end]],
                "block_tables": batch["block_tables"][first:end],
                "seq_lens": seq_lens[first:end],
                "query_start_loc": starts[first : end + 1] - starts[first],
                "max_query_len": np.diff(starts[first : end + 1]).max(),
            }
            runs.append((int(starts[first]), int(starts[end]), attention_metadata(run, device)))
    meta.paged_runs = tuple(runs)
    return meta


@dataclass
class StageLogits:
    """What rank 0 gets back of a pipelined step: the rows `StepLogits` holds."""

    sample: torch.Tensor | None  # [sampled rows, vocab] float32
    prompt: list[torch.Tensor]  # [num rows, vocab] float32, one per prompt chunk


def run_stage(
    model: LlamaForCausalLM,
    pp: PPGroup,
    micro: list[MicroBatch],
    input_ids: torch.Tensor | None,  # [num_tokens] the step's, on the device (stage 0)
    device: torch.device,
    dtype: torch.dtype,
) -> StageLogits | None:
    """This rank's part of the step (every rank of every stage calls it with the same micro-batches);
    rank 0 gets the step's logits, every other rank None."""
    pending: list[dist.Work] = []  # sends in flight: their tensors must live until they are done
    hidden_size = model.config.hidden_size
    for mb in micro:
        meta = attention_metadata(mb.batch, device)
        positions = to_device(mb.batch["positions"], torch.int64, device)
        if pp.is_first:
            assert input_ids is not None
            hidden, residual = model.embed(input_ids[mb.tokens]), None
        else:
            carried = torch.empty(2, mb.num_tokens, hidden_size, dtype=dtype, device=device)
            pp.recv_prev(carried)
            hidden, residual = carried[0], carried[1]
        out, residual = model.run_layers(positions, hidden, residual, meta)
        if not pp.is_last:
            assert isinstance(out, torch.Tensor), "an fp8 product crosses a stage boundary unscaled"
            _keep(pending, pp.send_next(torch.stack([out, residual])))
            continue
        logits = _logits(model, model.final_norm(out, residual), mb, device)
        if pp.sends_logits and logits is not None:
            _keep(pending, pp.send_logits(logits))
    result = _receive_logits(pp, micro, model.config.vocab_size, device) if pp.receives_logits else None
    for work in pending:
        work.wait()
    return result


def warm_up_stage(
    model: LlamaForCausalLM,
    pp: PPGroup,
    batch: dict[str, np.ndarray],
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Run a batch through this stage alone (zeros stand for what the stage before would send), to
    compile its kernels before the first request; nothing goes between stages."""
    meta = attention_metadata(batch, device)
    positions = to_device(batch["positions"], torch.int64, device)
    num_tokens = len(batch["positions"])
    if pp.is_first:
        hidden, residual = model.embed(torch.zeros(num_tokens, dtype=torch.int64, device=device)), None
    else:
        hidden = torch.zeros(num_tokens, model.config.hidden_size, dtype=dtype, device=device)
        residual = torch.zeros_like(hidden)
    out, residual = model.run_layers(positions, hidden, residual, meta)
    if pp.is_last:
        last = to_device(batch["query_start_loc"][1:] - 1, torch.int64, device)
        model.compute_logits(model.final_norm(out, residual)[last])


def _keep(pending: list[dist.Work], work: dist.Work | None) -> None:
    if work is not None:
        pending.append(work)


def _logits(
    model: LlamaForCausalLM, hidden: torch.Tensor, mb: MicroBatch, device: torch.device
) -> torch.Tensor | None:
    """[sampled rows; each prompt chunk's rows] float32 logits of one micro-batch (a collective under
    tensor parallelism: each rank of the last stage computes the same rows, in the same order)."""
    parts = [model.compute_logits(hidden[row : row + n]) for row, n in mb.prompt_chunks]
    if len(mb.logit_rows):
        parts.insert(0, model.compute_logits(hidden[to_device(mb.logit_rows, torch.int64, device)]))
    return torch.cat(parts) if parts else None


def _receive_logits(
    pp: PPGroup, micro: list[MicroBatch], vocab_size: int, device: torch.device
) -> StageLogits:
    """Rank 0: each micro-batch's logits from the last stage, in order, cut back into the step's."""
    samples: list[torch.Tensor] = []
    prompt: list[torch.Tensor] = []
    for mb in micro:
        if not mb.num_logit_rows:
            continue
        logits = torch.empty(mb.num_logit_rows, vocab_size, dtype=torch.float32, device=device)
        pp.recv_logits(logits)
        num_sampled = len(mb.logit_rows)
        samples.append(logits[:num_sampled])
        if mb.prompt_chunks:
            prompt.extend(logits[num_sampled:].split([n for _, n in mb.prompt_chunks]))
    return StageLogits(torch.cat(samples) if any(len(s) for s in samples) else None, prompt)
