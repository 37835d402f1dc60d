"""One rule for every child process of `pagoda serve`: it does not outlive its parent."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel SIGKILLs this process when its parent exits, even by SIGKILL. The signal follows
    the parent *thread* that started this process, so start children from a thread that lives as long
    as the parent does. Exits at once if the parent is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)
