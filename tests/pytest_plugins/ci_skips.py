"""A pytest plugin for both suites (tests/ and e2e/): a skipped test never passes unnoticed.

Under CI a skipped test fails the run, since CI installs and builds everything the tests need. Outside
CI the run still passes, but the skipped tests are listed at the very end, each with its reason, so a
green local run cannot hide a test that did not run for want of a tool (helm, the real node, a GPU).
Loaded by `-p ci_skips` in pyproject.toml."""

from __future__ import annotations

import os

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int) -> None:
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    terminalreporter.section(f"{len(skipped)} TEST(S) DID NOT RUN", sep="!", red=True, bold=True)
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        terminalreporter.write_line(f"SKIPPED {report.nodeid}: {reason}", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter is not None else 0
    if os.environ.get("CI") and skipped and exitstatus == 0:
        session.exitstatus = 1
        if reporter is not None:
            reporter.write_line(f"CI: {skipped} test(s) skipped; everything must run here", red=True)
