"""A test double, for tests only: the real model side, except that any step holding a request seeded
`HOSTILE_SEED` raises, as a bug or an input that slipped past validation would. Tests check that only
that request fails, in one process (`LLMEngine`) and through the real server, whose engine core runs in
another process. Chosen explicitly: `EngineConfig(executor_class=EXECUTOR_CLASS)` or
`pagoda serve --executor-class failing_executor:FailingExecutor` with this folder on `PYTHONPATH`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.core.scheduler import SchedulerOutput
from pagoda.service.engine.runner.executor import Executor

HOSTILE_SEED = 666
EXECUTOR_CLASS = "failing_executor:FailingExecutor"
FOLDER = str(Path(__file__).resolve().parent)  # what a server started by a test needs on PYTHONPATH


class InjectedFailure(RuntimeError):
    pass


class FailingExecutor:
    """The model's executor; `forward` raises `InjectedFailure` when a request seeded `HOSTILE_SEED` is
    scheduled. Everything else is the real executor's."""

    def __init__(
        self, config: EngineConfig, eos_token_ids: set[int], relay_stop_signals: bool = False
    ) -> None:
        self._executor = Executor(config, config.model_path, eos_token_ids, relay_stop_signals)

    def forward(self, out: SchedulerOutput, after: Any = None) -> Any:
        if any(r.params.seed == HOSTILE_SEED for r in out.requests):
            raise InjectedFailure(f"injected failure for a request seeded {HOSTILE_SEED}")
        return self._executor.forward(out, after)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)
