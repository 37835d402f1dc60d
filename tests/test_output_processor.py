"""The API side's OutputProcessor on its own: a final-only request (what `LLM.generate` makes) has its
output built once, when it finishes, and its text decoded once, with the same text and tokens as the
per-step outputs end with. Per-step outputs carry deltas; only the final one copies everything."""

from __future__ import annotations

from pathlib import Path

from pagoda.service.engine.client.output_processor import OutputProcessor
from pagoda.service.engine.messages import PromptLogprobs, SampleResult, TokenOutput
from pagoda.service.metrics import RequestTracker, ServerMetrics
from pagoda.service.outputs import RequestOutput
from pagoda.service.sampling_params import SamplingParams
from pagoda.service.tokenizer import Tokenizer

TOKENS = {"a": [300, 301, 302, 303], "b": [400, 401]}


def run(tokenizer: Tokenizer, final_only: bool) -> list[list[tuple[str, bool, str, list[int]]]]:
    """Two requests (4 and 2 tokens, `max_tokens` ends them) fed step by step: each step's outputs as
    (request id, finished, text, token ids)."""
    processor = OutputProcessor(tokenizer, max_model_len=64)
    for rid, tokens in TOKENS.items():
        params = SamplingParams(max_tokens=len(tokens))
        processor.add_request(rid, None, [1, 2, 3], params, arrival_time=0.0, final_only=final_only)
    steps = []
    for i in range(4):
        outputs = [
            TokenOutput(rid, 0, SampleResult(tokens[i]), "length" if i == len(tokens) - 1 else None)
            for rid, tokens in TOKENS.items()
            if i < len(tokens)
        ]
        produced, stops = processor.process(outputs, [], now=float(i))
        assert stops == []
        steps.append(
            [(o.request_id, o.finished, o.outputs[0].text, o.outputs[0].token_ids) for o in produced]
        )
    assert processor.requests == {}  # both forgotten once finished
    return steps


def test_final_only_returns_finished_requests_alone_with_everything(tokenizer_files: Path) -> None:
    tokenizer = Tokenizer.from_path(tokenizer_files)
    every = run(tokenizer, final_only=False)
    final = run(tokenizer, final_only=True)
    assert [len(s) for s in every] == [2, 2, 1, 1]
    assert final == [[], [every[1][1]], [], [every[3][0]]]  # b ends at step 2, a at step 4
    assert every[3][0][2] == tokenizer.decode(TOKENS["a"]) and every[3][0][3] == TOKENS["a"]


def test_final_only_aborted_and_stop_string_requests_keep_their_text(tokenizer_files: Path) -> None:
    tokenizer = Tokenizer.from_path(tokenizer_files)
    processor = OutputProcessor(tokenizer, max_model_len=64)
    text = " one two three four"
    ids = tokenizer.encode(text, add_special_tokens=False)
    processor.add_request("aborted", None, [1], SamplingParams(max_tokens=50), 0.0, final_only=True)
    stop = SamplingParams(max_tokens=50, stop=[" three"])
    processor.add_request("stopped", None, [1], stop, 0.0, final_only=True)
    stopped_at = None
    for i, token in enumerate(ids):
        produced, stops = processor.process(
            [TokenOutput("aborted", 0, SampleResult(token)), TokenOutput("stopped", 0, SampleResult(token))],
            [],
            now=float(i),
        )
        if stops:  # the stop string is checked on incremental text even for a final-only request
            assert stops == [("stopped", 0)] and [o.outputs[0].text for o in produced] == [" one two"]
            stopped_at = i
    assert stopped_at is not None and stopped_at < len(ids) - 1
    final = processor.abort("aborted", now=9.0)
    assert final is not None and final.finished and final.outputs[0].text == text


def cumulative(out: RequestOutput) -> list[tuple[object, ...]]:
    return [(c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) for c in out.outputs]


def test_streamed_deltas_add_up_to_the_final_output_and_nothing_is_copied_before(
    tokenizer_files: Path,
) -> None:
    """n=2 with stop strings, logprobs and prompt logprobs: intermediate outputs carry no cumulative
    copy (one per output made a stream of n tokens cost O(n^2)); each completion's deltas add up to
    its final text, tokens and logprobs, which are what a final-only request ends with too."""
    tokenizer = Tokenizer.from_path(tokenizer_files)
    words = [" one two three four five six", " alpha beta gamma"]
    tokens = [tokenizer.encode(text, add_special_tokens=False) for text in words]
    # " three" is held back until " four" completes the stop string " three f"; " gamma" is held back
    # (" gamma!") until completion 1 ends by length, which shows it.
    stop = [" three f", " gamma!"]
    params = SamplingParams(n=2, max_tokens=50, stop=stop, logprobs=1, prompt_logprobs=1)
    scored = [SampleResult(7, -1.5, [(7, -1.5)]), SampleResult(9, -2.5, [(8, -0.5)])]

    def run(final_only: bool) -> list[RequestOutput]:
        processor = OutputProcessor(tokenizer, max_model_len=64)
        processor.add_request("r", None, [1, 7, 9], params, arrival_time=0.0, final_only=final_only)
        produced: list[RequestOutput] = []
        stopped: set[int] = set()
        for step in range(len(tokens[0])):
            outputs = []
            for i, ids in enumerate(tokens):
                if step < len(ids) and i not in stopped:
                    last = step == len(ids) - 1
                    sample = SampleResult(ids[step], -0.1 * step, [(ids[step], -0.1 * step)])
                    outputs.append(TokenOutput("r", i, sample, "length" if last else None))
            prompt = [PromptLogprobs("r", 1, scored)] if step == 0 else []
            out, stops = processor.process(outputs, prompt, now=float(step))
            stopped |= {index for _, index in stops}
            produced += out
        assert processor.requests == {} and stopped == {0}
        return produced

    streamed = run(final_only=False)
    *steps, final = streamed
    assert len(steps) == 3 and final.finished and not any(o.finished for o in steps)
    assert all((c.text, c.token_ids, c.logprobs) == ("", [], None) for o in steps for c in o.outputs)
    # The prompt's logprobs come with the first output (where a stream reads them) and the final one.
    assert [o.prompt_logprobs is not None for o in streamed] == [True, False, False, True]
    assert streamed[0].prompt_logprobs == final.prompt_logprobs
    assert [lp and lp.logprob for lp in final.prompt_logprobs or []] == [None, -1.5, -2.5]

    first, second = final.outputs
    four = tokenizer.encode(" four", add_special_tokens=False)[0]
    assert (first.text, first.finish_reason, first.stop_reason) == (" one two", "stop", " three f")
    assert first.token_ids == tokens[0][: tokens[0].index(four) + 1]
    assert (second.text, second.token_ids, second.finish_reason) == (words[1], tokens[1], "length")
    for c in final.outputs:
        deltas = [o.outputs[c.index] for o in streamed]
        shown = ""
        for d in deltas:  # nothing shown that a stop string cuts later
            shown += d.text_delta
            assert c.text.startswith(shown)
        assert shown == c.text
        assert [t for d in deltas for t in d.token_ids_delta] == c.token_ids
        assert [lp for d in deltas for lp in d.logprobs_delta or []] == c.logprobs
        assert [lp.token_id for lp in c.logprobs or []] == c.token_ids

    (alone,) = run(final_only=True)  # what `LLM.generate` gets
    assert cumulative(alone) == cumulative(final) and alone.prompt_logprobs == final.prompt_logprobs


def test_request_metrics_are_observed_from_the_deltas_as_they_stream(tokenizer_files: Path) -> None:
    """The server's latency metrics count tokens from each output's deltas: time to first token is
    observed with the first output, and one inter-token gap per step whatever n is."""
    processor = OutputProcessor(Tokenizer.from_path(tokenizer_files), max_model_len=64)
    processor.add_request("r", None, [1, 2, 3], SamplingParams(n=2, max_tokens=3), arrival_time=0.0)
    metrics = ServerMetrics(lambda: None, lambda: "m", enable_gpu=False)
    tracker = RequestTracker(metrics)

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(name) or 0.0

    for step, now in enumerate([1.0, 2.0, 4.0]):
        finish = "length" if step == 2 else None
        tokens = [TokenOutput("r", i, SampleResult(300 + step), finish) for i in range(2)]
        (out,), _ = processor.process(tokens, [], now)
        tracker.observe(out)
        if step == 0:
            assert value("pagoda_time_to_first_token_seconds_count") == 1
            assert value("pagoda_time_to_first_token_seconds_sum") == 1.0
    assert value("pagoda_inter_token_latency_seconds_count") == 2
    assert value("pagoda_inter_token_latency_seconds_sum") == 3.0  # 2 - 1, then 4 - 2
    assert (
        metrics.registry.get_sample_value("pagoda_requests_finished_total", {"finish_reason": "length"}) == 1
    )


# --- edges found by mutation testing ------------------------------------------------------------------


def test_held_back_is_the_longest_suffix_that_starts_a_stop_string() -> None:
    from pagoda.service.engine.client.output_processor import held_back

    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["x"]) == 0  # a one-character stop string is never held back
    assert held_back("ab", ["abcdef"]) == 2  # the whole text may be held back
    assert held_back("xab", ["abc", "b!"]) == 2  # the longest of several
    assert held_back("aa", ["aaa"]) == 2  # not the shorter "a" found after it
    assert held_back("sto", ["stop"]) == 3
    assert held_back("xstop", ["stop"]) == 0  # a whole stop string is found, not held back
    assert held_back("abc", []) == 0


def _feed(processor: OutputProcessor, rid: str, ids: list[int], **token: object) -> list[RequestOutput]:
    produced = []
    for i, t in enumerate(ids):
        out, _ = processor.process([TokenOutput(rid, 0, SampleResult(t), **token)], [], now=float(i))  # type: ignore[arg-type]
        produced += out
    return produced


def test_a_stop_string_is_found_at_the_start_and_across_the_shown_text(tokenizer_files: Path) -> None:
    tokenizer = Tokenizer.from_path(tokenizer_files)
    processor = OutputProcessor(tokenizer, max_model_len=64)
    processor.add_request("first", None, [1], SamplingParams(max_tokens=50, stop=["Hello"]), 0.0)
    (final,) = _feed(processor, "first", tokenizer.encode("Hello there", add_special_tokens=False))[:1]
    assert final.finished and final.outputs[0].text == "" and final.outputs[0].stop_reason == "Hello"
    # Nine characters shown, "9" held back, then "abcd" completes "9abc": the search must start before
    # the shown text ends (at 9 - 4), not after it.
    processor.add_request("digits", None, [1], SamplingParams(max_tokens=50, stop=["9abc"]), 0.0)
    ids = tokenizer.encode("0123456789abcd and more", add_special_tokens=False)
    outputs = _feed(processor, "digits", ids)
    assert outputs[-1].finished and outputs[-1].outputs[0].text == "012345678"
    assert "".join(o.outputs[0].text_delta for o in outputs) == "012345678"


def test_include_stop_str_in_output_ends_the_text_after_the_stop_string(tokenizer_files: Path) -> None:
    """vLLM's include_stop_str_in_output: the text runs to the end of the stop string, not its start, and
    the streamed deltas add up to it; the stop string is still where the search found it first."""
    tokenizer = Tokenizer.from_path(tokenizer_files)
    processor = OutputProcessor(tokenizer, max_model_len=64)
    # "3 a" at 3, three long, ends inside the token " and": only + keeps "0123 a" (3 ^ 3, 3 | 3, 3 << 3 ...
    # do not), and the rest of that token is cut.
    params = SamplingParams(max_tokens=50, stop=["d m", "3 a"], include_stop_str_in_output=True)
    processor.add_request("kept", None, [1], params, 0.0)
    outputs = _feed(processor, "kept", tokenizer.encode("0123 and more", add_special_tokens=False))
    final = outputs[-1]
    assert final.finished and final.outputs[0].text == "0123 a" and final.outputs[0].stop_reason == "3 a"
    assert "".join(o.outputs[0].text_delta for o in outputs) == "0123 a"


def test_text_is_shown_as_it_comes_less_what_may_start_a_stop_string(tokenizer_files: Path) -> None:
    tokenizer = Tokenizer.from_path(tokenizer_files)
    processor = OutputProcessor(tokenizer, max_model_len=64)
    processor.add_request("r", None, [1], SamplingParams(max_tokens=50, stop=["world!"]), 0.0)
    ids = tokenizer.encode("hello wor", add_special_tokens=False)
    outputs = _feed(processor, "r", ids)
    assert "".join(o.outputs[0].text_delta for o in outputs) == "hello "  # "wor" is held back


def test_tokens_of_aborted_or_stopped_requests_do_not_stop_the_others(tokenizer_files: Path) -> None:
    tokenizer = Tokenizer.from_path(tokenizer_files)
    processor = OutputProcessor(tokenizer, max_model_len=64)
    processor.add_request("stopped", None, [1], SamplingParams(max_tokens=50, stop=[" two"]), 0.0)
    processor.add_request("live", None, [1], SamplingParams(max_tokens=50), 0.0)
    ids = tokenizer.encode(" one two three", add_special_tokens=False)
    for i, t in enumerate(ids[:2]):
        processor.process([TokenOutput("stopped", 0, SampleResult(t))], [], now=float(i))
    assert "stopped" not in processor.requests  # " two" ended it
    processor.add_request("late", None, [1], SamplingParams(max_tokens=50, stop=["zz"]), 0.0)
    processor.process([TokenOutput("late", 0, SampleResult(ids[0]))], [], now=3.0)
    processor.requests["late"].completions[0].finish_reason = "stop"  # as a stop string leaves it
    step = [
        TokenOutput("gone", 0, SampleResult(ids[0])),  # aborted while the step ran
        TokenOutput("late", 0, SampleResult(ids[1])),  # stopped; the core's abort is on its way
        TokenOutput("live", 0, SampleResult(ids[0])),
    ]
    produced, stops = processor.process(step, [], now=4.0)
    assert [o.request_id for o in produced] == ["live"] and stops == []
    assert produced[0].outputs[0].token_ids_delta == [ids[0]]


def test_abort_and_fail_end_only_the_completions_still_going(tokenizer_files: Path) -> None:
    processor = OutputProcessor(Tokenizer.from_path(tokenizer_files), max_model_len=64)
    assert processor.abort("unknown", 1.0) is None and processor.fail("unknown", "boom", 1.0) is None
    for end in ("abort", "fail"):
        processor.add_request(end, None, [1], SamplingParams(n=2, max_tokens=5), 0.0)
        processor.process([TokenOutput(end, 0, SampleResult(300), "length")], [], now=1.0)
        out = processor.abort(end, 2.0) if end == "abort" else processor.fail(end, "boom", 2.0)
        assert out is not None and out.finished
        assert [c.finish_reason for c in out.outputs] == ["length", "abort" if end == "abort" else "error"]
        assert (out.error == "boom") is (end == "fail")
        assert end not in processor.requests


def test_prompt_logprobs_in_chunks_and_after_a_recompute(tokenizer_files: Path) -> None:
    processor = OutputProcessor(Tokenizer.from_path(tokenizer_files), max_model_len=64)
    processor.add_request("r", None, [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=5, prompt_logprobs=0), 0.0)

    def scores(first: int, count: int) -> list[SampleResult]:
        return [SampleResult(100 + p, -float(p)) for p in range(first, first + count)]

    processor.process([], [PromptLogprobs("r", 1, scores(1, 3))], now=1.0)  # positions 1-3
    processor.process([], [PromptLogprobs("r", 1, scores(1, 5))], now=2.0)  # preempted: 1-5 again
    logprobs = processor.requests["r"].prompt_logprobs
    assert logprobs is not None and logprobs[0] is None
    assert [lp.token_id for lp in logprobs[1:]] == [101, 102, 103, 104, 105]  # each position once
    processor.process([], [PromptLogprobs("r", 1, [SampleResult(7, None)])], now=3.0)
    assert len(logprobs) == 6  # nothing new


def test_logprobs_only_when_asked_and_with_their_top_tokens(tokenizer_files: Path) -> None:
    tokenizer = Tokenizer.from_path(tokenizer_files)
    processor = OutputProcessor(tokenizer, max_model_len=64)
    processor.add_request("plain", None, [1], SamplingParams(max_tokens=1), 0.0)
    processor.add_request("scored", None, [1], SamplingParams(max_tokens=1, logprobs=1), 0.0)
    sample = SampleResult(300, -0.25, [(300, -0.25), (301, -2.0)])
    produced, _ = processor.process(
        [TokenOutput("plain", 0, sample, "length"), TokenOutput("scored", 0, sample, "length")], [], 1.0
    )
    plain, scored = (o.outputs[0] for o in produced)
    assert plain.logprobs is None and plain.logprobs_delta is None
    (lp,) = scored.logprobs or []
    assert (lp.token_id, lp.token, lp.logprob) == (300, tokenizer.id_to_token(300), -0.25)
    assert [(t.token_id, t.logprob) for t in lp.top] == [(300, -0.25), (301, -2.0)]
    assert processor._logprob(SampleResult(5)).logprob == 0.0  # an unscored token reads as 0


def test_a_final_only_output_carries_every_token_as_its_delta(tokenizer_files: Path) -> None:
    processor = OutputProcessor(Tokenizer.from_path(tokenizer_files), max_model_len=64)
    processor.add_request("r", None, [1], SamplingParams(max_tokens=3, logprobs=0), 0.0, final_only=True)
    for i in range(3):
        produced, _ = processor.process(
            [TokenOutput("r", 0, SampleResult(300 + i, -1.0), "length" if i == 2 else None)], [], float(i)
        )
    (out,) = produced
    assert out.outputs[0].token_ids_delta == [300, 301, 302]
    assert [lp.token_id for lp in out.outputs[0].logprobs_delta or []] == [300, 301, 302]


def test_queue_time_is_the_first_sequence_s(tokenizer_files: Path) -> None:
    processor = OutputProcessor(Tokenizer.from_path(tokenizer_files), max_model_len=64)
    processor.add_request("r", None, [1], SamplingParams(n=2, max_tokens=5), 0.0)
    processor.process([TokenOutput("r", 0, SampleResult(300), scheduled_time=0.5)], [], 1.0)
    processor.process([TokenOutput("r", 1, SampleResult(300), scheduled_time=0.7)], [], 2.0)
    processor.process([TokenOutput("r", 0, SampleResult(301))], [], 3.0)
    metrics = processor.requests["r"].metrics
    assert (metrics.scheduled_time, metrics.first_token_time, metrics.last_token_time) == (0.5, 1.0, 3.0)


def test_a_character_split_across_tokens_is_shown_whole(tokenizer_files: Path) -> None:
    """A stop token id (finish_reason "stop", whatever string object carries it) hides the token; a
    character whose bytes span tokens is held until it is whole, never shown as U+FFFD."""
    tokenizer = Tokenizer.from_path(tokenizer_files)
    processor = OutputProcessor(tokenizer, max_model_len=64)
    processor.add_request("r", None, [1], SamplingParams(max_tokens=50), 0.0)
    text = "a 🦜 b"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # the parrot's four bytes take more than one token
    outputs = _feed(processor, "r", ids)
    assert all("\ufffd" not in o.outputs[0].text_delta for o in outputs)
    stop = "".join(["st", "op"])  # not the interned literal: compared by value
    end, _ = processor.process([TokenOutput("r", 0, SampleResult(2), stop, 2)], [], now=99.0)
    assert "".join(o.outputs[0].text_delta for o in [*outputs, *end]) == text
    assert end[0].outputs[0].finish_reason == "stop" and end[0].outputs[0].stop_reason == 2
