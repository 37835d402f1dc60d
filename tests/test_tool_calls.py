"""Tool calling without a server: what `tools` and `tool_choice` mean (`plan_tools`), what the chat
template is shown, and how each model family's output becomes calls, whole and streamed.

The server-side half (grammars forcing the calls, the official clients) is in
`tests/test_serve_openai_tools.py`; this file is what `make mutation` runs against `tool_calls.py`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pagoda.service.api.tool_calls import (
    MARKERS,
    NamedFunction,
    NamedToolChoice,
    ParserName,
    ToolCallStream,
    ToolDefinition,
    ToolPlan,
    _partial_marker,
    parse_calls,
    parser_for,
    plan_tools,
    template_messages,
)
from pagoda.service.errors import InvalidRequestError

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
WEATHER = ToolDefinition.model_validate(
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
)
CLOCK = ToolDefinition.model_validate({"function": {"name": "get_time", "description": "The time."}})
TOOLS = [WEATHER, CLOCK]
AUTO = ToolPlan("auto", template_tools=[t.model_dump(exclude_none=True) for t in TOOLS])
PARIS = {"name": "get_weather", "arguments": {"city": "Paris"}}


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice(function=NamedFunction(name=name))


def calls_of(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ---- plan_tools -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", [None, "none"])
def test_no_tools_plan_plain_text(choice: Any) -> None:
    for tools in (None, []):
        plan = plan_tools(tools, choice)
        assert (plan.mode, plan.grammar, plan.template_tools) == ("none", None, None)


@pytest.mark.parametrize("choice", ["auto", "required", named("get_weather")])
def test_a_choice_without_tools_is_refused(choice: Any) -> None:
    with pytest.raises(InvalidRequestError, match="only allowed when tools are given") as err:
        plan_tools(None, choice)
    assert err.value.param == "tool_choice"


def test_tools_with_one_name_twice_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="distinct") as err:
        plan_tools([WEATHER, CLOCK, WEATHER], "auto")
    assert err.value.param == "tools"


@pytest.mark.parametrize(("choice", "parallel"), [(None, True), ("auto", False)])
def test_auto_shows_the_tools_to_the_template(choice: Any, parallel: bool) -> None:
    plan = plan_tools(TOOLS, choice, parallel)
    assert (plan.mode, plan.grammar, plan.name, plan.parallel) == ("auto", None, None, parallel)
    assert plan.template_tools == [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
        {"type": "function", "function": {"name": "get_time", "description": "The time."}},
    ]  # what was not given is absent, not None (templates test `is defined`)
    assert plan.tool_names() == {"get_weather", "get_time"}
    assert plan_tools(TOOLS, "auto").parallel  # OpenAI's default: parallel calls allowed


def test_none_with_tools_hides_them() -> None:
    plan = plan_tools(TOOLS, "none")
    assert (plan.mode, plan.grammar, plan.template_tools) == ("none", None, None)
    assert plan.tool_names() == set()


@pytest.mark.parametrize("parallel", [True, False])
def test_required_constrains_to_an_array_of_the_tools(parallel: bool) -> None:
    plan = plan_tools(TOOLS, "required", parallel)
    assert plan.mode == "required" and plan.template_tools == AUTO.template_tools
    assert plan.grammar is not None
    assert (plan.grammar.kind, plan.grammar.param) == ("json_schema", "tool_choice")
    variant = {
        "type": "object",
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }
    expected: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    **variant,
                    "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER_PARAMS},
                },
                {
                    **variant,  # a tool without parameters takes an empty object
                    "properties": {
                        "name": {"const": "get_time"},
                        "parameters": {"type": "object", "properties": {}},
                    },
                },
            ]
        },
    }
    if not parallel:
        expected["maxItems"] = 1
    assert json.loads(plan.grammar.source) == expected


def test_a_named_function_constrains_to_its_parameters() -> None:
    plan = plan_tools(TOOLS, named("get_weather"))
    assert (plan.mode, plan.name, plan.template_tools) == ("named", "get_weather", AUTO.template_tools)
    assert plan.grammar is not None and plan.grammar.param == "tool_choice"
    assert json.loads(plan.grammar.source) == WEATHER_PARAMS
    plan = plan_tools(TOOLS, named("get_time"))
    assert plan.grammar is not None and plan.name == "get_time"
    assert json.loads(plan.grammar.source) == {"type": "object", "properties": {}}
    plan = plan_tools([CLOCK, WEATHER], named("get_weather"))  # found by name, not by order
    assert plan.grammar is not None and json.loads(plan.grammar.source) == WEATHER_PARAMS


def test_a_named_function_not_among_the_tools_is_refused() -> None:
    with pytest.raises(InvalidRequestError) as err:
        plan_tools(TOOLS, named("get_news"))
    assert err.value.param == "tool_choice"
    assert "'get_news'" in str(err.value) and "['get_weather', 'get_time']" in str(err.value)


# ---- template_messages and parser_for --------------------------------------------------------------------

CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        },
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}},
    ],
}


def test_a_template_that_knows_tool_calls_gets_their_arguments_as_objects() -> None:
    messages = [{"role": "user", "content": "Hi"}, CALLED]
    out = template_messages(messages, "{% for c in message.tool_calls %}...{% endfor %}")
    assert out[0] == {"role": "user", "content": "Hi"}
    assert out[1]["content"] == ""  # None breaks templates that concatenate
    assert [c["function"]["arguments"] for c in out[1]["tool_calls"]] == [{"city": "Oslo"}, "not json"]
    assert [c["id"] for c in out[1]["tool_calls"]] == ["call_1", "call_2"]
    assert CALLED["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # type: ignore[index]
    assert CALLED["content"] is None  # the request's own messages are left as they were


def test_a_template_that_knows_nothing_of_tools_gets_them_as_text() -> None:
    out = template_messages([{**CALLED, "content": "Looking."}], "{{ message.content }}")
    assert "tool_calls" not in out[0]
    assert out[0]["content"] == (
        'Looking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        '<tool_call>\n{"name": "get_time", "arguments": "not json"}\n</tool_call>'
    )
    assert "tool_calls" in CALLED
    bare = template_messages([CALLED], "{{ message.content }}")[0]["content"]
    assert bare.startswith("<tool_call>") and bare.endswith("</tool_call>")  # no stray newline


@pytest.mark.parametrize(
    ("template", "override", "parser"),
    [
        ("{{ '[TOOL_CALLS]' }} ipython", "auto", "mistral"),
        ("<|python_tag|>", "auto", "llama3_json"),
        ("{% if role == 'ipython' %}", "auto", "llama3_json"),
        ("<tool_call>", "auto", "hermes"),
        ("plain", "auto", "hermes"),
        ("[TOOL_CALLS]", "hermes", "hermes"),
        ("<tool_call>", "llama3_json", "llama3_json"),
        ("[TOOL_CALLS]", "none", None),
    ],
)
def test_parser_for(template: str, override: str, parser: str | None) -> None:
    assert parser_for(template, override) == parser


# ---- parse_calls ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parser", "text", "content", "found"),
    [
        ("hermes", f"Let me check.<tool_call>\n{json.dumps(PARIS)}\n</tool_call>", "Let me check.", [PARIS]),
        (
            "hermes",  # two calls, the last unclosed (cut by max_tokens), arguments given as text
            f"<tool_call>{json.dumps(PARIS)}</tool_call>\n<tool_call>"
            + json.dumps({"name": "get_time", "arguments": "{}"}),
            None,
            [PARIS, {"name": "get_time", "arguments": {}}],
        ),
        (
            "hermes",  # what does not parse, or has no name, is skipped
            f'<tool_call>{{oops</tool_call><tool_call>{{"name": 3}}</tool_call><tool_call>[1]</tool_call>'
            f"<tool_call>{json.dumps(PARIS)}</tool_call>",
            None,
            [PARIS],
        ),
        (
            "mistral",
            f"[TOOL_CALLS]{json.dumps([PARIS, {'name': 'get_time'}])}",
            None,
            [PARIS, {"name": "get_time", "arguments": {}}],
        ),
        ("mistral", f"Sure. [TOOL_CALLS] {json.dumps(PARIS)}", "Sure.", [PARIS]),
        ("llama3_json", json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}}), None, [PARIS]),
        (
            "llama3_json",
            "<|python_tag|>"
            + json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}})
            + "; "
            + json.dumps({"name": "get_time", "parameters": {}}),
            None,
            [PARIS, {"name": "get_time", "arguments": {}}],
        ),
    ],
)
def test_auto_finds_each_familys_calls(
    parser: ParserName, text: str, content: str | None, found: list[Any]
) -> None:
    got_content, calls = parse_calls(text, AUTO, parser)
    assert got_content == content
    assert calls_of(calls) == [(f["name"], f["arguments"]) for f in found]
    assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", "No tools needed: it is sunny."),
        ("hermes", "<tool_call>{not json}</tool_call>"),
        ("hermes", '[TOOL_CALLS][{"name": "get_weather", "arguments": {}}]'),  # another family's format
        ("mistral", "[TOOL_CALLS] not json"),
        ("mistral", '{"name": "get_weather", "arguments": {}}'),  # no marker
        ("llama3_json", "The answer is {42}."),
        ("llama3_json", '<|python_tag|>print("hi")'),
        # a function the request did not offer: text, not a call, even beside a real one
        ("hermes", '<tool_call>{"name": "get_news", "arguments": {}}</tool_call>'),
        ("hermes", f'<tool_call>{json.dumps(PARIS)}</tool_call><tool_call>{{"name": "rm_rf"}}</tool_call>'),
        ("mistral", '[TOOL_CALLS][{"name": "get_news", "arguments": {}}]'),
        ("llama3_json", '{"name": "get_news", "parameters": {}}'),
    ],
)
def test_auto_keeps_what_is_not_a_call_as_content(parser: ParserName, text: str) -> None:
    assert parse_calls(text, AUTO, parser) == (text, [])


def test_auto_without_a_parser_or_under_none_is_content() -> None:
    text = f"<tool_call>{json.dumps(PARIS)}</tool_call>"
    assert parse_calls(text, AUTO, None) == (text, [])
    assert parse_calls(text, ToolPlan("none"), "hermes") == (text, [])


def test_auto_without_parallel_calls_keeps_the_first() -> None:
    plan = ToolPlan("auto", template_tools=AUTO.template_tools, parallel=False)
    text = (
        f"<tool_call>{json.dumps(PARIS)}</tool_call><tool_call>{json.dumps({'name': 'get_time'})}</tool_call>"
    )
    assert calls_of(parse_calls(text, plan, "hermes")[1]) == [("get_weather", {"city": "Paris"})]
    assert len(parse_calls(text, AUTO, "hermes")[1]) == 2


def test_named_output_is_the_arguments() -> None:
    plan = plan_tools(TOOLS, named("get_weather"))
    content, calls = parse_calls('{"city": "Rome"}', plan, "hermes")
    assert content is None and calls_of(calls) == [("get_weather", {"city": "Rome"})]
    assert calls[0]["function"]["arguments"] == '{"city": "Rome"}'  # as written, not re-encoded


def test_required_output_is_an_array_of_calls() -> None:
    plan = plan_tools(TOOLS, "required")
    text = json.dumps(
        [{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Paris"}}]
    )
    content, calls = parse_calls(text, plan, None)
    assert content is None
    assert calls_of(calls) == [("get_time", {}), ("get_weather", {"city": "Paris"})]
    for bad in (
        '[{"name": "get_time"}]',
        "[1]",
        "[{",
        "{}",
        "[]",
        '{"name": "get_time", "parameters": {}}',
    ):  # cut short or malformed: stays text
        assert parse_calls(bad, plan, None) == (bad, [])


# ---- streaming ---------------------------------------------------------------------------------------------


def stream_all(
    stream: ToolCallStream, text: str, step: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool]:
    deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i : i + step])]
    tail, made_calls = stream.finish()
    return deltas, tail, made_calls


def content_of(deltas: list[dict[str, Any]]) -> str:
    return "".join(d.get("content", "") for d in deltas)


@pytest.mark.parametrize("step", [1, 3, 100])
@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [
        ("hermes", f"Let me check. <tool_call>\n{json.dumps(PARIS)}\n</tool_call>", "Let me check. "),
        ("mistral", f"[TOOL_CALLS]{json.dumps([PARIS])}", ""),
        ("llama3_json", json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}}), ""),
        (
            "llama3_json",
            "<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}}),
            "",
        ),
    ],
)
def test_auto_streams_content_then_the_calls(parser: ParserName, text: str, content: str, step: int) -> None:
    stream = ToolCallStream(AUTO, parser)
    deltas, tail, made_calls = stream_all(stream, text, step)
    assert made_calls and content_of(deltas + tail) == content
    assert all(MARKERS[parser][:2] not in d.get("content", "") for d in deltas)
    calls = [d["tool_calls"] for d in tail]
    assert all(len(c) == 1 for c in calls) and [c[0]["index"] for c in calls] == [0]
    assert calls_of([{k: v for k, v in c[0].items() if k != "index"} for c in calls]) == [
        ("get_weather", {"city": "Paris"})
    ]


def test_a_possible_marker_is_held_back_until_it_is_not_one() -> None:
    stream = ToolCallStream(AUTO, "hermes")
    assert stream.feed("a <tool") == [{"content": "a "}]
    assert stream.feed("") == []
    assert stream.feed("box> b") == [{"content": "<toolbox> b"}]
    assert stream.feed("<") == []
    assert stream.finish() == ([{"content": "<"}], False)


def test_llama3_whitespace_before_a_bare_call_is_content() -> None:
    stream = ToolCallStream(AUTO, "llama3_json")
    call = json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}})
    assert stream.feed("\n\n" + call) == [{"content": "\n\n"}]
    assert stream.feed(" ") == []  # inside the call from here on
    tail, made_calls = stream.finish()
    assert made_calls and [d["tool_calls"][0]["function"]["name"] for d in tail] == ["get_weather"]


def test_text_after_a_call_that_does_not_parse_comes_at_the_end() -> None:
    stream = ToolCallStream(AUTO, "hermes")
    deltas, tail, made_calls = stream_all(stream, "Hm <tool_call>{broken", 2)
    assert not made_calls and content_of(deltas) == "Hm " and tail == [{"content": "<tool_call>{broken"}]


@pytest.mark.parametrize("text", ["It is sunny <b>today</b>, a < b.", "{not a call", "[TOOL_CALLS] in prose"])
def test_plain_text_streams_as_it_comes(text: str) -> None:
    stream = ToolCallStream(AUTO, "hermes")
    deltas, tail, made_calls = stream_all(stream, text, 1)
    assert not made_calls and content_of(deltas + tail) == text
    assert deltas[0] == {"content": text[0]}  # streamed as it comes, not saved for the end


@pytest.mark.parametrize(("plan", "parser"), [(ToolPlan("none"), "hermes"), (AUTO, None)])
def test_no_parsing_streams_every_delta(plan: ToolPlan, parser: ParserName | None) -> None:
    stream = ToolCallStream(plan, parser)
    text = f"<tool_call>{json.dumps(PARIS)}</tool_call>"
    assert stream.feed(text[:5]) == [{"content": text[:5]}]
    assert stream.feed("") == []
    assert stream.feed(text[5:]) == [{"content": text[5:]}]
    assert stream.finish() == ([], False)


def test_named_streams_the_arguments_as_written() -> None:
    stream = ToolCallStream(plan_tools(TOOLS, named("get_weather")), "hermes")
    first = stream.feed('{"ci')
    assert first == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": stream.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"ci'},
                }
            ]
        }
    ]
    assert stream.call_id.startswith("call_")
    assert stream.feed("") == []
    assert stream.feed('ty": "Rome"}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}]}
    ]
    assert stream.finish() == ([], True)


def test_named_sends_the_name_even_when_the_first_delta_is_empty() -> None:
    stream = ToolCallStream(plan_tools(TOOLS, named("get_time")), None)
    (delta,) = stream.feed("")
    assert delta["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}


def test_required_sends_the_calls_once_complete() -> None:
    stream = ToolCallStream(plan_tools(TOOLS, "required"), "hermes")
    text = json.dumps(
        [{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Paris"}}]
    )
    deltas, tail, made_calls = stream_all(stream, text, 4)
    assert deltas == [] and made_calls
    assert [d["tool_calls"][0]["index"] for d in tail] == [0, 1]
    stream = ToolCallStream(plan_tools(TOOLS, "required"), "hermes")
    assert stream_all(stream, "[{", 1) == ([], [{"content": "[{"}], False)


@pytest.mark.parametrize(
    ("text", "marker", "held"),
    [
        ("abc<tool", "<tool_call>", 5),
        ("abc<", "<tool_call>", 1),
        ("abc", "<tool_call>", 0),
        ("<tool_call", "<tool_call>", 10),
        ("", "<x>", 0),
        ("a[TOOL_CALLS", "[TOOL_CALLS]", 11),
        ("<<", "<tool_call>", 1),
        ("x<tool_call>", "<tool_call>", 0),
    ],
)
def test_partial_marker(text: str, marker: str, held: int) -> None:
    assert _partial_marker(text, marker) == held
