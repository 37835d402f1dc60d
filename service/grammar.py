"""Structured output: the grammar a request's output must follow, and `logit_bias` checks.

A `Grammar` is what travels with `SamplingParams` to the engine core: its kind, its source text and
the API parameter it came from (for a 400 that names it). Every front door builds one here, so HTTP
(`response_format`, vLLM's `guided_*`), gRPC, the offline `LLM` and tool calling (`required` or a
named `tool_choice`: `Grammar.json_schema(schema_of_the_call)`) share one path:

    API process: build -> `validate_grammar`: the bounds, then converted to llguidance's form and
        validated in a child process (grammar_sandbox.py; an invalid one is a 400 naming the parameter)
    engine core: that form (`llguidance`) compiled on a thread -> a token bitmask per step
        (structured_output.py); nothing is converted or validated twice

The library is llguidance (docs/structured_output.md says why). It is imported only inside functions:
`SamplingParams` imports this module, and the operator image has no llguidance.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from threading import Lock
from typing import TYPE_CHECKING, Any, Literal

from pagoda.service.errors import InvalidRequestError

if TYPE_CHECKING:
    from pagoda.service.grammar_sandbox import GrammarSandbox

GrammarKind = Literal["json_schema", "regex", "choice", "lark"]

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range: [-100, 100]; -100 bans the token
# Compact JSON (no free whitespace): a small model cannot loop on newlines until max_tokens, and the
# output is as OpenAI's strict mode writes it.
_JSON_OPTIONS = {"whitespace_flexible": False}
_GBNF_RULE = re.compile(r"^\s*[\w-]+\s*::=", re.MULTILINE)

# Bounds checked before llguidance sees a grammar. Past them it crashed or blew up the API process
# (issue 30, on the CPU): a Lark grammar of 5,000 rules (131 KB) segfaulted it (1,000 were served), a
# 19 KB `allOf` of 250 two-way `anyOf`s asked for 671 MB and aborted, 100,000 choices panicked, and
# `a{1000000}` or `((a{100}){100}){100}` made it give up at compile time. Each is far above what a
# real schema, regex or tool needs (OpenAI's strict mode allows 5 levels of nesting, 1,000 enum values).
MAX_GRAMMAR_CHARS = 32 << 10  # the source text of any kind
MAX_LARK_RULES = 1000
MAX_CHOICES = 1000
MAX_SCHEMA_NODES = 2000  # objects in a JSON Schema
MAX_SCHEMA_DEPTH = 32
MAX_ALLOF_BRANCHES = 1024  # the product of the alternatives an `allOf` combines
MAX_REPEAT_PRODUCT = 100_000  # the product of a text's `{n}` / `{n,m}` repetition counts
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_LARK_RULE = re.compile(r"^\s*[?!]?[\w.]+(?:\.\d+)?\s*:", re.MULTILINE)


@dataclass(frozen=True)
class Grammar:
    """`source`: the JSON text of a JSON Schema, a regex, the JSON list of choices, or a Lark grammar
    (llguidance's dialect, which also embeds `%json { schema }`)."""

    kind: GrammarKind
    source: str
    param: str = "response_format"  # the request parameter it came from
    llguidance: str = field(default="", compare=False)  # the serialized form, once validated

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, param: str = "response_format") -> Grammar:
        if not isinstance(schema, dict | bool):
            raise _invalid(f"{param} must be a JSON Schema object", param=param)
        return cls("json_schema", json.dumps(schema), param)

    @classmethod
    def json_object(cls, param: str = "response_format") -> Grammar:
        """Any JSON object (OpenAI's `{"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"}, param)

    @classmethod
    def regex(cls, pattern: str, param: str = "guided_regex") -> Grammar:
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, choices: list[str], param: str = "guided_choice") -> Grammar:
        if not choices or not all(isinstance(c, str) for c in choices):
            raise _invalid(f"{param} must be a non-empty list of strings", param=param)
        return cls("choice", json.dumps(choices), param)

    @classmethod
    def lark(cls, grammar: str, param: str = "guided_grammar") -> Grammar:
        """A Lark grammar, or a GBNF one (`rule ::= ...`, llama.cpp's and xgrammar's), converted."""
        if len(grammar) <= MAX_GRAMMAR_CHARS and _GBNF_RULE.search(grammar):  # else refused unconverted
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                grammar = gbnf_to_lark(grammar)
            except Exception as exc:  # the converter raises plain exceptions on bad input
                raise _invalid(f"{param}: invalid GBNF grammar: {exc}", param=param) from exc
        return cls("lark", grammar, param)

    def to_llguidance(self) -> str:
        """The grammar in llguidance's serialized form (what `LLMatcher` compiles): kept from validation,
        else converted here."""
        if self.llguidance:
            return self.llguidance
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.source, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in json.loads(self.source))
            return LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return LLMatcher.grammar_from_lark(self.source)


def validate_grammar(grammar: Grammar) -> Grammar:
    """`grammar` with its serialized llguidance form; `InvalidRequestError` naming `grammar.param` when
    it is too large or complex for the bounds above, or cannot compile within the sandbox's limits
    (cached by source)."""
    too_much = _over_bounds(grammar.kind, grammar.source)
    if too_much:
        raise _invalid(f"{grammar.param} is too complex: {too_much}", param=grammar.param)
    error, serialized = _grammar_error(grammar.kind, grammar.source)
    if error:
        error = error.strip()
        error = error if len(error) <= 500 else error[:500] + "..."  # llguidance may quote the grammar
        raise _invalid(f"{grammar.param} is invalid: {error}", param=grammar.param)
    return replace(grammar, llguidance=serialized)


@lru_cache(maxsize=512)
def _over_bounds(kind: GrammarKind, source: str) -> str | None:
    """What exceeds a bound, in words; None when nothing does (cached by source, as compiling is: a
    repeated schema is parsed and walked once)."""
    if len(source) > MAX_GRAMMAR_CHARS:
        return f"{len(source)} characters, more than {MAX_GRAMMAR_CHARS}"
    product = 1
    for low, high in _REPEAT.findall(source):
        product *= max(int(low), int(high or 0), 1)
        if product > MAX_REPEAT_PRODUCT:
            return f"repetition counts multiply to more than {MAX_REPEAT_PRODUCT}"
    if kind == "lark" and len(_LARK_RULE.findall(source)) > MAX_LARK_RULES:
        return f"more than {MAX_LARK_RULES} rules"
    try:
        parsed: Any = json.loads(source) if kind in ("choice", "json_schema") else None
    except ValueError:
        return None  # not JSON: compiling says so
    if kind == "choice" and len(parsed) > MAX_CHOICES:
        return f"more than {MAX_CHOICES} choices"
    return _schema_over_bounds(parsed) if kind == "json_schema" else None


def _schema_over_bounds(schema: Any) -> str | None:
    nodes = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, list):
            stack.extend((item, depth) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            return f"more than {MAX_SCHEMA_NODES} schema objects"
        if depth > MAX_SCHEMA_DEPTH:
            return f"nested deeper than {MAX_SCHEMA_DEPTH}"
        branches = 1
        for member in node.get("allOf", []) if isinstance(node.get("allOf"), list) else []:
            if isinstance(member, dict):
                for key in ("anyOf", "oneOf"):
                    if isinstance(member.get(key), list):
                        branches *= max(len(member[key]), 1)
            if branches > MAX_ALLOF_BRANCHES:
                return f"an allOf combines more than {MAX_ALLOF_BRANCHES} alternatives"
        stack.extend((value, depth + 1) for value in node.values() if isinstance(value, dict | list))
    return None


_sandbox: GrammarSandbox | None = None
_sandbox_lock = Lock()


@lru_cache(maxsize=512)
def _grammar_error(kind: GrammarKind, source: str) -> tuple[str, str]:
    """(error, serialized), from this process's sandbox (started at the first grammar)."""
    global _sandbox
    from pagoda.service.grammar_sandbox import GrammarSandbox

    with _sandbox_lock:
        if _sandbox is None:
            _sandbox = GrammarSandbox()
    return _sandbox.check(kind, source)


def check_logit_bias(logit_bias: dict[int, float] | None, vocab_size: int) -> None:
    """Keys must be token ids of this vocabulary, values in [-100, 100]."""
    if not logit_bias:
        return
    bad = [t for t in logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise _invalid(
            f"logit_bias has token ids out of range [0, {vocab_size}): {bad[:5]}", param="logit_bias"
        )
    out_of_range = [v for v in logit_bias.values() if not -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT]
    if out_of_range:
        raise _invalid(
            f"logit_bias values must be in [-100, 100], got {out_of_range[:5]}", param="logit_bias"
        )


def _invalid(message: str, param: str) -> ValueError:
    return InvalidRequestError(message, param=param)


def parse_logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if not logit_bias:
        return None
    try:
        return {int(k): float(v) for k, v in logit_bias.items()}
    except (TypeError, ValueError) as exc:
        raise _invalid(
            "logit_bias keys must be token ids (integers) and values numbers", param="logit_bias"
        ) from exc
