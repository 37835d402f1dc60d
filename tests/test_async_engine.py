"""The async engine the HTTP and gRPC layers use: concurrent streams, early close aborts."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from pagoda.service.engine.client.async_engine import AsyncEngine, EngineDeadError
from pagoda.service.engine.config import EngineConfig
from pagoda.service.errors import InvalidRequestError
from pagoda.service.sampling_params import SamplingParams
from pagoda.service.tokenizer import RELEASE_GIL_CHARS


@pytest.mark.parametrize("is_async", [False, True], ids=["in-turn", "async"])
def test_concurrent_streams_cancel_and_errors(llama_ckpt: Path, is_async: bool) -> None:
    """Through the engine-core process; with async scheduling, aborts land while a step is queued."""

    async def main() -> None:
        engine = AsyncEngine(
            EngineConfig(
                model=str(llama_ckpt),
                dtype="float32",
                kv_cache_memory_bytes=8 << 20,
                async_scheduling=is_async,
            )
        )
        await engine.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

            async def collect(i: int) -> list[int]:
                tokens: list[int] = []
                async for out in engine.generate([10 + i, 20 + i, 30 + i], params, request_id=f"r{i}"):
                    tokens += out.outputs[0].token_ids_delta
                return tokens

            results = await asyncio.gather(*(collect(i) for i in range(8)))
            assert all(len(r) == 12 for r in results)

            # A consumer that goes away mid-stream aborts its request and frees its blocks.
            stream = engine.generate(
                [1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True), request_id="gone"
            )
            await stream.__anext__()
            await stream.aclose()
            for _ in range(100):
                stats = engine.stats()
                if stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0:
                    break
                await asyncio.sleep(0.02)
            stats = engine.stats()  # as the core process reported it
            assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0)

            # An abort from outside (the server's drain timeout) ends the stream with a final output.
            outputs = []
            async for out in engine.generate([4, 5, 6], SamplingParams(max_tokens=500), request_id="cut"):
                outputs.append(out)
                if len(outputs) == 2:
                    engine.abort("cut")
            assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"

            with pytest.raises(InvalidRequestError):
                async for _ in engine.generate([1, 2], SamplingParams(temperature=-1)):
                    pass

            # One registry of live requests: an id is taken from the moment `generate` starts, while a
            # long prompt is still tokenized off the event loop, and freed however the request ends.
            first = engine.generate("word " * (RELEASE_GIL_CHARS // 5 + 1), params, request_id="same")
            tokenizing = asyncio.ensure_future(first.__anext__())
            await asyncio.sleep(0)  # the first runs up to its tokenizing thread
            assert engine.has_request("same") and engine.num_requests == 1
            with pytest.raises(InvalidRequestError, match="already in use"):
                await engine.generate([1, 2], params, request_id="same").__anext__()
            with pytest.raises(InvalidRequestError, match="context"):  # longer than the tiny model's
                await tokenizing
            assert not engine.has_request("same") and engine.request_ids == []
            outputs = [out async for out in engine.generate([1, 2], params, request_id="same")]
            assert outputs[-1].finished and engine.num_requests == 0
            assert engine.is_healthy
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_dead_core_fails_open_streams_and_health(llama_ckpt: Path) -> None:
    """The engine core is its own process: killing it ends every open stream with EngineDeadError,
    turns the engine unhealthy and refuses new requests."""

    async def main() -> None:
        engine = AsyncEngine(
            EngineConfig(model=str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20)
        )
        await engine.start()
        try:
            assert engine.pid is not None and engine.pid != os.getpid() and engine.is_healthy
            stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=2000, ignore_eos=True))
            await stream.__anext__()
            os.kill(engine.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="exited with code -9"):
                async for _ in stream:
                    pass
            assert not engine.is_healthy
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate([1, 2], SamplingParams()):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(main())
