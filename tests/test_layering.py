"""The boundaries between the parts, held by import blocking (STYLE.md: "held by a test, not by memory").

Each rule names modules (an fnmatch glob; `pkg.*` also matches `pkg` itself) and the import prefixes
they must never reach, directly or through anything they import. Every matching module is imported in
a fresh interpreter whose first meta-path finder refuses the forbidden names and records who asked, so
a violation fails with its import chain, even one a `try: import ... except ImportError` would hide.
Imports inside functions are not seen: the rules are about what loading a module drags in.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = ("pagoda.operator", "pagoda.service", "pagoda.kernels")

ENGINE_INTERNALS = (
    "pagoda.service.engine.core.engine_core",
    "pagoda.service.engine.core.scheduler",
    "pagoda.service.engine.core.block_manager",
    "pagoda.service.engine.core.request",
    "pagoda.service.engine.llm_engine",
    "pagoda.service.engine.runner.model_runner",
    "pagoda.service.engine.runner.executor",
    "pagoda.service.engine.runner.worker",
    "pagoda.service.engine.runner.sampler",
    "pagoda.service.engine.runner.cuda_graphs",
    "pagoda.service.model.llama",
    "pagoda.service.model.loader",
)

# (modules, forbidden import prefixes). Adding a boundary is adding a line.
RULES: list[tuple[str, tuple[str, ...]]] = [
    ("pagoda.operator.*", ("pagoda.service", "pagoda.kernels", "torch")),
    ("pagoda.kernels.*", ("pagoda.service", "pagoda.operator")),
    ("pagoda.service.engine.core.scheduler", ("torch", "fastapi", "grpc")),
    ("pagoda.service.engine.core.block_manager", ("torch", "fastapi", "grpc")),
    ("pagoda.service.engine.core.request", ("torch", "fastapi", "grpc")),
    ("pagoda.service.model.*", ("pagoda.service.api", "fastapi", "grpc")),
    # The engine core and the messages it trades with the API process: no torch (the model is behind
    # the executor, built inside the core process), no transports.
    ("pagoda.service.engine.core.engine_core", ("torch", "fastapi", "grpc")),
    ("pagoda.service.engine.core_process", ("torch", "fastapi", "grpc", "pagoda.service.api")),
    ("pagoda.service.engine.messages", ("torch", "fastapi", "grpc")),
    # Structured output: the core's grammar manager is torch-free like the core; the Grammar type that
    # SamplingParams carries loads llguidance only when a grammar is compiled or validated.
    ("pagoda.service.engine.core.structured_output", ("torch", "fastapi", "grpc")),
    ("pagoda.service.grammar", ("torch", "llguidance")),
    ("pagoda.service.sampling_params", ("torch", "llguidance")),
    # The API process: transports over the one engine client; it reaches neither the engine's insides
    # nor torch (the core process holds the model).
    ("pagoda.service.api.*", ("torch", "pagoda.kernels", *ENGINE_INTERNALS)),
    ("pagoda.service.server", ("torch", "pagoda.kernels", *ENGINE_INTERNALS)),
    ("pagoda.service.api_server_process", ("torch", "pagoda.kernels", *ENGINE_INTERNALS)),
    ("pagoda.service.engine.client.async_engine", ("torch", "fastapi", "grpc", *ENGINE_INTERNALS)),
    # A headless node's own process only spawns and watches its ranks: no torch, no API.
    ("pagoda.service.headless", ("torch", "fastapi", "grpc", "uvicorn", "pagoda.service.api")),
    ("pagoda.service.engine.runner.nodes", ("torch",)),
]

CHILD = r"""
import importlib, json, sys, traceback

forbidden, modules = json.loads(sys.argv[1]), json.loads(sys.argv[2])


def is_forbidden(name):
    return any(name == p or name.startswith(p + ".") for p in forbidden)


def importers():
    # The modules whose top-level code is running, outermost first: who asked for the import.
    names, frame = [], sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if frame.f_code.co_name == "<module>" and name not in (None, "__main__"):
            if not names or names[-1] != name:
                names.append(name)
        frame = frame.f_back
    return names[::-1]


class Blocker:
    def __init__(self):
        self.chains = []

    def find_spec(self, name, path=None, target=None):
        if is_forbidden(name):
            self.chains.append(" -> ".join([*importers(), name]))
            raise ImportError(f"{name} is forbidden here")
        return None


blocker = Blocker()
sys.meta_path.insert(0, blocker)
report = {"preloaded": sorted(m for m in sys.modules if is_forbidden(m)), "errors": {}}
for module in modules:
    try:
        importlib.import_module(module)
    except Exception:
        report["errors"][module] = traceback.format_exc(limit=-3)
report["chains"] = list(dict.fromkeys(blocker.chains))
print(json.dumps(report))
"""


def all_modules() -> list[str]:
    """Every module under the three packages, found on disk (package-dir maps them to folders)."""
    names = []
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, package
        (folder,) = spec.submodule_search_locations
        for path in sorted(Path(folder).rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if "__pycache__" in parts or not (path.parent / "__init__.py").exists():
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join((package, *parts)))
    return names


def matches(module: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(module, pattern) or (pattern.endswith(".*") and module == pattern[:-2])


@pytest.mark.parametrize(("pattern", "forbidden"), RULES, ids=[pattern for pattern, _ in RULES])
def test_boundary(pattern: str, forbidden: tuple[str, ...]) -> None:
    modules = [m for m in all_modules() if matches(m, pattern)]
    assert modules, f"{pattern} matches no module: a rule about nothing"
    env = dict(os.environ, PYTHONSAFEPATH="1")  # the repo's operator/ must not shadow the stdlib
    result = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(forbidden), json.dumps(modules)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert not report["preloaded"], f"loaded before any import: {report['preloaded']}"
    assert not report["chains"], f"{pattern} must not import {', '.join(forbidden)}:\n" + "\n".join(
        report["chains"]
    )
    assert not report["errors"], "\n".join(f"{m}:\n{tb}" for m, tb in report["errors"].items())


def test_the_blocker_blocks(tmp_path: Path) -> None:
    """A rule that is broken fails with the chain that breaks it."""
    env = dict(os.environ, PYTHONSAFEPATH="1")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            json.dumps(["pagoda.operator.gpus"]),
            json.dumps(["pagoda.operator.profile"]),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["chains"] == ["pagoda.operator.profile -> pagoda.operator.gpus"]
    assert "pagoda.operator.profile" in report["errors"]
