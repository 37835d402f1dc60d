"""The garbage-collector pause timer and the startup-heap freeze (service/gc_pauses.py)."""

from __future__ import annotations

import gc

from pagoda.service import gc_pauses


def _cycles(n: int) -> None:
    for _ in range(n):
        a: list[object] = []
        a.append(a)  # only a collection frees it


def test_pauses_are_counted_while_started() -> None:
    pauses = gc_pauses.GcPauses().start()
    try:
        _cycles(1000)
        gc.collect()
        assert pauses.collections_total >= 1
        assert 0.0 < pauses.longest_seconds <= pauses.seconds_total
    finally:
        pauses.stop()
    seen = pauses.collections_total
    gc.collect()
    assert pauses.collections_total == seen  # stopped: no longer counted


def test_freeze_exempts_what_lives_at_startup() -> None:
    try:
        gc_pauses.freeze()
        assert gc.get_freeze_count() > 1000  # the interpreter, pytest and torch-free imports at least
    finally:
        gc.unfreeze()
