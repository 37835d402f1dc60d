"""`-p by_module`: under `pytest -n N --dist loadscope`, each test module goes whole to one xdist
worker, so its module-scoped server or engine starts once; the modules of SPREAD_MODULES, whose tests
share nothing costly, are spread test by test.

xdist's own `--dist loadgroup` is not used: it marks a group by rewriting `item._nodeid`, which pytest
9.2 no longer reads (the node id comes from `item._id`), so every test became its own group and each
module's server started on both workers (2026-12-03, pytest 9.2.0 and pytest-xdist 3.8.0).
"""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest
from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

# The interpreter kernel checks and the operator profiles: a subprocess or server per test.
SPREAD_MODULES = frozenset({"test_kernels_interpret.py", "test_operator_contract.py"})


def _is_spread(scope: str) -> bool:
    return PurePosixPath(scope.split("::", 1)[0]).name in SPREAD_MODULES


class ModuleScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with a module as the scope (not a class), except SPREAD_MODULES.

    The spread tests go out first: each is one long unit (the 90 s interpreter checks, a TP 8 server), and
    one left for the end would keep a worker busy while the other idles. xdist's own order (most tests
    first) follows, and the small modules even out the end."""

    _spread_first = False

    def _split_scope(self, nodeid: str) -> str:
        return nodeid if _is_spread(nodeid) else nodeid.split("::", 1)[0]

    def _assign_work_unit(self, node: WorkerController) -> None:
        if not self._spread_first:  # the work queue is complete before the first unit goes out
            self._spread_first = True
            for scope in reversed([s for s in self.workqueue if _is_spread(s)]):
                self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadScopeScheduling | None:
    if config.getvalue("dist") != "loadscope":
        return None
    return ModuleScheduling(config, log)  # type: ignore[arg-type]
