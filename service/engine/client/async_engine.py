"""The engine as the API process sees it: each request an async stream of `RequestOutput`s, served by
an engine-core process (`core_process`) over two ZMQ sockets.

This side owns the text: it validates and tokenizes prompts, detokenizes, finds stop strings (and
tells the core to stop that sequence), and builds outputs. The core only schedules and steps, so its
loop never waits for this process's GIL, nor this event loop for a step.

With `--api-server-count N` there are N API processes and one core (`CoreLink`): API process 0 starts
the core, the others attach to it. Each binds its own pair of sockets; the core connects to all of
them. Request ids travel to the core namespaced by the process's index, so ids chosen by clients of
different processes never collide there, and the core sends each process only its own outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from pagoda.service.engine.client.core_supervisor import CoreSupervisor
from pagoda.service.engine.client.input_processor import InputProcessor
from pagoda.service.engine.client.output_processor import OutputProcessor
from pagoda.service.engine.client.output_stream import OutputStream
from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.messages import (
    Abort,
    AddRequest,
    CoreFailed,
    CoreInput,
    CoreMessage,
    CoreReady,
    EngineStats,
    LoRAOp,
    Shutdown,
    core_request_id,
    encoder,
    output_decoder,
)
from pagoda.service.errors import InvalidRequestError
from pagoda.service.model import load_tokenizer
from pagoda.service.outputs import RequestOutput
from pagoda.service.sampling_params import SamplingParams
from pagoda.service.tokenizer import RELEASE_GIL_CHARS, Tokenizer

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 30.0


class EngineDeadError(RuntimeError):
    """The engine core died or failed; the process should be restarted (health turns false)."""


class RequestFailedError(RuntimeError):
    """This request (and only it) failed inside an engine step; the engine goes on serving others."""


@dataclass(frozen=True)
class CoreLink:
    """Where the API processes and the core meet: a folder of ipc sockets, one pair per API process."""

    socket_dir: str
    api_index: int = 0  # 0 starts the core; the others attach to it
    num_api_servers: int = 1

    def inputs(self, api_index: int) -> str:
        return f"ipc://{self.socket_dir}/inputs-{api_index}"

    def outputs(self, api_index: int) -> str:
        return f"ipc://{self.socket_dir}/outputs-{api_index}"


class AsyncEngine:
    def __init__(self, config: EngineConfig, log_level: str = "info", link: CoreLink | None = None) -> None:
        """Loads the tokenizer (blocking); `start()` starts the core (or, `link.api_index` > 0, attaches
        to the core that API process 0 started). No `link`: the only API process, sockets in a fresh
        temporary folder."""
        self.config = config
        self.tokenizer: Tokenizer = load_tokenizer(config.model_path)
        self.model_name = config.model_name
        self.log_level = log_level
        self.max_model_len = 0
        self._input_processor: InputProcessor | None = None
        self._output_processor: OutputProcessor | None = None
        self._stats = EngineStats()
        self._streams: dict[str, OutputStream] = {}
        self._lora_replies: dict[str, asyncio.Future[str | None]] = {}  # LoRAOp id -> its answer
        self._heard_at = time.monotonic()  # the core's last message, or when work began after none
        self._error: str | None = None
        self._ids = itertools.count()
        self._core = CoreSupervisor()  # API process 0's child; never started in the others
        self._owns_socket_dir = link is None
        self.link = link or CoreLink(tempfile.mkdtemp(prefix="pagoda-engine-"))
        self._id_prefix = "" if self.link.num_api_servers == 1 else core_request_id(self.link.api_index, "")
        self._stopping = False
        # Called with (stage, seconds) along the output path: "core_to_api" (the core's send to this
        # process's receive), "api_process" (detokenizing one step's outputs and handing them out),
        # "stream_wait" (an output waiting for its request's handler to take it). Set by the server.
        self.observe_delay: Callable[[str, float], None] | None = None
        self._context = zmq.asyncio.Context()
        self._sync_context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._inputs: zmq.Socket[bytes] = self._sync_context.socket(zmq.PUSH)
        self._outputs: zmq.asyncio.Socket = self._context.socket(zmq.PULL)
        self._encode = encoder().encode
        self._pump: asyncio.Task[None] | None = None

    @property
    def starts_core(self) -> bool:
        return self.link.api_index == 0

    @property
    def is_healthy(self) -> bool:
        return self._pump is not None and self._error is None and not self._core.exited.is_set()

    @property
    def pid(self) -> int | None:
        return self._core.pid

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (from the core; 0 before it started)."""
        return self._input_processor.vocab_size if self._input_processor is not None else 0

    def stats(self) -> EngineStats:
        """As of the core's last step."""
        return self._stats

    def stalled_for(self) -> float:
        """Seconds that this process's requests have waited with no word from the core: 0 while none
        is pending. The core sends every API process a message after every step, so this grows only
        while the core makes no step at all (stopped, deadlocked, a hung GPU or collective)."""
        if not self._streams or self._error is not None:
            return 0.0
        return time.monotonic() - self._heard_at

    async def start(self) -> None:
        """Start the core process and wait until its model is loaded; raise `EngineDeadError` with the
        core's own message when it cannot start. Call from the event loop's thread: the core is tied to
        the life of the thread that started it (PR_SET_PDEATHSIG)."""
        # No high-water marks: admission (--max-waiting-requests) bounds what is in flight, and a send
        # that blocked at a full queue would stall the event loop.
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        link = self.link
        self._inputs.bind(link.inputs(link.api_index))
        self._outputs.bind(link.outputs(link.api_index))
        if self.starts_core:
            self._start_core()
        # An attached process waits for the core's CoreReady; if the core dies first, API process 0
        # kills this one.
        decode = output_decoder().decode
        receive = asyncio.ensure_future(self._outputs.recv())
        exited = asyncio.ensure_future(self._core.exited.wait())
        await asyncio.wait({receive, exited}, return_when=asyncio.FIRST_COMPLETED)
        exited.cancel()
        if not receive.done():
            receive.cancel()
            code = self._core.returncode
            raise EngineDeadError(f"the engine core exited with code {code} while starting")
        message: CoreMessage = decode(receive.result())
        if isinstance(message, CoreFailed):
            raise EngineDeadError(f"the engine core failed to start: {message.message}")
        assert isinstance(message, CoreReady)
        self.max_model_len = message.max_model_len
        self._stats = message.stats
        self._input_processor = InputProcessor(self.tokenizer, message.vocab_size, self.max_model_len)
        self._output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self._pump = asyncio.create_task(self._receive_outputs())

    def _start_core(self) -> None:
        num_api_servers = self.link.num_api_servers
        command = [
            sys.executable,
            "-m",
            "pagoda.service.engine.core_process",
            "--config",
            msgspec.json.encode(self.config).decode(),
            "--eos-token-ids",
            json.dumps(sorted(self.tokenizer.eos_token_ids)),
            "--inputs",
            *[self.link.inputs(i) for i in range(num_api_servers)],
            "--outputs",
            *[self.link.outputs(i) for i in range(num_api_servers)],
            "--parent-pid",
            str(os.getpid()),
            "--log-level",
            self.log_level,
        ]
        self._core.start(command, self._on_exit)

    async def shutdown(self) -> None:
        """Stop the core (it stops its workers) and wait for it; kill it past the timeout. An attached
        process only closes its sockets: the core is API process 0's to stop, after every process drained."""
        self._stopping = True
        if self._core.running and self._pump is None:
            await self._core.kill()  # still loading: nothing to drain
        if self._core.running:
            # Past `_send`'s check: failed by another API process's death, this one's core still runs.
            # Never a blocking send: a core that closed its sockets on its way out leaves the PUSH socket
            # without a peer, where a blocking send waits for ever (it hung `pagoda serve` after a
            # tensor-parallel worker died). Either way the wait below sees the exit.
            self._send_now(Shutdown())
            if not await self._core.wait(_SHUTDOWN_TIMEOUT_S):
                logger.warning("the engine core did not stop in %.0f s: killing it", _SHUTDOWN_TIMEOUT_S)
                await self._core.kill()
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        self._sync_context.destroy(linger=0)
        self._context.destroy(linger=0)
        if self._owns_socket_dir:
            shutil.rmtree(self.link.socket_dir, ignore_errors=True)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Invalid input raises `InvalidRequestError` before any output;
        closing the stream early (client gone, task cancelled) aborts the request."""
        if self._error is not None:
            raise EngineDeadError(self._error)
        if self._input_processor is None or self._output_processor is None:
            raise EngineDeadError("the engine has not started")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        stream = OutputStream()
        if not self._streams:
            self._heard_at = time.monotonic()  # idle until now: silence before this request is no stall
        # The API process's one registry of live requests, from here until the stream is closed: an id
        # is reserved before anything awaits, so a second request of the same id is refused meanwhile.
        self._streams[request_id] = stream
        finished = False
        try:
            if params.grammar is not None or (isinstance(prompt, str) and len(prompt) > RELEASE_GIL_CHARS):
                # Off the event loop (the tokenizer releases the GIL for such texts, llguidance while it
                # validates a grammar): health probes and other requests are answered meanwhile.
                token_ids = await asyncio.to_thread(self._input_processor.process, prompt, params)
            else:
                token_ids = self._input_processor.process(prompt, params)
            now = time.monotonic()
            self._output_processor.add_request(
                request_id, prompt if isinstance(prompt, str) else None, token_ids, params, now
            )
            self._send(AddRequest(self._id_prefix + request_id, token_ids, params, now, lora_name))
            while True:
                item = await stream.get()
                if self.observe_delay is not None:
                    self.observe_delay("stream_wait", stream.waited)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    @property
    def num_requests(self) -> int:
        """Requests of this process from `generate` until their stream closes."""
        return len(self._streams)

    @property
    def request_ids(self) -> list[str]:
        return list(self._streams)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams

    def abort(self, request_id: str) -> None:
        """Stop a request now; its stream, if still open, gets a final output. Idempotent."""
        if self._output_processor is None:
            return
        final = self._output_processor.abort(request_id, time.monotonic())
        if final is None:
            return
        self._send(Abort([self._id_prefix + request_id]))
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(final)

    async def lora_op(self, name: str, path: str | None) -> str | None:
        """Load (`path` given) or unload a LoRA adapter in the core; None when done, else why not."""
        if self._error is not None:
            raise EngineDeadError(self._error)
        op_id = f"lora-{next(self._ids)}"
        reply: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._lora_replies[op_id] = reply
        try:
            self._send(LoRAOp(self._id_prefix + op_id, name, path))
            return await reply
        finally:
            self._lora_replies.pop(op_id, None)

    def _send(self, message: CoreInput) -> None:
        if self._error is None and not self._send_now(message):
            self.fail("the engine core closed its connection")

    def _send_now(self, message: CoreInput) -> bool:
        """Queue `message` for the core without waiting: False when the core has no connection open.
        With no high-water mark a send waits only for a missing peer, which is a core gone or going."""
        try:
            self._inputs.send(self._encode(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    async def _receive_outputs(self) -> None:
        assert self._output_processor is not None
        processor, decode = self._output_processor, output_decoder().decode
        while True:
            message: CoreMessage = decode(await self._outputs.recv())
            self._heard_at = time.monotonic()
            if isinstance(message, CoreFailed):
                self.fail(message.message)
                return
            if isinstance(message, CoreReady):
                continue
            received = time.monotonic()
            self._stats = message.stats
            outputs, stops = processor.process(message.outputs, message.prompt_logprobs, received)
            for request_id, index in stops:
                self._send(Abort([self._id_prefix + request_id], index))
            for failure in message.failures:
                processor.fail(failure.request_id, failure.message, time.monotonic())
                failed = self._streams.get(failure.request_id)
                if failed is not None:
                    kind = InvalidRequestError if failure.invalid else RequestFailedError
                    failed.put_nowait(kind(failure.message))
            for reply in message.lora_replies:
                waiting = self._lora_replies.get(reply.op_id.removeprefix(self._id_prefix))
                if waiting is not None and not waiting.done():
                    waiting.set_result(reply.error)
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put_nowait(output)
            if self.observe_delay is not None and message.outputs:
                self.observe_delay("core_to_api", received - message.sent_at)
                self.observe_delay("api_process", time.monotonic() - received)

    def _on_exit(self) -> None:
        if self._error is None and self._pump is not None and not self._stopping:
            self.fail(f"the engine core exited with code {self._core.returncode}")

    def fail(self, message: str) -> None:
        """Every open stream ends with `EngineDeadError`; new requests are refused."""
        if self._error is None:
            logger.error("engine failed: %s", message)
            self._error = message
        dead = EngineDeadError(f"the engine failed: {self._error}")
        for stream in self._streams.values():
            stream.put_nowait(dead)
        for reply in self._lora_replies.values():
            if not reply.done():
                reply.set_exception(dead)
