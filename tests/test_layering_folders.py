"""Which process a folder runs in, held by its imports: every import statement in the source, those
inside functions included (an AST walk; tests/test_layering.py checks what loading a module drags in,
third-party libraries included). `if TYPE_CHECKING:` blocks never run and are left out.

A module may import anything the modules it imports import, however deep and whenever called: a
folder's rule holds over that whole reach. One kind of edge is not followed: into the main module of
another process (`PROCESS_MAINS`), which a parent imports only to start the child.
"""

from __future__ import annotations

import ast
import fnmatch
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "pagoda": ROOT / "pagoda",
    "pagoda.service": ROOT / "service",
    "pagoda.operator": ROOT / "operator",
    "pagoda.kernels": ROOT / "kernels",
}

# Started as a process of its own: the parent imports them to spawn them, and runs none of their code.
PROCESS_MAINS = {
    "pagoda.service.engine.core_process",  # the engine core (and rank 0 of the model) beside the API
    "pagoda.service.engine.runner.worker",  # a tensor-parallel rank beside the core
    "pagoda.service.grammar_sandbox",  # grammar checks beside the API process
}

API_SIDE = ("pagoda.service.api.*", "pagoda.service.engine.client.*", "pagoda.service.server",
            "pagoda.service.api_server_process")  # fmt: skip
MODEL_SIDE = ("torch", "triton", "pagoda.kernels", "pagoda.service.model.loader",
              "pagoda.service.model.llama")  # fmt: skip

# (modules, what they must never reach). Adding a boundary is adding a line.
RULES: list[tuple[tuple[str, ...], tuple[str, ...]]] = [
    # The API process: HTTP, gRPC, tokenizing. It starts the core process and trades messages with it.
    (API_SIDE, (*MODEL_SIDE, "pagoda.service.engine.core", "pagoda.service.engine.runner")),
    # The engine core: scheduling and blocks, token ids only; the model is behind the executor protocol.
    (("pagoda.service.engine.core.*",), (*MODEL_SIDE, "fastapi", "grpc", "pagoda.service.engine.runner",
                                         "pagoda.service.engine.client", "pagoda.service.api")),
    # The runner (torch) serves the core: it never reaches back up, nor into the API.
    (("pagoda.service.engine.runner.*",), ("fastapi", "grpc", "pagoda.service.api",
                                           "pagoda.service.engine.client")),
    (("pagoda.service.engine.messages", "pagoda.service.engine.config"), (*MODEL_SIDE, "fastapi", "grpc")),
    (("pagoda.service.grammar", "pagoda.service.sampling_params"), MODEL_SIDE),
    # No circle: a grammar is part of the sampling parameters, never the other way round; the error
    # both raise is a leaf.
    (("pagoda.service.grammar",), ("pagoda.service.sampling_params",)),
    (("pagoda.service.errors",), ("pagoda.service", "pagoda.kernels", "pagoda.operator")),
    (("pagoda.operator.*",), ("pagoda.service", "pagoda.kernels", "torch")),
    # The measuring tools sit outside the product: nothing the product runs reaches them.
    (("pagoda.service.*", "pagoda.operator.*", "pagoda.kernels.*"), ("pagoda.bench", "pagoda.devtools")),
    (("pagoda.kernels.*",), ("pagoda.service", "pagoda.operator")),
]  # fmt: skip


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@cache
def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the packages (package-dir maps them to folders)."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if "__pycache__" in parts or "grpc_gen" in parts:
                continue
            if parts and parts[-1] == "__init__":
                parts = parts[:-1]
            found.setdefault(".".join((package, *parts)), path)
    return found


def _imports(source: str, module: str, is_package: bool) -> set[str]:
    """Every name `source` imports at run time, anywhere in it (relative imports resolved)."""
    names: set[str] = set()
    here = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{anchor}.{base}" if base else anchor
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # a submodule, when it is one
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return names


@cache
def edges(module: str) -> frozenset[str]:
    """What `module` imports: our modules (with the packages above them, which import runs first) and
    the top names of the others."""
    path = modules()[module]
    out: set[str] = set()
    for name in _imports(path.read_text(), module, path.name == "__init__.py"):
        parts = name.split(".")
        ours = [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules()]
        out.update(ours if ours else [name])
    out.discard(module)
    return frozenset(out)


def reach(module: str) -> dict[str, list[str]]:
    """Everything `module` can import, each with the chain that gets there."""
    chains: dict[str, list[str]] = {module: [module]}
    stack = [module]
    while stack:
        current = stack.pop()
        for name in edges(current):
            if name in chains:
                continue
            chains[name] = [*chains[current], name]
            if name in modules() and name not in PROCESS_MAINS:
                stack.append(name)
    return chains


def _matches(module: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(module, pattern) or (pattern.endswith(".*") and module == pattern[:-2])


def _forbidden(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(patterns: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for module in sorted(m for m in modules() if any(_matches(m, p) for p in patterns)):
        for name, chain in sorted(reach(module).items()):
            if _forbidden(name, forbidden) and not _forbidden(name, (module,)):
                found.append(" -> ".join(chain))
    return found


@pytest.mark.parametrize(("patterns", "forbidden"), RULES, ids=[" ".join(p) for p, _ in RULES])
def test_folder_rule(patterns: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    assert any(_matches(m, p) for m in modules() for p in patterns), f"{patterns} match no module"
    found = violations(patterns, forbidden)
    assert not found, f"{patterns} must never reach {forbidden}:\n" + "\n".join(found[:20])


def test_a_lazy_import_inside_a_function_is_seen(tmp_path: Path) -> None:
    """A planted `import torch` inside a function, in the core and on the API side, breaks the rules."""
    source = "from __future__ import annotations\n\n\ndef later():\n    import torch\n    return torch\n"
    assert _imports(source, "pagoda.service.engine.core.scheduler", False) == {
        "__future__",
        "__future__.annotations",
        "torch",
    }
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\nelse:\n    import numpy\n"
    assert _imports(typed, "m", False) == {"typing", "typing.TYPE_CHECKING", "numpy"}
    relative = "from . import scheduler\nfrom ..messages import AddRequest\n"
    assert _imports(relative, "pagoda.service.engine.core.engine_core", False) == {
        "pagoda.service.engine.core",
        "pagoda.service.engine.core.scheduler",
        "pagoda.service.engine.messages",
        "pagoda.service.engine.messages.AddRequest",
    }
    for module in ("pagoda.service.engine.core.scheduler", "pagoda.service.engine.client.output_stream"):
        original = edges(module)
        edges.cache_clear()
        try:
            planted = modules()[module].read_text() + "\n\ndef _planted():\n    import torch  # noqa\n"
            path = tmp_path / "planted.py"
            path.write_text(planted)
            modules()[module] = path
            assert any(chain.endswith("-> torch") or chain == f"{module} -> torch"
                       for patterns, forbidden in RULES if any(_matches(module, p) for p in patterns)
                       for chain in violations(patterns, forbidden))  # fmt: skip
        finally:
            modules.cache_clear()
            edges.cache_clear()
        assert edges(module) == original


def test_every_process_main_exists() -> None:
    assert set(modules()) >= PROCESS_MAINS
