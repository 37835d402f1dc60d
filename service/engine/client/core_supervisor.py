"""The engine core as a child of API process 0: started from its command line, watched from a thread,
asked to stop or killed. Its exit reaches the event loop as a callback. Nothing here knows about
requests or messages: that is `AsyncEngine`'s part."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from collections.abc import Callable


class CoreSupervisor:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.exited = asyncio.Event()  # set on the event loop once the core has exited

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, command: list[str], on_exit: Callable[[], None]) -> None:
        """Start the core; `on_exit` runs on this event loop after `exited` is set. Call from the event
        loop's thread."""
        env = {**os.environ, "PYTHONSAFEPATH": "1"}  # the repo's operator/ must not shadow the stdlib
        self.proc = proc = subprocess.Popen(command, env=env)
        loop = asyncio.get_running_loop()

        def watch() -> None:
            proc.wait()
            loop.call_soon_threadsafe(self._on_exit, on_exit)

        threading.Thread(target=watch, name="pagoda-core-watch", daemon=True).start()

    def _on_exit(self, on_exit: Callable[[], None]) -> None:
        self.exited.set()
        on_exit()

    async def wait(self, timeout_s: float) -> bool:
        """True once the core has exited, False if it still runs after `timeout_s`."""
        try:
            await asyncio.wait_for(self.exited.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def kill(self) -> None:
        """SIGKILL, and wait for the exit (off the event loop)."""
        assert self.proc is not None
        self.proc.kill()
        await asyncio.to_thread(self.proc.wait)
