"""A test double, for tests only: makes the model side raise whenever a chosen request is in the step,
as a bug or an input that slipped past validation would. Off unless `PAGODA_TEST_FAIL_SEED` is set;
then every step holding a request with that `seed` raises, so tests can check that only that request
fails (through the real server, whose engine core runs in another process)."""

from __future__ import annotations

import os
from typing import Any

from pagoda.service.engine.core.scheduler import SchedulerOutput

ENV = "PAGODA_TEST_FAIL_SEED"


class InjectedFailure(RuntimeError):
    pass


class FailingExecutor:
    """Wraps an executor; `forward` raises `InjectedFailure` when a request seeded `seed` is scheduled."""

    def __init__(self, executor: Any, seed: int) -> None:
        self._executor = executor
        self._seed = seed

    def _check(self, out: SchedulerOutput) -> None:
        if any(r.params.seed == self._seed for r in out.requests):
            raise InjectedFailure(f"injected failure for a request seeded {self._seed}")

    def forward(self, out: SchedulerOutput, after: Any = None) -> Any:
        self._check(out)
        return self._executor.forward(out, after)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)


def maybe_inject_failures(executor: Any) -> Any:
    seed = os.environ.get(ENV)
    return FailingExecutor(executor, int(seed)) if seed else executor
