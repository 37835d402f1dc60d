"""Python's garbage collector in the serving processes: keep its pauses short, and time them.

A full (generation 2) collection walks every tracked object. After startup most of them are the
model's modules, the tokenizer and the imported libraries, which live as long as the process: walking
them stalls every stream at once (tens of milliseconds in a process with torch loaded). `freeze()`
moves everything alive at that moment out of the collector's sight, as vLLM does after startup; what
the serving loop allocates is still collected.

`GcPauses` counts the pauses that remain, from `gc.callbacks`, so a stall in the step loop can be
told apart from one elsewhere (`pagoda_engine_gc_pause_seconds_total`).
"""

from __future__ import annotations

import gc
import time
from typing import Any


def freeze() -> None:
    """Collect once, then exempt every surviving object from later collections."""
    gc.collect()
    gc.freeze()


class GcPauses:
    """Cumulative seconds and count of the collector's pauses in this process, since `start()`."""

    def __init__(self) -> None:
        self.seconds_total = 0.0
        self.collections_total = 0
        self.longest_seconds = 0.0
        self._started: float | None = None

    def start(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            pause = time.perf_counter() - self._started
            self._started = None
            self.seconds_total += pause
            self.collections_total += 1
            self.longest_seconds = max(self.longest_seconds, pause)
