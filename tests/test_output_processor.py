"""The API side's OutputProcessor on its own: a final-only request (what `LLM.generate` makes) has its
output built once, when it finishes, and its text decoded once, with the same text and tokens as the
per-step outputs end with."""

from __future__ import annotations

from pathlib import Path

from pagoda.service.engine.messages import SampleResult, TokenOutput
from pagoda.service.engine.output_processor import OutputProcessor
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
