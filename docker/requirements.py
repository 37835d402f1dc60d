"""The images' requirements, from pyproject.toml and the lock.

- `python3 docker/requirements.py server [operator ...]`: pyproject.toml's base dependencies plus the
  named extras, one a line. The image builds install these in a layer of their own, so that a change to
  the code rebuilds only the small layer holding the project.
- `python3 docker/requirements.py --constraints`: every package of requirements/dev.lock as
  `name==version`, which `make lock` writes to docker/constraints.txt. The wheel download and both
  Dockerfiles install under it (`pip -c`), so an image holds the versions the tests ran with. (Not the
  lock itself: pip refuses hashes in a constraints file, and the images install a subset of the lock.)
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", re.MULTILINE)


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    found = list(project["dependencies"])
    for extra in extras:
        found += [r for r in project["optional-dependencies"][extra] if not r.startswith("pagoda[")]
    return found


def constraints(lock_text: str) -> list[str]:
    """`name==version` for every package a `uv pip compile` lock pins."""
    return [f"{name}=={version}" for name, version in _PIN.findall(lock_text)]


if __name__ == "__main__":
    if sys.argv[1:] == ["--constraints"]:
        print("\n".join(constraints((ROOT / "requirements" / "dev.lock").read_text())))
    else:
        print("\n".join(requirements(ROOT / "pyproject.toml", sys.argv[1:])))
