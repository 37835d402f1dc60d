"""The response bodies' wire shape: which keys OpenAI leaves out and which it sends as null. The
served shapes are checked by the real `openai` client in test_serve_http and the tools tests."""

from __future__ import annotations

import json

from msgspec import UNSET

from pagoda.service.api.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatMessage,
    Chunk,
    PromptTokensDetails,
    Tokens,
    Usage,
    encode,
)

USAGE = Usage(3, 2, 5, PromptTokensDetails(1))


def test_a_message_without_tool_calls_has_no_tool_calls_key_and_one_with_calls_has_them() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    plain = ChatChoice(0, ChatMessage("assistant", "hi"), None, "stop", None)
    calling = ChatChoice(1, ChatMessage("assistant", None, [call]), None, "tool_calls", None)
    body = json.loads(encode(ChatCompletion("chatcmpl-1", 7, "m", [plain, calling], USAGE)))
    assert body["object"] == "chat.completion" and body["system_fingerprint"] is None
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert body["choices"][1]["message"]["tool_calls"] == [call]
    assert body["choices"][1]["message"]["content"] is None
    assert body["choices"][0]["logprobs"] is None and body["choices"][0]["stop_reason"] is None
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def test_a_chunk_has_usage_only_when_asked_null_on_choice_chunks_and_set_on_the_last() -> None:
    choice = ChatChunkChoice(0, {"content": "x"}, None, None)
    unasked = json.loads(encode(Chunk("c", "chat.completion.chunk", 1, "m", [choice])))
    assert "usage" not in unasked and unasked["choices"][0]["delta"] == {"content": "x"}
    asked = json.loads(encode(Chunk("c", "chat.completion.chunk", 1, "m", [choice], None)))
    assert "usage" in asked and asked["usage"] is None
    last = json.loads(encode(Chunk("c", "chat.completion.chunk", 1, "m", [], USAGE)))
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 5


def test_token_strings_are_sent_only_when_asked() -> None:
    assert "token_strs" not in json.loads(encode(Tokens(2, 64, [1, 2])))
    asked = Tokens(2, 64, [1, 2], ["a", "b"])
    assert json.loads(encode(asked))["token_strs"] == ["a", "b"] and asked.token_strs is not UNSET
