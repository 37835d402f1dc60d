"""How many intra-op threads torch gets in each rank of an engine that runs on the CPU.

torch starts one OpenMP thread per core of the machine, whatever the process may use: in a container
limited to 2 CPUs on a 64-core node it starts 64 and the CFS quota stalls them, and each rank of an
engine over several ranks on one machine starts that many again. An OpenMP thread that waits for a
descheduled peer is worse than no thread: a 576 x 1536 linear at one row (the embedded model's) took
0.10 ms with one thread and 6.7 ms with two, on this project's 2-core machine with the other core busy.

So the engine divides what the process may run on, the smaller of its CPU affinity and its cgroup's CPU
quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us`), among the ranks on this machine. A Burstable pod (the
operator's default: requests, no CPU limit) has no quota, so its affinity is the whole node; the
operator hands the container its CPU request through the downward API (PAGODA_CPU_REQUEST, whole CPUs
rounded up), which caps the budget too: threads past the CPUs the pod is guaranteed wait on a busy
node. OMP_NUM_THREADS, when set, wins: torch reads it itself, and the engine changes nothing. torch
is imported only by `share_cpus`, so the API process can read the budget without it.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
logger = logging.getLogger(__name__)


def cgroup_cpu_quota(root: Path = CGROUP) -> float | None:
    """CPUs the cgroup may use per period (2.5 for "250000 100000"); None when unlimited or unknown."""
    v2 = root / "cpu.max"
    try:
        if v2.exists():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 else quota_us / period_us


def _affinity() -> set[int]:
    if hasattr(os, "sched_getaffinity"):  # Linux
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))  # macOS: no affinity call; every CPU


def cpu_budget(
    affinity: Callable[[], set[int]] = _affinity, root: Path = CGROUP, environ: Mapping[str, str] = os.environ
) -> int:
    """Whole CPUs this process may keep busy: its affinity, capped by its cgroup's quota rounded up and by
    its pod's CPU request (PAGODA_CPU_REQUEST, when a positive whole number)."""
    cpus = len(affinity())
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    request = environ.get("PAGODA_CPU_REQUEST", "")
    if request.isdigit() and int(request) > 0:
        cpus = min(cpus, int(request))
    return max(1, cpus)


def threads_per_rank(
    ranks: int, budget: int | None = None, environ: Mapping[str, str] = os.environ
) -> int | None:
    """Each of `ranks` CPU ranks' share of the budget (at least 1); None when OMP_NUM_THREADS is set."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, (cpu_budget() if budget is None else budget) // ranks)


def share_cpus(ranks: int) -> None:
    """Set this rank's torch threads to its share of `ranks` on this machine, only ever fewer than torch
    chose: torch starts one a physical core (so a share counted in hyperthreads may be more), and a
    caller's own smaller setting stays. Rank 0 calls it for its node (its workers take its count), a
    headless node's ranks each for theirs. Logged either way, once a process."""
    import torch

    budget = cpu_budget()  # read once: the share and the log line
    share = threads_per_rank(ranks, budget)
    if share is None:
        return
    before = torch.get_num_threads()
    logger.info(
        "torch threads %d a rank (%d rank(s) on %d usable CPUs; torch chose %d)", min(share, before), ranks,
        budget, before,
    )  # fmt: skip
    if share < before:
        torch.set_num_threads(share)
