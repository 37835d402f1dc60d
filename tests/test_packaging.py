"""The distribution ships every package: pyproject's explicit list matches the folders."""

from __future__ import annotations

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
