"""Outputs a slow consumer has not taken yet are merged: deltas concatenated, the newest cumulative
fields kept, nothing lost; an error ends the stream."""

from __future__ import annotations

import asyncio

import pytest

from pagoda.service.engine.client.output_stream import OutputStream
from pagoda.service.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def step(tokens: list[int], new: list[int], finished: bool = False) -> RequestOutput:
    text = "".join(chr(96 + t) for t in tokens)
    completion = CompletionOutput(
        index=0,
        text=text,
        token_ids=list(tokens),
        text_delta="".join(chr(96 + t) for t in new),
        token_ids_delta=list(new),
        logprobs_delta=[Logprob(t, chr(96 + t), -0.5) for t in new],
        finish_reason="length" if finished else None,
    )
    return RequestOutput("r", [1, 2], [completion], finished, RequestMetrics(arrival_time=0.0))


def test_pending_outputs_merge_and_nothing_is_lost() -> None:
    async def scenario() -> list[RequestOutput]:
        stream = OutputStream()
        stream.put_nowait(step([1], [1]))
        first = await stream.get()
        for n in range(2, 6):  # the consumer is busy: four steps arrive
            stream.put_nowait(step(list(range(1, n + 1)), [n], finished=n == 5))
        second = await stream.get()
        return [first, second]  # type: ignore[list-item]

    first, second = asyncio.run(scenario())
    (c,) = second.outputs
    assert first.outputs[0].token_ids_delta == [1]
    assert c.token_ids_delta == [2, 3, 4, 5] and c.text_delta == "bcde" and c.text == "abcde"
    assert [lp.token_id for lp in c.logprobs_delta or []] == [2, 3, 4, 5]
    assert second.finished and c.finish_reason == "length"


def test_an_error_ends_the_stream_whatever_comes_after() -> None:
    async def scenario() -> object:
        stream = OutputStream()
        stream.put_nowait(step([1], [1]))
        stream.put_nowait(RuntimeError("engine failed"))
        stream.put_nowait(step([1, 2], [2]))
        return await stream.get()

    with pytest.raises(RuntimeError, match="engine failed"):
        raise asyncio.run(scenario())  # type: ignore[misc]


def test_waited_is_from_the_oldest_pending_output() -> None:
    """A merged item waited since the first of its parts arrived, not the last."""

    async def scenario() -> tuple[float, float]:
        stream = OutputStream()
        stream.put_nowait(step([1], [1]))
        await asyncio.sleep(0.05)
        stream.put_nowait(step([1, 2], [2]))
        await stream.get()
        first = stream.waited
        stream.put_nowait(step([1, 2, 3], [3]))
        await stream.get()
        return first, stream.waited

    merged, prompt = asyncio.run(scenario())
    assert merged >= 0.05 and prompt < 0.05


def test_the_prompt_logprobs_of_the_first_output_survive_a_merge() -> None:
    """Only a request's first output (and its final one) carries the prompt's log-probabilities: a
    merge of the first with later ones keeps them for the handler, which reads them there."""
    scored = [None, Logprob(2, "b", -1.0)]
    first, later = step([1], [1]), step([1, 2], [2])
    first.prompt_logprobs = scored

    async def scenario() -> RequestOutput:
        stream = OutputStream()
        stream.put_nowait(first)
        stream.put_nowait(later)
        return await stream.get()  # type: ignore[return-value]

    merged = asyncio.run(scenario())
    assert merged.prompt_logprobs == scored and merged.outputs[0].token_ids_delta == [1, 2]
