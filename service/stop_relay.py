"""Stop signals that reach a child of `pagoda serve` become one stop of the whole server.

`kill -- -PGID`, Ctrl-C in a terminal and systemd's `KillMode=control-group` signal every process of
the server at once, not only API process 0. The children (API processes 1..N-1, the engine core, the
tensor-parallel workers) do not act on SIGTERM or SIGINT themselves: they relay it to their parent as
`RELAYED_STOP`, up to API process 0, which starts the drain as for its own SIGTERM and stops them in
order (the core last, once every request has finished). A relayed stop never counts as the second,
aborting signal, so the whole group signalled once drains exactly as process 0 signalled once.
"""

from __future__ import annotations

import contextlib
import os
import signal
from types import FrameType

RELAYED_STOP = signal.SIGUSR1
STACK_DUMP_SIGNAL = signal.SIGUSR2  # the core prints its threads' stacks (faulthandler): see server.py
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def relay_stop_signals(parent_pid: int, also: tuple[signal.Signals, ...] = ()) -> None:
    """From now on, SIGTERM, SIGINT (and `also`) reaching this process are sent on to `parent_pid` as
    `RELAYED_STOP`. Call first thing in the child's main thread."""

    def relay(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):  # the parent is gone: parent_death ends us
            os.kill(parent_pid, RELAYED_STOP)

    for sig in (*STOP_SIGNALS, *also):
        signal.signal(sig, relay)
