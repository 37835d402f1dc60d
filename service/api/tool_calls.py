"""Tool calling, as OpenAI's chat API has it: `tools`, `tool_choice`, assistant `tool_calls` and
`role: "tool"` turns.

How a request's choice becomes output:
- `none`: plain text; the tools are not shown to the template.
- a named function: the output is constrained by a grammar to that function's `parameters` schema, so
  its text *is* the arguments, valid by construction.
- `required`: the output is constrained to a JSON array of `{"name", "parameters"}` objects, one of
  the tools each (vLLM's way: it works whatever format the model was trained on).
- `auto`: the model writes freely; a parser for the model family's format finds the calls: Hermes /
  Qwen2.5 `<tool_call>{...}</tool_call>`, Mistral `[TOOL_CALLS][...]`, Llama 3.x JSON
  (`{"name": ..., "parameters": ...}`, maybe after `<|python_tag|>`). It is chosen from the chat
  template's text, or by `--tool-call-parser`. Output that names a function absent from `tools` stays
  content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from pagoda.service.errors import InvalidRequestError, quoted
from pagoda.service.grammar import Grammar

ChatRole = Literal["system", "developer", "user", "assistant", "tool"]  # the turns a chat may hold
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)
ParserName = Literal["hermes", "mistral", "llama3_json"]
PARSERS: tuple[str, ...] = ("auto", "hermes", "mistral", "llama3_json", "none")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always follow the schema under required / named


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_dict(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


# ---- the plan: what a request's tools and tool_choice mean -------------------------------------------------


@dataclass
class ToolPlan:
    """`mode` is the effective choice; `name` the forced function; `grammar` the constraint, if any;
    `template_tools` what the chat template sees (None: no tools)."""

    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None
    grammar: Grammar | None = None
    template_tools: list[dict[str, Any]] | None = None
    parallel: bool = True

    def tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.template_tools or ()}


def plan_tools(
    tools: list[ToolDefinition] | None, choice: ToolChoice | None, parallel: bool = True
) -> ToolPlan:
    """The plan for a request; `InvalidRequestError` naming `tools` or `tool_choice` when they disagree."""
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice is only allowed when tools are given", "tool_choice")
        return ToolPlan("none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools must have distinct function names", "tools")
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    if choice is None or choice == "auto":
        return ToolPlan("auto", template_tools=template_tools, parallel=parallel)
    if choice == "none":
        return ToolPlan("none")
    if choice == "required":
        variants = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan(
            "required", grammar=Grammar.json_schema(schema, "tool_choice"), template_tools=template_tools
        )
    assert isinstance(choice, NamedToolChoice)
    chosen = next((t for t in tools if t.function.name == choice.function.name), None)
    if chosen is None:
        raise InvalidRequestError(
            f"tool_choice names {quoted(choice.function.name)}, not among the tools {quoted(names, 200)}",
            "tool_choice",
        )
    return ToolPlan(
        "named",
        name=chosen.function.name,
        grammar=Grammar.json_schema(_parameters(chosen), "tool_choice"),
        template_tools=template_tools,
    )


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


# ---- the conversation as the template sees it --------------------------------------------------------------


def template_messages(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """Assistant `tool_calls` with their arguments as objects (what tool-aware templates iterate over).
    A template that knows nothing of tool calls gets them as Hermes-style text in the turn's content,
    so the model still sees what it called; every content is a string (None breaks plain templates)."""
    knows_tools = "tool_calls" in template
    out = []
    for message in messages:
        message = {**message, "content": message.get("content") or ""}
        calls = message.get("tool_calls")
        if calls:
            rendered = [
                {**c, "function": {**c["function"], "arguments": _json_or_text(c["function"]["arguments"])}}
                for c in calls
            ]
            if knows_tools:
                message["tool_calls"] = rendered
            else:
                del message["tool_calls"]
                calls_json = [
                    json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                    for c in rendered
                ]
                text = "".join(f"<tool_call>\n{call}\n</tool_call>" for call in calls_json)
                message["content"] = (message["content"] + "\n" + text).strip()
        out.append(message)
    return out


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return arguments


def parser_for(template: str, override: str = "auto") -> ParserName | None:
    """The tool-call format of a model, from its chat template (or the `--tool-call-parser` override)."""
    if override == "none":
        return None
    if override != "auto":
        return override  # type: ignore[return-value]
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"  # Hermes, Qwen2.5 and SmolLM3 write <tool_call>; harmless for a model that never does


# ---- parsing output ----------------------------------------------------------------------------------------

MARKERS: dict[str, str] = {
    "hermes": "<tool_call>",
    "mistral": "[TOOL_CALLS]",
    "llama3_json": "<|python_tag|>",
}
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_calls(
    text: str, plan: ToolPlan, parser: ParserName | None
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a finished completion. Text that does not parse stays content."""
    if plan.mode == "named":
        assert plan.name is not None
        return None, [call_dict(plan.name, text)]
    if plan.mode == "required":
        items = _loads(text)
        try:
            calls = [call_dict(i["name"], json.dumps(i["parameters"])) for i in items]
        except (KeyError, TypeError):
            return text, []
        return (None, calls) if isinstance(items, list) and calls else (text, [])
    if plan.mode == "none" or parser is None:
        return text, []
    calls = _parse_free(text, parser)
    if not calls or any(c["function"]["name"] not in plan.tool_names() for c in calls):
        # A call of a function the request never offered is the model's text, not a call: an agent
        # SDK handed it would fail looking the function up (vLLM passes such calls through).
        return text, []
    if not plan.parallel:
        calls = calls[:1]
    content = text.split(MARKERS[parser])[0].strip() if MARKERS[parser] in text else ""
    return content or None, calls


def _parse_free(text: str, parser: ParserName) -> list[dict[str, Any]]:
    found: list[Any] = []
    if parser == "hermes":
        for match in _HERMES_CALL.finditer(text):
            found.append(_loads(match.group(1)))
    elif parser == "mistral" and "[TOOL_CALLS]" in text:
        body = text.split("[TOOL_CALLS]", 1)[1].strip()
        parsed = _loads(body)
        found.extend(parsed if isinstance(parsed, list) else [parsed])
    elif parser == "llama3_json":
        body = text.split("<|python_tag|>", 1)[-1].strip()
        if body.startswith("{"):
            found.extend(_loads(part) for part in body.split(";"))
    calls = []
    for item in found:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            continue
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append(
            call_dict(item["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))
        )
    return calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


# ---- streaming ---------------------------------------------------------------------------------------------


@dataclass
class ToolCallStream:
    """Turns one completion's text deltas into OpenAI chat deltas under a plan.

    Named: the arguments stream as they are written. Required: the calls come once the array is
    complete. Auto: text streams as content until a call marker appears (a possible start of one is
    held back); the rest is parsed at the end."""

    plan: ToolPlan
    parser: ParserName | None
    text: str = ""
    emitted: int = 0  # characters of `text` sent as content
    in_call: bool = False
    call_id: str = field(default_factory=new_call_id)
    made_calls: bool = False

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        mode = self.plan.mode
        if mode == "named":
            first = not self.made_calls
            self.made_calls = True
            call: dict[str, Any] = {"index": 0, "function": {"arguments": delta}}
            if first:
                call = {
                    "index": 0,
                    "id": self.call_id,
                    "type": "function",
                    "function": {"name": self.plan.name, "arguments": delta},
                }
            return [{"tool_calls": [call]}] if first or delta else []
        if mode == "required" or self.in_call:
            return []
        if mode == "none" or self.parser is None:
            return self._content_until(len(self.text))
        marker = MARKERS[self.parser]
        start = self.text.find(marker, self.emitted)
        if start == -1 and self.parser == "llama3_json" and not self.text[: self.emitted].strip():
            stripped = self.text.lstrip()
            if stripped.startswith("{"):  # Llama 3 writes a bare JSON call as its whole answer
                start = len(self.text) - len(stripped)
        if start != -1:
            self.in_call = True
            return self._content_until(start)
        return self._content_until(len(self.text) - _partial_marker(self.text, marker))

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas, and whether the completion ended in tool calls."""
        if self.plan.mode == "named":
            return [], True
        _, calls = parse_calls(self.text, self.plan, self.parser)
        deltas: list[dict[str, Any]] = []
        if calls:
            for i, c in enumerate(calls):
                deltas.append({"tool_calls": [{"index": i, **c}]})
            return deltas, True
        rest = self.text[self.emitted :]
        return ([{"content": rest}] if rest else []), False

    def _content_until(self, end: int) -> list[dict[str, Any]]:
        piece = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return [{"content": piece}] if piece else []


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
