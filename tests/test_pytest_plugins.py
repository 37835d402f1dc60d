"""The test tiers' own plugins, run as `make test-fast` runs them: a module whose tests share a server
must run whole on one xdist worker, or its server starts once per worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

PLUGINS = Path(__file__).parent / "pytest_plugins"

RECORDING_TEST = """
import json, os

def _record(name):
    with open({log!r}, "a") as f:
        f.write(json.dumps([__name__, name, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")

{tests}
"""


def test_by_module_sends_each_module_whole_to_one_worker_and_spreads_the_spread_ones(tmp_path: Path) -> None:
    log = tmp_path / "ran.jsonl"
    modules = {"test_alpha": 6, "test_beta": 6, "test_kernels_interpret": 6}
    for module, count in modules.items():
        tests = "\n".join(f"def test_{i}():\n    _record({i})\n" for i in range(count))
        (tmp_path / f"{module}.py").write_text(RECORDING_TEST.format(log=str(log), tests=tests))
    # Only the plugins this needs: the venv's other pytest plugins cost seconds per worker to import.
    env = {**os.environ, "PYTHONPATH": str(PLUGINS), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    plugins = ["-p", "xdist.plugin", "-p", "by_module", "-p", "no:cacheprovider"]
    args = [*plugins, "-n", "2", "--dist", "loadscope"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *args, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    workers: dict[str, set[str]] = defaultdict(set)
    ran = [json.loads(line) for line in log.read_text().splitlines()]
    for module, _, worker in ran:
        workers[module].add(worker)
    assert len(ran) == sum(modules.values())
    assert len(workers["test_alpha"]) == 1 and len(workers["test_beta"]) == 1
    assert workers["test_kernels_interpret"] == {"gw0", "gw1"}
    # The spread tests go out first: each worker starts with one.
    first = {worker: module for module, _, worker in reversed(ran)}
    assert set(first.values()) == {"test_kernels_interpret"}, first
