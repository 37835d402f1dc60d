"""`pytest -p shard --shard I/N`: run only the collected tests whose index is I modulo N. The N shards of
a file are disjoint and together select every test, whatever its tests are named; test_kernels_interpret
runs each interpreter check file in shards so that `pytest -n` can put them side by side."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shard", default=None, help="I/N: keep every N-th test, starting at the I-th")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    value = config.getoption("--shard")
    if value is None:
        return
    index, count = (int(part) for part in value.split("/"))
    if not 0 <= index < count:
        raise pytest.UsageError(f"--shard {value}: I must be in 0..N-1")
    keep = [item for i, item in enumerate(items) if i % count == index]
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % count != index])
    items[:] = keep
