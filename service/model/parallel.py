"""Tensor parallelism: the rank group handle and the sharded layers of one decoder.

Megatron's split, two collectives per layer: q/k/v and gate/up are column-parallel (each rank owns
whole heads and a slice of the intermediate size, so attention and the activation stay rank-local),
o_proj and down_proj are row-parallel (each rank multiplies its slice of the input and the partial
sums are all-reduced). The vocabulary is split in rows for the embedding (all-reduce of masked
lookups) and the LM head (all-gather of the logits), padded up to a multiple of the rank count.

Each parallel layer says which slice of which checkpoint tensor it holds (`param_shards`), so the
loader reads only that slice. With one rank every layer is the plain one: no collective is called.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagoda.service.model.config import ModelConfig


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group; `group` is None with one rank."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # in place, sum over ranks
        dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:  # in place, the group's rank 0's values
        dist.broadcast(x, group=self.group, group_src=0)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # [n, d] -> [n, size * d], rank order
        # One collective into one buffer (not a list of outputs): the form NCCL captures in CUDA graphs.
        n, d = x.shape
        out = x.new_empty(self.size * n, d)
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out.view(self.size, n, d).transpose(0, 1).reshape(n, self.size * d)


SINGLE_RANK = TPGroup()


def check_tp_size(config: ModelConfig, size: int) -> None:
    """Refuse a rank count the model's heads and sizes do not divide into."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} and the model's {kv_heads} KV heads: one must divide the other"
        )
    if config.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the intermediate size {config.intermediate_size}"
        )


@dataclass(frozen=True)
class Shard:
    """Indices [start, start + size) along `dim` of one checkpoint tensor. `limit`: the dimension's
    real length where the shard runs past it (the vocabulary's padding); indices from it read as zeros."""

    dim: int
    start: int
    size: int
    limit: int | None = None

    @property
    def stop(self) -> int:  # the last index read from the file, plus one
        end = self.start + self.size
        return end if self.limit is None else min(end, self.limit)


class ColumnParallelLinear(nn.Linear):
    """Output features split over ranks. A merged layer (q/k/v, gate/up) has one shard per part, so
    each rank gets its own heads of each part, concatenated: [q_r; k_r; v_r]."""

    def __init__(self, input_size: int, shards: list[Shard], bias: bool) -> None:
        super().__init__(input_size, sum(s.size for s in shards), bias=bias)
        self.param_shards = {"weight": tuple(shards), "bias": tuple(shards)}


class RowParallelLinear(nn.Linear):
    """Input features split over ranks; the partial outputs are summed (all-reduce), then the bias."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup) -> None:
        local = input_size // tp.size
        super().__init__(local, output_size, bias=bias)
        self.tp = tp
        self.param_shards = {"weight": (Shard(1, tp.rank * local, local),)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * per_rank, (rank + 1) * per_rank) of the vocabulary, per_rank = ceil(vocab / size).
    Ids of other ranks look up zeros here; the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.num_rows = -(-vocab_size // tp.size)
        self.first_row = tp.rank * self.num_rows
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size), requires_grad=False)
        self.param_shards = {"weight": (Shard(0, self.first_row, self.num_rows, limit=vocab_size),)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first_row
        outside = (local < 0) | (local >= self.num_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    """The same row split as the embedding (so tied weights are one tensor); logits are gathered."""

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] logits, written into `out` when given (one rank: by the GEMM itself
        where `out` has the weights' dtype, as F.linear's own matmul; else copied in). An `out` of
        another shape is refused: matmul would reallocate it (inside a CUDA graph's capture too)."""
        if out is not None and out.shape != (hidden.shape[0], self.vocab_size):
            raise ValueError(
                f"LM head: out {tuple(out.shape)} for {hidden.shape[0]} rows of {self.vocab_size}"
            )
        if self.tp.size == 1 and out is not None and out.dtype == self.weight.dtype:
            return torch.matmul(hidden, self.weight.t(), out=out)
        logits = F.linear(hidden, self.weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits)[:, : self.vocab_size]
        return logits if out is None else out.copy_(logits)
