"""Pipeline parallelism: the layer split, a rank's place in the pipeline, and the transfers between stages.

P stages of T tensor-parallel ranks each: global rank = stage * T + tp rank. Stage 0 holds the
embedding, the last stage the final norm and the LM head; each holds a contiguous run of decoder
layers. Every stage's T ranks form one tensor-parallel group (its own collectives); between stages
a rank talks point to point with the rank of the same tp rank in the stage before and after it (each
tp rank holds the whole hidden state after its stage's all-reduce). The last stage's tp rank 0 sends
the logits to rank 0 (stage 0, tp rank 0), which samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagoda.service.model.parallel import TPGroup

logger = logging.getLogger(__name__)


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Each stage's decoder layers: as even as can be, and where not, one more for the stages before
    the last, from the last-but-one backwards (vLLM's `get_pp_indices`). The last stage already carries
    the final norm and the LM head (Llama 3 8B's is 1.05 GB, 2.4 layers of weights, read every step);
    stage 0 carries the embedding (as many bytes, but a lookup reads only the rows it uses) and, on rank
    0, preparing and sampling each step. 5 over 2: 3 + 2; 7 over 4: 2 + 2 + 2 + 1; 6 over 4: 1 + 2 + 2 + 1."""
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be at least 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size {num_stages} is more than the model's {num_layers} decoder layers: "
            "every stage needs at least one"
        )
    sizes = [num_layers // num_stages] * num_stages
    for i in range(2, num_layers % num_stages + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def log_split(split: list[range]) -> None:
    num_layers = split[-1].stop
    for stage, layers in enumerate(split):
        logger.info(
            "pipeline stage %d: layers %d..%d (%d of %d)",
            stage,
            layers.start,
            layers.stop - 1,
            len(layers),
            num_layers,
        )


@dataclass(frozen=True)
class PPGroup:
    """This process's place in the pipeline (`size` stages of `tp_size` ranks)."""

    stage: int = 0
    size: int = 1
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def rank(self) -> int:  # the global rank (rank r runs on cuda:r)
        return self.stage * self.tp_size + self.tp_rank

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    @property
    def sends_logits(self) -> bool:
        """The one rank of the last stage that hands the logits to rank 0 (when it is not rank 0)."""
        return self.size > 1 and self.is_last and self.tp_rank == 0

    @property
    def receives_logits(self) -> bool:
        return self.size > 1 and self.rank == 0

    def layers(self, num_layers: int) -> range:
        return split_layers(num_layers, self.size)[self.stage]

    def send_next(self, x: torch.Tensor) -> dist.Work | None:
        """Queue `x` for the same tp rank of the next stage; wait on the handle before reusing `x`."""
        return dist.isend(x.contiguous(), dst=self.rank + self.tp_size)

    def recv_prev(self, x: torch.Tensor) -> None:
        """Fill `x` from the same tp rank of the stage before (on a GPU: the stream waits, not the host)."""
        dist.recv(x, src=self.rank - self.tp_size)

    def send_logits(self, x: torch.Tensor) -> dist.Work | None:
        return dist.isend(x.contiguous(), dst=0)

    def recv_logits(self, x: torch.Tensor) -> None:
        dist.recv(x, src=(self.size - 1) * self.tp_size)

    def handshake(self, device: torch.device) -> None:
        """One small message along every link a step uses, in the order steps use them: a broken link
        fails here, at start-up, and NCCL sets up its point-to-point channels before the first step."""
        token = torch.ones(1, device=device)
        if not self.is_first:
            self.recv_prev(token)
        if not self.is_last:
            _wait(self.send_next(token))
        if self.sends_logits:
            _wait(self.send_logits(token))
        if self.receives_logits:
            self.recv_logits(token)


SINGLE_STAGE = PPGroup()


def _wait(work: dist.Work | None) -> None:
    if work is not None:
        work.wait()


def init_groups(
    rank: int,
    tp_size: int,
    pp_size: int,
    store: dist.Store,
    backend: str,
    device: torch.device,
    timeout_s: float,
) -> tuple[TPGroup, PPGroup]:
    """Join the P x T ranks through `store` (rank 0 hosts it) and make one tensor-parallel group per
    stage; every rank creates every stage's group, in stage order, as `new_group` requires. The timeout
    bounds every collective and transfer: a rank that dies mid-step fails its peers after `timeout_s` at
    worst, never hangs them. With one stage the world is the tensor-parallel group."""
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=tp_size * pp_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,  # NCCL: create the communicator now
    )
    stage, tp_rank = divmod(rank, tp_size)
    pp = PPGroup(stage, pp_size, tp_rank, tp_size)
    if pp_size == 1:
        return TPGroup(rank, tp_size, dist.group.WORLD), pp
    group = None
    for s in range(pp_size) if tp_size > 1 else ():
        made = dist.new_group(
            list(range(s * tp_size, (s + 1) * tp_size)), timeout=timedelta(seconds=timeout_s)
        )
        if s == stage:
            group = made
    pp.handshake(device)
    return TPGroup(tp_rank, tp_size, group), pp
