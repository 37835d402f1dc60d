"""What carrying a step's `StepInput` to the ranks costs: rank 0's time in its sends, and the time until
the last rank has the bytes, for the transports considered for ranks on other nodes
(service/engine/runner/nodes.py, executor.py's docstring):

- pipe: one node, rank 0 writes each worker's pipe (what the leader's own workers get);
- direct: rank 0 writes one TCP connection per remote rank (what was built);
- forward: rank 0 writes one TCP connection per remote node, whose agent writes its ranks' pipes.

Standard library only (bytes of a pickled step's size stand for it; pickling is the same ~16 us for all),
over the loopback: the wire adds its latency and 35 KB / bandwidth (3 us at 100 Gb/s) to the TCP rows.

    python bench/step_transport.py [--ranks 1 2 4 8] [--steps 3000]
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import socket
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "nodes", Path(__file__).resolve().parent.parent / "service/engine/runner/nodes.py"
)
assert _SPEC is not None and _SPEC.loader is not None
nodes = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(nodes)

DECODE_BYTES = 35 << 10  # a 64-request decode step with 128-block tables, pickled
STEP_GAP_S = 0.002  # a step's compute between two sends: nothing queues


def receiver(conn: Connection, steps: int, out: Connection) -> None:
    """Take `steps` messages; send back when each arrived."""
    arrived = []
    for _ in range(steps):
        conn.recv_bytes()
        arrived.append(time.perf_counter())  # CLOCK_MONOTONIC: one clock for every process
    out.send(arrived)


def tcp_receiver(port: int, steps: int, out: Connection) -> None:
    receiver(nodes.connect("127.0.0.1", port), steps, out)


def agent(port: int, num_ranks: int, steps: int, out: Connection) -> None:
    """A headless node's forwarder: one TCP connection in, its ranks' pipes out."""
    context = mp.get_context("spawn")
    pipes, procs, results = [], [], []
    for _ in range(num_ranks):
        ours, theirs = context.Pipe()
        back, back_theirs = context.Pipe(duplex=False)
        procs.append(context.Process(target=receiver, args=(theirs, steps, back_theirs)))
        procs[-1].start()
        pipes.append(ours)
        results.append(back)
    conn = nodes.connect("127.0.0.1", port)
    for _ in range(steps):
        message = conn.recv_bytes()
        for pipe in pipes:
            pipe.send_bytes(message)
    out.send([r.recv() for r in results])
    for proc in procs:
        proc.join()


def run(kind: str, num_ranks: int, steps: int) -> tuple[float, float]:
    """(median us rank 0 spends in its sends, median us until the last rank has the step)."""
    context = mp.get_context("spawn")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    conns, procs, results = [], [], []
    num_peers = 1 if kind == "forward" else num_ranks
    for _ in range(num_peers):
        back, back_theirs = context.Pipe(duplex=False)
        if kind == "pipe":
            ours, theirs = context.Pipe()
            proc = context.Process(target=receiver, args=(theirs, steps, back_theirs))
            conns.append(ours)
        elif kind == "direct":
            proc = context.Process(target=tcp_receiver, args=(port, steps, back_theirs))
        else:
            proc = context.Process(target=agent, args=(port, num_ranks, steps, back_theirs))
        proc.start()
        procs.append(proc)
        results.append(back)
    if kind != "pipe":
        conns = [nodes._tune(listener.accept()[0], 60.0) for _ in range(num_peers)]
    time.sleep(2.0)  # every receiver up
    message = os.urandom(DECODE_BYTES)
    sent, spent = [], []
    for _ in range(steps):
        start = time.perf_counter()
        for conn in conns:
            conn.send_bytes(message)
        sent.append(start)
        spent.append(time.perf_counter() - start)
        time.sleep(STEP_GAP_S)
    arrived: list[list[float]] = []
    for back in results:
        got = back.recv()  # a receiver's times, or an agent's list of its ranks' times
        if kind == "forward":
            arrived.extend(got)
        else:
            arrived.append(got)
    for proc in procs:
        proc.join()
    listener.close()
    skip = steps // 10  # warm-up
    last = [max(times[i] for times in arrived) - sent[i] for i in range(skip, steps)]
    return statistics.median(spent[skip:]) * 1e6, statistics.median(last) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    gap_ms = STEP_GAP_S * 1e3
    print(f"{os.cpu_count()} CPUs; a {DECODE_BYTES >> 10} KB step, {args.steps} steps {gap_ms:.0f} ms apart")
    print(f"{'transport':>9} {'ranks':>5} {'rank 0 sends (us)':>18} {'until the last rank has it (us)':>32}")
    for num_ranks in args.ranks:
        for kind in ("pipe", "direct", "forward"):
            spent, last = run(kind, num_ranks, args.steps)
            print(f"{kind:>9} {num_ranks:>5} {spent:>18.1f} {last:>32.1f}")


if __name__ == "__main__":
    main()
