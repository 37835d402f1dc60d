"""The engine-core process of `pagoda serve`: the step loop, away from the API process's GIL.

Started by `AsyncEngine` as `python -m pagoda.service.engine.core_process`; it connects two ZMQ
sockets that the API process bound (requests and aborts in, step outputs out), loads the model
(tensor-parallel rank 0 lives here, its workers are this process's children), says `CoreReady` or
`CoreFailed`, then loops: take every waiting message, run one step, send what it produced.

It dies with the API process: the kernel sends it SIGKILL when its parent goes (PR_SET_PDEATHSIG),
even after a SIGKILL of the parent, so no core outlives its server. Ctrl-C is the parent's to handle.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import traceback

import msgspec
import zmq

from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.core import EngineCore, ModelExecutor
from pagoda.service.engine.messages import (
    Abort,
    AddRequest,
    CoreFailed,
    CoreOutputs,
    CoreReady,
    Shutdown,
    encoder,
    input_decoder,
)
from pagoda.service.engine.parent_death import die_with_parent

logger = logging.getLogger("pagoda.service.engine.core")

_IDLE_CHECK_MS = 1000  # how often an idle core checks that its workers live


def run(core: EngineCore, inputs: zmq.Socket[bytes], outputs: zmq.Socket[bytes]) -> int:
    """The step loop; returns the exit code. Waits on the input socket only when there is no work."""
    encode, decode = encoder().encode, input_decoder().decode
    while True:
        if not core.has_unfinished and not inputs.poll(_IDLE_CHECK_MS):
            # Idle: nothing would notice a dead tensor-parallel worker until the next request; look now,
            # so health fails (and Kubernetes restarts the pod) while no one is asking.
            try:
                core.executor.check_alive()
            except Exception as exc:
                logger.error("%s", exc)
                outputs.send(encode(CoreFailed(str(exc))))
                return 1
            continue
        changed = False
        while True:
            try:
                message = decode(inputs.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            changed = True
            if isinstance(message, AddRequest):
                core.add_request(message)
            elif isinstance(message, Abort):
                for request_id in message.request_ids:
                    core.abort(request_id, message.index)
            elif isinstance(message, Shutdown):
                return 0
        if core.has_unfinished:
            try:
                step = core.step()
            except Exception as exc:
                logger.exception("engine step failed")
                outputs.send(encode(CoreFailed(f"the engine step failed: {exc!r}")))
                return 1
            outputs.send(encode(CoreOutputs(step.tokens, step.prompt_logprobs, core.stats(), step.failures)))
        elif changed:  # aborts freed blocks: the API's queue and KV gauges should see it
            outputs.send(encode(CoreOutputs([], [], core.stats())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda-engine-core")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--eos-token-ids", required=True, help="JSON list")
    parser.add_argument("--inputs", required=True, help="ZMQ address the API process bound for requests")
    parser.add_argument("--outputs", required=True, help="ZMQ address the API process bound for outputs")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s",
        stream=sys.stderr,
    )
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.setsockopt(zmq.RCVHWM, 0)  # as the API process's side: never drop, never block the sender
    inputs.connect(args.inputs)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.connect(args.outputs)
    encode = encoder().encode
    executor = None
    try:
        config = msgspec.json.decode(args.config, type=EngineConfig)
        eos_token_ids = set(msgspec.json.decode(args.eos_token_ids, type=list[int]))
        from pagoda.service.engine.llm_engine import build_executor

        executor = build_executor(config, eos_token_ids)
        core = EngineCore(config, executor, eos_token_ids)
    except BaseException as exc:
        logger.exception("the engine core failed to start")
        outputs.send(encode(CoreFailed(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")))
        _close(executor, context)
        return 1
    outputs.send(encode(CoreReady(core.max_model_len, executor.model_config.vocab_size, core.stats())))
    try:
        return run(core, inputs, outputs)
    finally:
        _close(executor, context)


def _close(executor: ModelExecutor | None, context: zmq.Context[zmq.Socket[bytes]]) -> None:
    if executor is not None:
        executor.shutdown()
    context.destroy(linger=1000)  # let the last message out


if __name__ == "__main__":
    sys.exit(main())
