"""One engine's ranks over two nodes, as two `pagoda serve` processes on this host: the leader (node 0:
the API, the engine core with rank 0) and a `--headless` node 1, which meet at --master-addr 127.0.0.1.

Each group is started leader first (not ready while alone), answers through the OpenAI API token for
token as a one-node engine does (fp32, greedy), and is then broken one way: a rank of the headless node
killed, the leader SIGTERMed, the leader SIGKILLed, the headless node SIGTERMed. Each side is in its
own process group, and after each case neither group has a process left. The flags' mapping from a
LeaderWorkerSet's variables and the refusals are unit tests.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from process_group import children, cmdline, group_members, status, wait_for

from pagoda.service.cli import build_configs, node_placement
from pagoda.service.engine.config import EngineConfig, LoRAConfig
from pagoda.service.engine.runner.cpu_threads import cpu_budget
from pagoda.service.serve_process import ServeProcess

# One intra-op thread per process: up to five processes compute on two cores.
ENV = {"OMP_NUM_THREADS": "1"}
ENGINE = ["--device", "cpu", "--precision", "fp32", "--kv-cache-memory-bytes", str(4 << 20)]
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17], [300, 301]]
NEW_TOKENS = 8
PROMPT_S = 15.0  # how soon a broken group must show it: a closed connection is seen in well under 1 s


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Group:
    """The leader and the headless node of one engine, each in a process group of its own."""

    def __init__(self, ckpt: Path, tmp_path: Path, pp: int, tp: int, env: dict[str, str] = ENV) -> None:
        common = ["--model", str(ckpt), *ENGINE, "--pipeline-parallel-size", str(pp)]
        common += ["--tensor-parallel-size", str(tp), "--nnodes", "2", "--master-addr", "127.0.0.1"]
        common += ["--master-port", str(free_port())]
        self.leader = ServeProcess(
            [*common, "--node-rank", "0"], log_path=tmp_path / "leader.log", new_session=True, env=env
        )
        self.worker = ServeProcess(
            [*common, "--node-rank", "1", "--headless"],
            log_path=tmp_path / "worker.log",
            new_session=True,
            env=env,
        )

    def start(self, is_leader_first: bool) -> Group:
        """`is_leader_first`: node 1 starts once the leader's rank 0 waits for it, and the leader is not
        ready meanwhile; else both start at once (on two cores, a few seconds sooner). Both turn ready."""
        self.leader.launch().wait_ports()
        if is_leader_first:
            assert wait_for(lambda: "of the other nodes to join" in self.leader.log(), 60), self.leader.log()
            time.sleep(0.5)
            assert self.leader.ready_status() == 503
        self.worker.launch().wait_ready(120)
        self.leader.wait_ready(120)
        return self

    @property
    def pgids(self) -> list[int]:
        return [s.proc.pid for s in (self.leader, self.worker) if s.proc is not None]

    def url(self, server: ServeProcess, path: str) -> str:
        return f"{server.base_url}{path}"

    def logs(self) -> str:
        return f"--- leader\n{self.leader.log()[-3000:]}\n--- node 1\n{self.worker.log()[-3000:]}"

    def nothing_left(self) -> bool:
        return all(not group_members(pgid) for pgid in self.pgids)

    def close(self) -> None:
        for server in (self.leader, self.worker):
            server.kill()
        for pgid in self.pgids:
            for pid in group_members(pgid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def group_of(llama_ckpt: Path, tmp_path: Path) -> Iterator[Any]:
    made: list[Group] = []

    def make(pp: int, tp: int = 1, is_leader_first: bool = False, env: dict[str, str] = ENV) -> Group:
        made.append(Group(llama_ckpt, tmp_path, pp, tp, env))
        return made[-1].start(is_leader_first)

    yield make
    for group in made:
        group.close()


@pytest.fixture(scope="module")
def one_node_texts(llama_ckpt: Path) -> list[str]:
    """What one node's engine answers: the same checkpoint, fp32, greedy."""
    from pagoda.service.llm import LLM
    from pagoda.service.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=4 << 20) as llm:
        return [out.outputs[0].text for out in llm.generate(PROMPTS, params)]


def completions(server: ServeProcess) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    response = client.completions.create(
        model=model,
        prompt=PROMPTS,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]


def ranks_of(server: ServeProcess) -> list[int]:
    """The headless node's rank processes (not multiprocessing's resource tracker)."""
    assert server.proc is not None
    return [p for p in children(server.proc.pid) if "spawn_main" in cmdline(p)]


# ---- two nodes, end to end ----------------------------------------------------------------------------


def test_pp2_over_two_nodes_answers_as_one_node_and_a_killed_rank_fails_both(
    group_of: Any, one_node_texts: list[str]
) -> None:
    """One stage per node. The headless node's probes; then SIGKILL of its rank: it exits 1, the leader's
    probes fail, and the leader SIGTERMed exits 1 (its engine failed); nothing is left of either."""
    group = group_of(pp=2, is_leader_first=True)
    assert completions(group.leader) == one_node_texts, group.logs()
    for path in ("/health", "/v1/health/ready", "/v1/health/live"):
        assert status(group.url(group.worker, path)) == 200, path
    (rank,) = ranks_of(group.worker)
    os.kill(rank, signal.SIGKILL)
    assert group.worker.wait(PROMPT_S) == 1, group.logs()
    live, ready = group.url(group.leader, "/v1/health/live"), group.url(group.leader, "/v1/health/ready")
    assert wait_for(lambda: status(live) == 503, PROMPT_S), group.logs()
    assert status(ready) == 503
    assert "on node 1 is gone: its connection to rank 0 closed" in group.leader.log()
    assert group.leader.stop(20) == 1, group.logs()
    assert wait_for(group.nothing_left, 10), group.logs()


def test_pp2_tp2_over_two_nodes_answers_as_one_node_and_sigterm_to_the_leader_stops_both(
    group_of: Any, one_node_texts: list[str]
) -> None:
    """Two stages of two tensor-parallel ranks, a stage per node; SIGTERM to the leader's process group
    drains it (exit 0) and rank 0 stops node 1's ranks in order (exit 0). No OMP_NUM_THREADS (set empty):
    each node's ranks share its CPUs by the engine's own rule, the headless node's too."""
    group = group_of(pp=2, tp=2, env={"OMP_NUM_THREADS": ""})
    assert completions(group.leader) == one_node_texts, group.logs()
    assert len(ranks_of(group.worker)) == 2
    share = f"a rank (2 rank(s) on {cpu_budget()} usable CPUs"  # two ranks a node: each its half at most
    assert group.worker.log().count(share) == 2 and group.leader.log().count(share) == 1, group.logs()
    assert re.search(r"KV blocks per rank \[\d+, \d+, \d+, \d+\]: all use", group.leader.log())
    os.killpg(group.pgids[0], signal.SIGTERM)
    assert group.leader.wait(30) == 0, group.logs()
    assert group.worker.wait(PROMPT_S) == 0, group.logs()
    assert "rank 0 stopped the group" in group.worker.log()
    assert wait_for(group.nothing_left, 10), group.logs()


def test_a_killed_leader_ends_the_headless_node(group_of: Any) -> None:
    group = group_of(pp=2)
    group.leader.kill()  # SIGKILL of the API process: its core and the core's rank 0 die with it
    assert group.worker.wait(PROMPT_S) == 1, group.logs()
    assert "rank 0 is gone" in group.worker.log()
    assert wait_for(group.nothing_left, 10), group.logs()


def test_sigterm_to_the_headless_node_stops_it_and_fails_the_leader(group_of: Any) -> None:
    """The kernel may hand the node's SIGTERM to any of its threads: here to the health server's,
    not the main thread that waits on the ranks (kill(2) on a thread id delivers it to that thread).
    The main thread must still hear it: the node exits 0, the leader sees the group broken."""
    group = group_of(pp=2)
    node = group.pgids[1]
    os.kill(min(int(tid) for tid in os.listdir(f"/proc/{node}/task") if int(tid) != node), signal.SIGTERM)
    assert group.worker.wait(PROMPT_S) == 0, group.logs()
    live = group.url(group.leader, "/v1/health/live")
    assert wait_for(lambda: status(live) == 503, PROMPT_S), group.logs()
    assert group.leader.stop(20) == 1, group.logs()
    assert wait_for(group.nothing_left, 10), group.logs()


def test_a_node_started_with_other_settings_is_refused(llama_ckpt: Path, tmp_path: Path) -> None:
    """Node 1 with another --max-model-len: the leader refuses its rank at hello, naming the setting, and
    fails to start (exit 1); node 1 hears why and exits 1."""
    group = Group(llama_ckpt, tmp_path, pp=2, tp=1)
    group.worker.args += ["--max-model-len", "64"]
    try:
        group.leader.launch()
        group.worker.launch()
        assert group.leader.wait(90) == 1, group.logs()
        assert group.worker.wait(PROMPT_S) == 1, group.logs()
        assert (
            "rank 1 (node 1) refused: it was started with other settings than the leader"
            in group.leader.log()
        )
        assert "max_model_len: 64 there, None here" in group.worker.log()
        assert wait_for(group.nothing_left, 10), group.logs()
    finally:
        group.close()


# ---- flags, LeaderWorkerSet variables, refusals ------------------------------------------------------


LWS = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "llama-0.llama.default"}


def test_flags_default_to_the_leaderworkerset_variables() -> None:
    assert node_placement(None, None, None, False, {}) == (1, 0, None, False)
    assert node_placement(None, None, None, False, LWS) == (2, 1, "llama-0.llama.default", True)
    leader = {**LWS, "LWS_WORKER_INDEX": "0"}
    assert node_placement(None, None, None, False, leader) == (2, 0, "llama-0.llama.default", False)
    # Flags (or their PAGODA_ variables) win, each on its own; an explicit node rank is not made headless.
    assert node_placement(4, 3, "10.0.0.1", True, LWS) == (4, 3, "10.0.0.1", True)
    assert node_placement(None, 0, None, False, LWS) == (2, 0, "llama-0.llama.default", False)
    assert node_placement(None, None, None, False, {"LWS_GROUP_SIZE": "1", "LWS_WORKER_INDEX": "0"}) == (
        1,
        0,
        None,
        False,
    )
    with pytest.raises(ValueError, match="LWS_WORKER_INDEX='x' is not a number"):
        node_placement(None, None, None, False, {**LWS, "LWS_WORKER_INDEX": "x"})


def parse(*argv: str) -> Any:
    from pagoda.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_the_flags_build_the_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LWS:
        monkeypatch.delenv(name, raising=False)
    server, engine = build_configs(parse("--pipeline-parallel-size", "2", "--tensor-parallel-size", "2",
                                         "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                                         "--headless"))  # fmt: skip
    assert server.headless and (engine.nnodes, engine.node_rank, engine.ranks_per_node) == (2, 1, 2)
    assert (engine.master_addr, engine.master_port) == ("10.0.0.1", 29500)
    # Node 0's API flags on a headless node: ignored, so every node can run the same command line.
    argv = ["--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "a"]
    server, _ = build_configs(parse(*argv, "--headless", "--api-server-count", "2"))
    assert server.headless and server.api_server_count == 2
    server, engine = build_configs(parse("--pipeline-parallel-size", "2"))
    assert not server.headless and (engine.nnodes, engine.node_rank, engine.master_addr) == (1, 0, None)
    for name, value in LWS.items():
        monkeypatch.setenv(name, value)
    server, engine = build_configs(parse("--pipeline-parallel-size", "2", "--master-port", "29600"))
    assert server.headless and (engine.nnodes, engine.node_rank, engine.master_port) == (2, 1, 29600)
    assert engine.master_addr == "llama-0.llama.default"
    help_text = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless", "LWS_GROUP_SIZE"):
        assert flag in help_text, flag


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "3", "--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"],
         r"--nnodes 3 does not divide the 4 ranks of --pipeline-parallel-size 2 x --tensor-parallel-size 2"),
        (["--nnodes", "4", "--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"],
         r"1 of the 4 ranks .* on each node, which splits a pipeline stage's 2 tensor-parallel ranks"),
        (["--nnodes", "2", "--tensor-parallel-size", "2"], r"--nnodes 2 needs --master-addr"),
        (["--nnodes", "2", "--node-rank", "2", "--tensor-parallel-size", "2", "--headless"],
         r"--node-rank must be in \[0, 1\]"),
        (["--nnodes", "2", "--node-rank", "1", "--tensor-parallel-size", "2", "--master-addr", "a"],
         r"--node-rank 1: only node 0 serves the API; run the other nodes --headless"),
        (["--headless"], r"--headless is for nodes 1..N-1"),
        (["--nnodes", "2", "--tensor-parallel-size", "2", "--master-addr", "a", "--enable-lora"],
         r"LoRA adapters \(--enable-lora\) are not supported across nodes"),
        (["--nnodes", "2", "--tensor-parallel-size", "2", "--master-addr", "a", "--executor-class", "m:C"],
         r"--executor-class m:C runs on one node"),
        (["--nnodes", "2", "--tensor-parallel-size", "2", "--master-addr", "a", "--master-port", "0"],
         r"--master-port must be in \[1, 65535\], got 0"),
    ],
)  # fmt: skip
def test_refused_at_start(argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LWS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=message):
        build_configs(parse(*argv))


def test_what_the_nodes_must_share() -> None:
    """A headless node's hello carries these; the leader refuses one that differs, naming what."""
    from pagoda.service.engine.runner.nodes import compare_settings

    leader = EngineConfig(model="/m", pipeline_parallel_size=2, nnodes=2, master_addr="a")
    node = EngineConfig(
        model="/m", pipeline_parallel_size=2, nnodes=2, node_rank=1, master_addr="b", kv_cache_memory_bytes=1
    )
    assert compare_settings(leader.rank_settings(), node.rank_settings()) is None
    other = EngineConfig(model="/m", pipeline_parallel_size=2, nnodes=2, node_rank=1, master_addr="a",
                         dtype="float16", max_model_len=64)  # fmt: skip
    why = compare_settings(leader.rank_settings(), other.rank_settings())
    assert why is not None
    assert "dtype: 'float16' there, 'auto' here; max_model_len: 64 there, None here" in why
    assert "every node runs the same pagoda serve flags but --node-rank and --headless" in why
    with pytest.raises(ValueError, match="not supported across nodes"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, master_addr="a", lora=LoRAConfig())
