"""The engine as an asyncio service: a background thread runs the step loop; each request is an async
stream of `RequestOutput`s. The HTTP and gRPC layers use only this class."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.llm_engine import EngineStats, LLMEngine
from pagoda.service.outputs import RequestOutput
from pagoda.service.sampling_params import SamplingParams
from pagoda.service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop failed; the process should be restarted (readiness turns false)."""


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._streams: dict[str, asyncio.Queue[Any]] = {}
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def start(self) -> None:
        """Start the step thread; call from inside the event loop that will consume the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Invalid input raises `InvalidRequestError` before any output;
        closing the stream early (client gone, task cancelled) aborts the request."""
        if self._error is not None:
            raise EngineDeadError(f"the engine failed: {self._error}")
        request_id = request_id or f"req-{next(self._ids)}"
        token_ids = self.engine.validate(prompt, params)
        stream: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt, params, time.monotonic(), token_ids))
        finished = False
        try:
            while True:
                item = await stream.get()
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

    def abort(self, request_id: str) -> None:
        """Thread-safe and idempotent."""
        self._send(("abort", request_id))

    def _send(self, command: tuple[Any, ...]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # ---- the step thread -----------------------------------------------------------------------

    def _deliver(self, items: list[tuple[str, Any]]) -> None:
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(item)

    def _run(self) -> None:
        assert self._loop is not None
        engine = self.engine
        while not self._stopping.is_set():
            failed: list[tuple[str, Any]] = []  # errors and abort outputs, for their streams
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command[0] == "add":
                    _, request_id, prompt, params, arrival, token_ids = command
                    try:
                        engine.add_request(request_id, prompt, params, arrival, validated_token_ids=token_ids)
                    except Exception as exc:  # reported on that request's stream
                        failed.append((request_id, exc))
                else:
                    final = engine.abort(command[1])
                    if final is not None:
                        failed.append((final.request_id, final))
            if failed:
                self._loop.call_soon_threadsafe(self._deliver, failed)
            if not engine.has_unfinished:
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                logger.exception("engine step failed")
                self._error = exc
                dead = EngineDeadError(f"the engine failed: {exc}")
                self._loop.call_soon_threadsafe(self._deliver, [(rid, dead) for rid in list(self._streams)])
                return
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, [(o.request_id, o) for o in outputs])
