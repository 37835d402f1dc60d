"""The OpenAI request fields of structured output and `logit_bias`, shared by chat and text completions.

- OpenAI: `response_format` `{"type": "json_object"}` and `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}` (`"text"` is the default: no constraint); `logit_bias`.
- vLLM's extras, for users who know them: `guided_json` (a schema, as an object or JSON text),
  `guided_regex`, `guided_choice`, `guided_grammar` (Lark or GBNF), and the object that replaced them
  in vLLM 0.10.2, `structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object"}`.

At most one of them constrains a request; a second is a 400 naming it. Each becomes a
`pagoda.service.grammar.Grammar` that remembers its parameter, so a schema that cannot compile is a
400 naming it too (checked at admission, `InputProcessor`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagoda.service.errors import InvalidRequestError
from pagoda.service.grammar import Grammar, parse_logit_bias


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` object: the same constraints under one name."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key would silently constrain nothing

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def grammars(self) -> list[Grammar]:
        param = "structured_outputs"
        found = []
        if self.json_ is not None:
            found.append(Grammar.json_schema(_schema(self.json_, param), param))
        if self.regex is not None:
            found.append(Grammar.regex(self.regex, param))
        if self.choice is not None:
            found.append(Grammar.choice(self.choice, param))
        if self.grammar is not None:
            found.append(Grammar.lark(self.grammar, param))
        if self.json_object:
            found.append(Grammar.json_object(param))
        return found


class StructuredOutputFields(BaseModel):
    """Mixed into the chat and completion request models."""

    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def grammar(self) -> Grammar | None:
        """The one grammar the request asks for, or None."""
        found: list[Grammar] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(Grammar.json_object("response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise InvalidRequestError(
                    "response_format of type json_schema needs json_schema.schema", "response_format"
                )
            found.append(Grammar.json_schema(fmt.json_schema.json_schema, "response_format"))
        if self.guided_json is not None:
            found.append(Grammar.json_schema(_schema(self.guided_json, "guided_json"), "guided_json"))
        if self.guided_regex is not None:
            found.append(Grammar.regex(self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            found.append(Grammar.choice(self.guided_choice, "guided_choice"))
        if self.guided_grammar is not None:
            found.append(Grammar.lark(self.guided_grammar, "guided_grammar"))
        if self.structured_outputs is not None:
            found += self.structured_outputs.grammars()
        if len(found) > 1:
            names = ", ".join(g.param for g in found)
            raise InvalidRequestError(f"only one of {names} may be given", found[1].param)
        return found[0] if found else None

    def token_bias(self) -> dict[int, float] | None:
        return parse_logit_bias(self.logit_bias)


def _schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{param}: the schema is not valid JSON: {exc}", param) from exc
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param}: the schema must be a JSON object", param)
    return schema


def grammar_from_proto(msg: Any) -> Grammar | None:
    """The `structured_output` oneof of a gRPC `SamplingParameters`; errors name the proto field."""
    kind = msg.WhichOneof("structured_output")
    if kind == "json_schema":
        try:
            schema = json.loads(msg.json_schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"json_schema is not valid JSON: {exc}", "json_schema") from exc
        return Grammar.json_schema(schema, "json_schema")
    if kind == "json_object":
        return Grammar.json_object("json_object") if msg.json_object else None
    if kind == "regex":
        return Grammar.regex(msg.regex, "regex")
    if kind == "choice":
        return Grammar.choice(list(msg.choice.choices), "choice")
    if kind == "grammar":
        return Grammar.lark(msg.grammar, "grammar")
    return None
