"""The API side's OutputProcessor on its own: a final-only request (what `LLM.generate` makes) has its
output built once, when it finishes, and its text decoded once, with the same text and tokens as the
per-step outputs end with. Per-step outputs carry deltas; only the final one copies everything."""

from __future__ import annotations

from pathlib import Path

from pagoda.service.engine.messages import PromptLogprobs, SampleResult, TokenOutput
from pagoda.service.engine.output_processor import OutputProcessor
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
