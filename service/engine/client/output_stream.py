"""One request's outputs on their way from the engine to the HTTP or gRPC handler that streams them.

When the handler falls behind (many streams, one event loop), the outputs it has not taken yet are
merged into one: their deltas concatenated, the cumulative fields the newest (the prompt's
log-probabilities the oldest's, which only the first output carries). The handler then sends
one chunk of several tokens instead of several one-token chunks it would send late anyway, so a
loaded server spends its event loop on fewer, larger writes (vLLM V1 does the same). An error
replaces whatever was pending: the stream ends with it.
"""

from __future__ import annotations

import asyncio
import time

from pagoda.service.outputs import CompletionOutput, RequestOutput


class OutputStream:
    def __init__(self) -> None:
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self._pending_since = 0.0
        self.waited = 0.0  # how long the item `get` returned last waited for its handler, in seconds

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        pending = self._pending
        if isinstance(item, RequestOutput) and isinstance(pending, RequestOutput):
            item = merge(pending, item)
        elif isinstance(pending, BaseException):
            return  # the stream already ended with an error
        elif pending is None:
            self._pending_since = time.monotonic()
        self._pending = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self._ready.wait()
        self._ready.clear()
        item, self._pending = self._pending, None
        assert item is not None
        self.waited = time.monotonic() - self._pending_since
        return item


def merge(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`newer` with the deltas of `older` in front (both of one request, `older` not yet consumed)."""
    earlier = {c.index: c for c in older.outputs}
    newer.outputs = [_merge_completion(earlier.get(c.index), c) for c in newer.outputs]
    if newer.prompt_logprobs is None:
        newer.prompt_logprobs = older.prompt_logprobs
    return newer


def _merge_completion(older: CompletionOutput | None, newer: CompletionOutput) -> CompletionOutput:
    if older is None:
        return newer
    newer.text_delta = older.text_delta + newer.text_delta
    newer.token_ids_delta = older.token_ids_delta + newer.token_ids_delta
    if older.logprobs_delta is not None or newer.logprobs_delta is not None:
        newer.logprobs_delta = (older.logprobs_delta or []) + (newer.logprobs_delta or [])
    return newer
