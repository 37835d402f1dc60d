"""`pagoda serve` as a child process: started on free ports, waited on until ready, stopped with
SIGTERM. Used by `pagoda demo`, the serving tests and benchmarks; standard library only."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

# Logged by pagoda.service.server once both servers listen (a headless node logs no gRPC port).
_PORTS = re.compile(r"HTTP on (\S+):(\d+)(?:, gRPC on (\S+):(\d+))?")


class ServeProcess:
    def __init__(
        self,
        args: list[str],
        host: str = "127.0.0.1",
        log_path: Path | None = None,
        new_session: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        """`new_session`: run in a process group of its own (its pid), so a caller can find every
        process it started. `env`: added to this process's environment."""
        self.args = args
        self.extra_env = env or {}
        self.new_session = new_session
        self.host = host
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="pagoda-serve-", suffix=".log")[1])
        self.http_port = 0
        self.grpc_port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "pagoda.cli", "serve", "--host", self.host, *self.args]

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, timeout_s: float = 300.0) -> ServeProcess:
        """Start on free ports (unless `args` name them) and wait for /v1/health/ready to answer 200."""
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> ServeProcess:
        """Start on free ports (unless `args` name them), without waiting for anything."""
        args = list(self.args)
        for flag in ("--port", "--grpc-port"):
            if flag not in args:
                args += [flag, "0"]
        self.args = args
        # PYTHONSAFEPATH: the repo's operator/ must not shadow the stdlib.
        env = {**os.environ, **self.extra_env, "PYTHONSAFEPATH": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=self.new_session,
            )
        return self

    def wait_ports(self, timeout_s: float = 120.0) -> ServeProcess:
        """Wait until the server says which ports it listens on (before it is ready)."""
        deadline = time.monotonic() + timeout_s
        while not self._read_ports():
            if time.monotonic() > deadline:
                raise TimeoutError(f"pagoda serve named no port in {timeout_s:.0f} s:\n{self.log()[-4000:]}")
            time.sleep(0.1)
        return self

    def _read_ports(self) -> bool:
        assert self.proc is not None, "not launched"
        if self.proc.poll() is not None:
            raise RuntimeError(f"pagoda serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
        if not self.http_port and (match := _PORTS.search(self.log())):
            self.http_port, self.grpc_port = int(match.group(2)), int(match.group(4) or 0)
        return bool(self.http_port)

    def wait_ready(self, timeout_s: float = 300.0) -> ServeProcess:
        """Wait for /v1/health/ready to answer 200 (SIGKILL and TimeoutError past `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._read_ports() and self.ready_status() == 200:
                return self
            time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"pagoda serve not ready after {timeout_s:.0f} s:\n{self.log()[-4000:]}")

    def ready_status(self) -> int | None:
        """The status code of /v1/health/ready, or None when nothing answers."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/v1/health/ready", timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None

    def terminate(self) -> None:
        """Send SIGTERM: the server drains and exits."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float = 120.0) -> int:
        """The exit code; TimeoutError with the log's tail if it has not exited within `timeout_s`."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"pagoda serve still running after {timeout_s:.0f} s:\n{self.log()[-4000:]}"
            ) from None

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM and wait; SIGKILL past the timeout. Return the exit code."""
        if self.proc is None:
            return 0
        self.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Stop it; a server that did not exit 0 (a hang killed past the timeout is -9) raises, unless
        the block is already raising."""
        code = self.stop()
        if code != 0 and exc_type is None:
            raise RuntimeError(f"pagoda serve exited with {code}:\n{self.log()[-4000:]}")
