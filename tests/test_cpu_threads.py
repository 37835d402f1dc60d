"""The engine's torch threads on the CPU: the process's CPUs (affinity, cgroup quota) shared by its ranks."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from pagoda.service.engine.runner import cpu_threads, executor
from pagoda.service.engine.runner.cpu_threads import (
    cgroup_cpu_quota,
    cpu_budget,
    share_cpus,
    threads_per_rank,
)


def cgroup(root: Path, v2: str | None = None, v1: tuple[str, str] | None = None) -> Path:
    """A cgroup folder as a container sees it: v2's cpu.max, or v1's cpu/cpu.cfs_{quota,period}_us."""
    root.mkdir()
    if v2 is not None:
        (root / "cpu.max").write_text(v2)
    if v1 is not None:
        (root / "cpu").mkdir()
        (root / "cpu" / "cpu.cfs_quota_us").write_text(v1[0])
        (root / "cpu" / "cpu.cfs_period_us").write_text(v1[1])
    return root


def test_the_cgroup_quota_from_v2_and_v1(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(cgroup(tmp_path / "v2", v2="250000 100000\n")) == 2.5
    assert cgroup_cpu_quota(cgroup(tmp_path / "v2max", v2="max 100000\n")) is None
    assert cgroup_cpu_quota(cgroup(tmp_path / "v1", v1=("50000\n", "200000\n"))) == 0.25
    assert cgroup_cpu_quota(cgroup(tmp_path / "v1max", v1=("-1", "100000"))) is None
    # v2 wins where a hybrid mount has both
    assert cgroup_cpu_quota(cgroup(tmp_path / "both", v2="300000 100000", v1=("100000", "100000"))) == 3.0


def test_no_or_unreadable_cgroup_files_mean_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(cgroup(tmp_path / "none")) is None
    assert cgroup_cpu_quota(cgroup(tmp_path / "bad", v2="garbage")) is None
    assert cgroup_cpu_quota(cgroup(tmp_path / "badv1", v1=("lots", "100000"))) is None


def test_the_budget_is_the_affinity_capped_by_the_quota_rounded_up(tmp_path: Path) -> None:
    sixty_four = lambda: set(range(64))  # noqa: E731
    assert cpu_budget(sixty_four, cgroup(tmp_path / "a", v2="250000 100000")) == 3
    assert cpu_budget(sixty_four, cgroup(tmp_path / "b", v2="max 100000")) == 64
    assert cpu_budget(lambda: {0, 1}, cgroup(tmp_path / "c", v2="800000 100000")) == 2
    assert cpu_budget(sixty_four, cgroup(tmp_path / "d", v2="10000 100000")) == 1  # a tenth of a CPU
    assert cpu_budget(sixty_four, cgroup(tmp_path / "e", v2="200000 100000")) == 2  # exactly 2: not 3


def test_a_pods_cpu_request_caps_the_budget_where_no_quota_does(tmp_path: Path) -> None:
    """A Burstable pod: no CPU limit, so no quota; the operator's PAGODA_CPU_REQUEST (the downward API's
    requests.cpu, whole CPUs rounded up) caps the node's 64 CPUs. Below a quota it caps that too; what is
    not a positive whole number is ignored."""
    sixty_four = lambda: set(range(64))  # noqa: E731
    unlimited, quota3 = cgroup(tmp_path / "a", v2="max 100000"), cgroup(tmp_path / "b", v2="250000 100000")
    assert cpu_budget(sixty_four, unlimited, {"PAGODA_CPU_REQUEST": "2"}) == 2
    assert cpu_budget(sixty_four, quota3, {"PAGODA_CPU_REQUEST": "2"}) == 2
    assert cpu_budget(sixty_four, quota3, {"PAGODA_CPU_REQUEST": "8"}) == 3  # the quota is the smaller
    assert cpu_budget(lambda: {0, 1}, unlimited, {"PAGODA_CPU_REQUEST": "8"}) == 2  # the affinity is
    for ignored in ("", "0", "1.5", "-2", "lots"):
        assert cpu_budget(sixty_four, unlimited, {"PAGODA_CPU_REQUEST": ignored}) == 64, ignored


def test_each_rank_gets_its_share_unless_omp_num_threads_is_set() -> None:
    assert threads_per_rank(1, budget=3, environ={}) == 3
    assert threads_per_rank(2, budget=4, environ={}) == 2
    assert threads_per_rank(2, budget=3, environ={}) == 1
    assert threads_per_rank(4, budget=2, environ={}) == 1  # never 0
    assert threads_per_rank(2, budget=4, environ={"OMP_NUM_THREADS": "3"}) is None
    assert threads_per_rank(2, budget=4, environ={"OMP_NUM_THREADS": ""}) == 2  # set empty: as unset


@pytest.mark.parametrize(("share", "before", "after"), [(1, 2, 1), (4, 2, 2), (None, 2, 2), (2, 2, 2)])
def test_the_engine_only_ever_lowers_torch_threads(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    share: int | None,
    before: int,
    after: int,
) -> None:
    """torch's own count (a thread a physical core) may be below a share counted in hyperthreads."""
    asked: list[int] = []
    monkeypatch.setattr(
        cpu_threads, "threads_per_rank", lambda ranks, budget=None: asked.append(ranks) or share
    )
    torch.set_num_threads(before)
    try:
        with caplog.at_level(logging.INFO, logger=cpu_threads.__name__):
            share_cpus(3)
        assert asked == [3] and torch.get_num_threads() == after
    finally:
        torch.set_num_threads(1)
    said = [r.getMessage() for r in caplog.records]
    if share is None:  # OMP_NUM_THREADS set: torch's, untouched and unsaid
        assert said == []
    else:
        assert said == [
            f"torch threads {after} a rank (3 rank(s) on {cpu_budget()} usable CPUs; torch chose {before})"
        ]


def test_this_machine_has_a_budget() -> None:
    """The real files: whatever this machine has, at least one CPU and no more than its affinity."""
    assert 1 <= cpu_budget() <= len(os.sched_getaffinity(0))


def test_an_engine_of_one_rank_on_the_cpu_takes_its_share(
    monkeypatch: pytest.MonkeyPatch, llama_ckpt: Path
) -> None:
    """One rank runs in place (no workers, no `_start`): it, too, keeps to the CPUs it may use."""
    from pagoda.service.engine.config import EngineConfig

    asked: list[int] = []
    monkeypatch.setattr(cpu_threads, "threads_per_rank", lambda ranks, budget=None: asked.append(ranks) or 1)
    torch.set_num_threads(2)
    try:
        config = EngineConfig(
            model=str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=4 << 20, device="cpu"
        )
        run = executor.Executor(config, config.model_path, {2})
        assert asked == [1] and torch.get_num_threads() == 1
        run.shutdown()
    finally:
        torch.set_num_threads(1)


def test_without_an_affinity_call_every_cpu_counts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """macOS has no sched_getaffinity: the budget is the CPU count (and no cgroup files there)."""
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert cpu_budget(root=cgroup(tmp_path / "none")) == 6
