"""Import a module from its file path, once: how the e2e tests (e2e/ is not a package; pytest runs in
importlib mode) share a sibling test file's helpers and fixtures, or a harness module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_by_path(name: str, path: Path) -> ModuleType:
    """The module at `path`, registered as `name` in sys.modules (one instance however often asked)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec and spec.loader, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
