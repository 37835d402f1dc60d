"""The engine-core process of `pagoda serve`: the step loop, away from the API process's GIL.

Started by `AsyncEngine` as `python -m pagoda.service.engine.core_process`; it connects to the ZMQ
sockets that each API process bound (requests and aborts in, step outputs out), loads the model
(tensor-parallel rank 0 lives here, its workers are this process's children), says `CoreReady` or
`CoreFailed`, then loops: take every waiting message, run one step, send what it produced. With
several API processes (`--api-server-count`) one PULL socket fair-queues the requests of all, and each
process gets its own requests' outputs of every step (their ids say whose they are) and the stats.

It dies with the API process: the kernel sends it SIGKILL when its parent goes (PR_SET_PDEATHSIG),
even after a SIGKILL of the parent, so no core outlives its server. Ctrl-C is the parent's to handle.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import sys
import time
import traceback
from collections.abc import Callable

import msgspec
import zmq

from pagoda.service import gc_pauses
from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.core.engine_core import EngineCore, ModelExecutor
from pagoda.service.engine.messages import (
    Abort,
    AddRequest,
    CoreFailed,
    CoreOutputs,
    CoreReady,
    EngineStats,
    LoRAOp,
    LoRAReply,
    PromptLogprobs,
    RequestFailure,
    Shutdown,
    TokenOutput,
    encoder,
    input_decoder,
    split_core_request_id,
)
from pagoda.service.engine.parent_death import die_with_parent
from pagoda.service.stop_relay import RELAYED_STOP, STACK_DUMP_SIGNAL, relay_stop_signals

logger = logging.getLogger("pagoda.service.engine.core.engine_core")

_IDLE_CHECK_MS = 1000  # how often an idle core checks that its workers live


def run(core: EngineCore, inputs: zmq.Socket[bytes], outputs: list[zmq.Socket[bytes]]) -> int:
    """The step loop; returns the exit code. Waits on the input socket only when there is no work.
    `outputs`: one socket per API process."""
    encode, decode = encoder().encode, input_decoder().decode

    def broadcast(message: CoreFailed) -> None:
        for socket in outputs:
            socket.send(encode(message))

    while True:
        if not core.has_unfinished and not inputs.poll(_IDLE_CHECK_MS):
            # Idle: nothing would notice a dead tensor-parallel worker until the next request; look now,
            # so health fails (and Kubernetes restarts the pod) while no one is asking.
            try:
                core.executor.check_alive()
            except Exception as exc:
                logger.error("%s", exc)
                broadcast(CoreFailed(str(exc)))
                return 1
            continue
        changed = False
        replies: list[LoRAReply] = []
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
            elif isinstance(message, LoRAOp):
                replies.append(LoRAReply(message.op_id, core.lora_op(message.name, message.path)))
            elif isinstance(message, Shutdown):
                return 0
        if core.has_unfinished:
            try:
                step = core.step()
            except Exception as exc:
                logger.exception("engine step failed")
                broadcast(CoreFailed(f"the engine step failed: {exc!r}"))
                return 1
            failures = step.failures + core.take_lora_failures()
            send_outputs(encode, outputs, step.tokens, step.prompt_logprobs, failures, core.stats(), replies)
        elif changed:  # aborts freed blocks: the API's queue and KV gauges should see it
            send_outputs(encode, outputs, [], [], core.take_lora_failures(), core.stats(), replies)


def send_outputs(
    encode: Callable[[object], bytes],
    outputs: list[zmq.Socket[bytes]],
    tokens: list[TokenOutput],
    prompt_logprobs: list[PromptLogprobs],
    failures: list[RequestFailure],
    stats: EngineStats,
    lora_replies: list[LoRAReply] | None = None,
) -> None:
    """One step's outputs to the API processes: all of them to the only one, or else each process its
    own requests' (ids back to the process's own) and the stats to every process, which serve /metrics."""
    now = time.monotonic()
    if len(outputs) == 1:
        outputs[0].send(
            encode(CoreOutputs(tokens, prompt_logprobs, stats, failures, now, lora_replies or []))
        )
        return
    routed = [CoreOutputs([], [], stats, [], now) for _ in outputs]
    for reply in lora_replies or ():
        api_index, reply.op_id = split_core_request_id(reply.op_id)
        routed[api_index].lora_replies.append(reply)
    for token in tokens:
        api_index, token.request_id = split_core_request_id(token.request_id)
        routed[api_index].outputs.append(token)
    for scores in prompt_logprobs:
        api_index, scores.request_id = split_core_request_id(scores.request_id)
        routed[api_index].prompt_logprobs.append(scores)
    for failure in failures:
        api_index, failure.request_id = split_core_request_id(failure.request_id)
        routed[api_index].failures.append(failure)
    for socket, message in zip(outputs, routed, strict=True):
        socket.send(encode(message))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda-engine-core")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--eos-token-ids", required=True, help="JSON list")
    parser.add_argument(
        "--inputs", nargs="+", required=True, help="ZMQ addresses the API processes bound for requests"
    )
    parser.add_argument(
        "--outputs", nargs="+", required=True, help="ZMQ addresses the API processes bound for outputs"
    )
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    # the workers relay theirs here: this process sends them on (pagoda.service.stop_relay)
    relay_stop_signals(args.parent_pid, also=(RELAYED_STOP,))
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)  # where it is, when it stalls
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s",
        stream=sys.stderr,
    )
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.setsockopt(zmq.RCVHWM, 0)  # as the API process's side: never drop, never block the sender
    for address in args.inputs:  # one PULL fair-queues every API process's requests
        inputs.connect(address)
    outputs = []
    for address in args.outputs:
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.connect(address)  # queues until that API process has bound it
        outputs.append(socket)
    encode = encoder().encode
    executor = None
    try:
        config = msgspec.json.decode(args.config, type=EngineConfig)
        eos_token_ids = set(msgspec.json.decode(args.eos_token_ids, type=list[int]))
        from pagoda.service.engine.runner.executor import build_executor

        executor = build_executor(config, eos_token_ids, relay_stop_signals=True)
        core = EngineCore(config, executor, eos_token_ids)
    except BaseException as exc:
        logger.exception("the engine core failed to start")
        failed = CoreFailed(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")
        for socket in outputs:
            socket.send(encode(failed))
        _close(executor, context)
        return 1
    gc_pauses.freeze()  # the model and the libraries: never walked by a collection in the step loop
    core.gc_pauses = gc_pauses.GcPauses().start()
    ready = CoreReady(core.max_model_len, executor.model_config.vocab_size, core.stats())
    for socket in outputs:
        socket.send(encode(ready))
    try:
        return run(core, inputs, outputs)
    finally:
        core.close()
        _close(executor, context)


def _close(executor: ModelExecutor | None, context: zmq.Context[zmq.Socket[bytes]]) -> None:
    if executor is not None:
        executor.shutdown()
    context.destroy(linger=1000)  # let the last message out


if __name__ == "__main__":
    sys.exit(main())
