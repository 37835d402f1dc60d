"""The distribution ships every package: pyproject's explicit list matches the folders."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = tool["package-dir"]
    found = set()
    for name, folder in package_dir.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *relative)))
    assert found == set(tool["packages"])


def test_import_operator_is_the_standard_library() -> None:
    import operator

    import pagoda.operator

    assert operator.__file__ is not None and "site-packages" not in operator.__file__
    assert hasattr(operator, "itemgetter")
    assert Path(pagoda.operator.__file__).parent == ROOT / "operator"


def test_the_images_install_the_versions_of_the_lock() -> None:
    """docker/constraints.txt is the lock's pins (`make lock` writes both), and every package the images
    ask for is pinned by it: an image holds what the tests ran with."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docker_requirements", ROOT / "docker" / "requirements.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pins = (ROOT / "docker" / "constraints.txt").read_text().split()
    assert pins == module.constraints((ROOT / "requirements" / "dev.lock").read_text())
    pinned = {pin.split("==")[0].lower().replace("_", "-") for pin in pins}
    assert {"torch", "kopf", "fastapi", "uvicorn", "llguidance"} <= pinned
    # The server image's dependency layer reads only this file (and the constraints), so a change to
    # pyproject.toml that moves no dependency keeps that layer: `make lock` writes it.
    server = (ROOT / "docker" / "server-requirements.txt").read_text().splitlines()
    assert server == module.requirements(ROOT / "pyproject.toml", ["server"])
    wanted = module.requirements(ROOT / "pyproject.toml", ["server", "operator"])
    names = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in wanted}
    assert names <= pinned, names - pinned
