"""`pagoda serve`'s processes live and die together: the API process, the engine core, and (TP > 1) the
tensor-parallel workers. Each test starts a real server in a process group of its own and checks
that no process of the group is left behind, whichever of them goes first."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from process_group import children, cmdline, group_members, status, wait_for

from pagoda.service.serve_process import ServeProcess

# Well past a drain with nothing in flight (about a second); well short of the 30 s grace a pod gets.
STOP_TIMEOUT_S = 20.0


def start(llama_ckpt: Path, tmp_path: Path, tp: int = 1) -> ServeProcess:
    args = ["--model", str(llama_ckpt), "--device", "cpu", "--kv-cache-memory-bytes", str(8 << 20)]
    args += ["--tensor-parallel-size", str(tp)]
    return ServeProcess(args, log_path=tmp_path / "serve.log", new_session=True).start()


def test_sigterm_to_the_group_stops_every_process(llama_ckpt: Path, tmp_path: Path) -> None:
    """At TP 2 to the whole group: the worker and the core relay it, so the server stops as for one.
    SIGTERM to the API process alone, at TP 1: the stalled-core test's last step here, and
    tests/test_serve_shutdown.py's drain. SIGKILL of the API process at TP 2:
    tests/test_serve_api_servers.py's process-0 test, whose layout has a worker too."""
    server = start(llama_ckpt, tmp_path, tp=2)
    assert server.proc is not None
    pgid = server.proc.pid
    assert len(children(pgid)) >= 2, "the engine core and its worker run as processes of their own"
    os.killpg(pgid, signal.SIGTERM)
    assert server.wait() == 0, server.log()[-3000:]
    assert wait_for(lambda: not group_members(pgid), 10), group_members(pgid)


@pytest.mark.parametrize("victim", ["core", "worker"])
def test_a_dead_engine_process_fails_readiness_and_liveness(
    llama_ckpt: Path, tmp_path: Path, victim: str
) -> None:
    """SIGKILL of the engine core, or of a tensor-parallel worker while the server is idle: both health
    probes fail (Kubernetes restarts the pod), requests get 503, and SIGTERM still leaves nothing."""
    server = start(llama_ckpt, tmp_path, tp=1 if victim == "core" else 2)
    assert server.proc is not None
    pgid = server.proc.pid
    marker = "pagoda.service.engine.core_process" if victim == "core" else "spawn_main"
    targets = [p for p in children(pgid) if marker in cmdline(p)]
    assert len(targets) == 1, [cmdline(p) for p in children(pgid)]
    os.kill(targets[0], signal.SIGKILL)
    live, ready = f"{server.base_url}/v1/health/live", f"{server.base_url}/v1/health/ready"
    assert wait_for(lambda: status(live) == 503, 30), server.log()[-3000:]
    assert status(ready) == 503
    request = urllib.request.Request(
        f"{server.base_url}/v1/completions",
        data=b'{"prompt": "Hi", "max_tokens": 2}',
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 503
    code = server.stop(timeout_s=STOP_TIMEOUT_S)
    assert code == 1, f"exit code {code} (-9: killed after {STOP_TIMEOUT_S} s)\n{server.log()[-3000:]}"
    assert wait_for(lambda: not group_members(pgid), 10), group_members(pgid)


def test_a_start_up_error_reaches_the_log_and_the_exit_code(llama_ckpt: Path, tmp_path: Path) -> None:
    """A checkpoint that cannot load on any rank: `pagoda serve` exits 1, says why, leaves nothing."""
    broken = tmp_path / "broken"
    shutil.copytree(llama_ckpt, broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] += 1  # the weights of one more layer than the file has
    (broken / "config.json").write_text(json.dumps(config))
    server = ServeProcess(
        ["--model", str(broken), "--device", "cpu", "--tensor-parallel-size", "2"],
        log_path=tmp_path / "serve.log",
        new_session=True,
    )
    with pytest.raises(RuntimeError, match="exited with 1"):
        server.start()
    assert "checkpoint has no tensor" in server.log()
    assert server.proc is not None
    assert wait_for(lambda: not group_members(server.proc.pid), 10)  # type: ignore[union-attr]


def test_a_stalled_core_fails_liveness_says_where_and_recovers(llama_ckpt: Path, tmp_path: Path) -> None:
    """A stopped core (as a deadlock or a hung GPU would leave it) with a request pending: past the stall
    timeout both probes fail, the log names the stall and, once the core runs again, its stacks; the
    request then completes and the probes recover."""
    args = ["--model", str(llama_ckpt), "--device", "cpu", "--kv-cache-memory-bytes", str(8 << 20)]
    args += ["--engine-stall-timeout", "2"]
    server = ServeProcess(args, log_path=tmp_path / "serve.log", new_session=True).start()
    assert server.proc is not None
    try:
        (core,) = [p for p in children(server.proc.pid) if "pagoda.service.engine.core_process" in cmdline(p)]
        live, ready = f"{server.base_url}/v1/health/live", f"{server.base_url}/v1/health/ready"
        answers: list[dict[str, object]] = []

        def ask() -> None:
            request = urllib.request.Request(
                f"{server.base_url}/v1/completions",
                data=json.dumps({"prompt": "Hi", "max_tokens": 4, "ignore_eos": True}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=120) as response:
                answers.append(json.loads(response.read()))

        os.kill(core, signal.SIGSTOP)
        try:
            asker = threading.Thread(target=ask)
            asker.start()
            assert wait_for(lambda: status(live) == 503, 30), server.log()[-3000:]
            assert status(ready) == 503
            assert wait_for(lambda: "made no step for" in server.log(), 10), server.log()[-3000:]
        finally:
            os.kill(core, signal.SIGCONT)
        asker.join(60)
        assert len(answers) == 1 and answers[0]["usage"]["completion_tokens"] == 4  # type: ignore[index]
        assert wait_for(lambda: status(live) == 200 and status(ready) == 200, 30), server.log()[-3000:]
        assert wait_for(lambda: "core_process.py" in server.log().split("made no step for")[-1], 10)
        assert wait_for(lambda: "the engine core steps again" in server.log(), 10), server.log()[-3000:]
        assert server.stop() == 0, server.log()[-3000:]  # SIGTERM to the API process: every process goes
        assert wait_for(lambda: not group_members(server.proc.pid), 10), group_members(server.proc.pid)
    finally:
        if server.proc.poll() is None:  # failed above: leave no server behind
            server.kill()
