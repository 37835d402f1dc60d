"""Prints the requirements of pyproject.toml's base dependencies plus the named extras, one a line.

The image builds install these in a layer of their own, so that a change to the code rebuilds only the
small layer holding the project (`python3 docker/requirements.py server`).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    found = list(project["dependencies"])
    for extra in extras:
        found += [r for r in project["optional-dependencies"][extra] if not r.startswith("pagoda[")]
    return found


if __name__ == "__main__":
    print("\n".join(requirements(Path(sys.argv[0]).resolve().parent.parent / "pyproject.toml", sys.argv[1:])))
