"""Grammar checks in a child process with memory and CPU limits: a grammar that crashes or blows up the
grammar library takes the child with it, never the API process (or the offline `LLM`'s).

Why a process: llguidance is Rust behind Python. The bounds in `grammar.py` refuse what is known to
hurt it, but inside them a grammar can still be slow or costly to compile, and a crash in native code
(a segfault, an abort on a failed allocation) cannot be caught in the process it happens in. Measured
on the 2-core development machine: a check in the child costs 0.2-0.4 ms more than in the process
(0.31 against 0.13 ms for a three-property schema), and the child starts in ~0.1 s at the first
grammar; a thread could not stop a runaway compile at all. Results are cached by source
(`grammar._grammar_error`), so a repeated schema is checked once.

The child (`python -m pagoda.service.grammar_sandbox MEMORY_BYTES TIMEOUT_S`) reads one JSON request per
line on stdin, `[kind, source]`, converts the grammar to llguidance's form and validates it, and answers
one JSON line: `[error, serialized]` (error "" when valid). Its address space is capped (RLIMIT_AS) and,
per check, its CPU time (RLIMIT_CPU: the kernel ends a runaway compile even if this process is gone);
the parent waits `timeout_s` for an answer, then kills it. It ignores SIGINT and SIGTERM (a signal to
the process group must not fail the checks of a draining server) and exits at EOF, when its parent has
closed the pipe or died. A dead or killed child is replaced at the next check.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading

START_TIMEOUT_S = 60.0  # an interpreter and the library starting on a loaded machine
MEMORY_BYTES = 2 << 30  # the 19 KB schema of issue 30 asked for 671 MB at once; typical ones take ~50 MB
TIMEOUT_S = 10.0  # typical schemas validate in milliseconds; 20,000 choices take 0.35 s
_MAX_ERROR_CHARS = 2000


class GrammarSandbox:
    """One child process, one check at a time (checks take milliseconds; callers are threads)."""

    def __init__(self, memory_bytes: int = MEMORY_BYTES, timeout_s: float = TIMEOUT_S) -> None:
        self.memory_bytes = memory_bytes
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None

    def check(self, kind: str, source: str) -> tuple[str, str]:
        """(error, llguidance's serialized grammar): error "" when `source` is a valid grammar of
        `kind`; otherwise the library's message, or what happened to the child that tried."""
        request = (json.dumps([kind, source]) + "\n").encode()
        with self._lock:
            child = self._running()
            try:
                assert child.stdin is not None
                child.stdin.write(request)
                child.stdin.flush()
            except BrokenPipeError:  # died while idle (killed from outside): once more, with a new one
                self._stop(child)
                child = self._running()
                assert child.stdin is not None
                child.stdin.write(request)
                child.stdin.flush()
            return self._answer(child)

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                self._stop(self._child)

    def _answer(self, child: subprocess.Popen[bytes]) -> tuple[str, str]:
        line = _read_line(child, self.timeout_s)
        if line is None:
            self._stop(child)
            return f"compiling it took more than {self.timeout_s:g} s", ""
        if not line:
            code = self._stop(child)
            return f"it crashed the grammar compiler ({_describe(code)})", ""
        error, serialized = json.loads(line)
        return str(error), str(serialized)

    def _running(self) -> subprocess.Popen[bytes]:
        """The child, started if need be; it says "ready" once the library is loaded, so a check's
        time limit never counts the start."""
        if self._child is None or self._child.poll() is not None:
            child = subprocess.Popen(
                [sys.executable, "-m", __name__, str(self.memory_bytes), str(self.timeout_s)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
            )
            if _read_line(child, START_TIMEOUT_S) != b"ready\n":
                self._stop(child)
                raise RuntimeError("the grammar sandbox did not start (see its error above)")
            self._child = child
        return self._child

    def _stop(self, child: subprocess.Popen[bytes]) -> int:
        if child.poll() is None:
            child.kill()
        code = child.wait()
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()
        if self._child is child:
            self._child = None
        return code

    def __del__(self) -> None:  # the child exits at EOF anyway; this only closes it sooner
        child = self._child
        if child is not None and child.poll() is None:
            child.kill()


def _read_line(child: subprocess.Popen[bytes], timeout_s: float) -> bytes | None:
    """The child's next line; b"" if it died first; None if it said nothing for `timeout_s`. (Lines
    come whole: the child writes each with one flush, and nothing is read ahead of the select.)"""
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], timeout_s)
    return child.stdout.readline() if ready else None


def _describe(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        hint = {"SIGABRT": ": out of memory, perhaps", "SIGXCPU": ": out of CPU time"}.get(name, "")
        return f"{name}{hint}"
    return f"exit code {code}"


def _child_main(memory_bytes: int, timeout_s: float) -> None:
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
    from llguidance import LLMatcher

    from pagoda.service.grammar import Grammar

    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:  # EOF: the parent closed the pipe, or died
        kind, source = json.loads(line)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        budget = int(usage.ru_utime + usage.ru_stime + timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (budget, cpu_hard))
        serialized = ""
        try:
            serialized = Grammar(kind, source).to_llguidance()
            error = LLMatcher.validate_grammar(serialized)
        except MemoryError:
            error = f"it needs more than {memory_bytes >> 20} MiB to compile"
        except ValueError as exc:  # not valid JSON
            error = str(exc)
        except BaseException as exc:  # a Rust panic arrives as a BaseException
            error = f"the grammar compiler failed on it ({type(exc).__name__})"
        out.write((json.dumps([error[:_MAX_ERROR_CHARS], "" if error else serialized]) + "\n").encode())
        out.flush()


if __name__ == "__main__":
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # validation is single-threaded: no idle pool
    _child_main(int(sys.argv[1]), float(sys.argv[2]))
