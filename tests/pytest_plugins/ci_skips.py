"""A pytest plugin for both suites (tests/ and e2e/): under CI a skipped test fails the run, since CI
installs and builds everything the tests need. Loaded by `-p ci_skips` in pyproject.toml."""

from __future__ import annotations

import os

import pytest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter is not None else 0
    if os.environ.get("CI") and skipped and exitstatus == 0:
        session.exitstatus = 1
        if reporter is not None:
            reporter.write_line(f"CI: {skipped} test(s) skipped; everything must run here", red=True)
