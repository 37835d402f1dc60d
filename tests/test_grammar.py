"""`pagoda.service.grammar` on its own (no model, no server): what each front door builds, what
llguidance is handed, and the 400s for grammars and logit_bias that cannot be served. The served paths
are in tests/test_structured_output.py; this is the fast target of `make mutation` for grammar handling."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from llguidance import LLMatcher

from pagoda.service.errors import InvalidRequestError
from pagoda.service.grammar import (
    LOGIT_BIAS_LIMIT,
    MAX_ALLOF_BRANCHES,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_LARK_RULES,
    MAX_REPEAT_PRODUCT,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    Grammar,
    GrammarKind,
    _over_bounds,
    check_logit_bias,
    parse_logit_bias,
    validate_grammar,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_each_constructor_keeps_its_kind_source_and_parameter() -> None:
    assert Grammar.json_schema(SCHEMA) == Grammar("json_schema", json.dumps(SCHEMA), "response_format")
    assert Grammar.json_schema(True, "tools").param == "tools"
    assert Grammar.json_object() == Grammar("json_schema", '{"type": "object"}', "response_format")
    assert Grammar.regex("[0-9]+") == Grammar("regex", "[0-9]+", "guided_regex")
    assert Grammar.choice(["a", "b"]) == Grammar("choice", '["a", "b"]', "guided_choice")
    assert Grammar.lark('start: "x"') == Grammar("lark", 'start: "x"', "guided_grammar")
    assert Grammar.regex("x", "guided_regex_other").param == "guided_regex_other"


@pytest.mark.parametrize(
    ("build", "param"),
    [
        (lambda: Grammar.json_schema([1, 2]), "response_format"),  # type: ignore[arg-type]
        (lambda: Grammar.json_schema("{}", "guided_json"), "guided_json"),  # type: ignore[arg-type]
        (lambda: Grammar.choice([]), "guided_choice"),
        (lambda: Grammar.choice(["a", 1]), "guided_choice"),  # type: ignore[list-item]
        (lambda: Grammar.lark("root ::= ("), "guided_grammar"),
    ],
)
def test_malformed_input_is_refused_naming_its_parameter(build, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        build()
    assert info.value.param == param and param in str(info.value)


def test_gbnf_is_converted_to_lark_and_lark_is_kept() -> None:
    converted = Grammar.lark('root ::= "yes" | "no"')
    assert converted.kind == "lark" and "::=" not in converted.source
    validate_grammar(converted)
    lark = 'start: "a" "b"'
    assert Grammar.lark(lark).source == lark  # no rule ::= in it: left as it is


@pytest.fixture(scope="module")
def accepts(tokenizer_files: Path) -> Callable[[Grammar, str], bool]:
    """Whether the compiled `grammar` takes exactly `text`, tokenized by SmolLM2's tokenizer."""
    from llguidance import LLTokenizer
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tokenizer_files / "tokenizer.json"))
    ll_tokenizer = LLTokenizer(backend.to_str(), eos_token=2)

    def check(grammar: Grammar, text: str) -> bool:
        matcher = LLMatcher(ll_tokenizer, grammar.to_llguidance(), log_level=0)
        ids = backend.encode(text, add_special_tokens=False).ids
        return not matcher.is_error() and matcher.consume_tokens(ids) and matcher.is_accepting()

    return check


@pytest.mark.parametrize(
    ("grammar", "good", "bad"),
    [
        (Grammar.json_schema(SCHEMA), '{"a":12}', '{"a":"12"}'),
        (Grammar.json_object(), '{"k":[1,2]}', "[1,2]"),
        (Grammar.regex("[0-9]{3}"), "123", "12"),
        (Grammar.choice(["red", "blue"]), "blue", "green"),
        (Grammar.lark('start: "x" | "y"'), "y", "z"),
        (Grammar.lark('root ::= "yes" | "no"'), "no", "maybe"),
    ],
    ids=["json_schema", "json_object", "regex", "choice", "lark", "gbnf"],
)
def test_the_compiled_grammar_takes_what_it_should_and_nothing_else(
    accepts: Callable[[Grammar, str], bool], grammar: Grammar, good: str, bad: str
) -> None:
    assert accepts(grammar, good)
    assert not accepts(grammar, bad)


def test_a_grammar_that_crossed_a_process_boundary_compiles_the_same() -> None:
    """The core gets its Grammar unpickled: its kind is an equal string, not the same object."""
    for grammar in (Grammar.json_schema(SCHEMA), Grammar.regex("a+"), Grammar.choice(["x", "y"])):
        copy = Grammar("".join(list(grammar.kind)), grammar.source, grammar.param)
        assert copy.kind is not grammar.kind
        assert copy.to_llguidance() == grammar.to_llguidance()


def test_json_is_compact(accepts: Callable[[Grammar, str], bool]) -> None:
    """No free whitespace between JSON tokens: a small model cannot loop on newlines."""
    assert accepts(Grammar.json_schema(SCHEMA), '{"a":1}')
    assert not accepts(Grammar.json_schema(SCHEMA), '{ "a": 1 }')


@pytest.mark.parametrize(
    ("grammar", "needle"),
    [
        (Grammar.json_schema(SCHEMA), '"integer"'),
        (Grammar.regex("[0-9]{3}"), "[0-9]{3}"),
        (Grammar.choice(["red", "blue"]), '"red" | "blue"'),
        (Grammar.lark('start: "x" | "y"'), 'start: "x" | "y"'),
    ],
)
def test_each_kind_reaches_llguidance_as_its_own_grammar(grammar: Grammar, needle: str) -> None:
    serialized = grammar.to_llguidance()
    assert LLMatcher.validate_grammar(serialized) == ""
    assert needle in serialized, serialized


@pytest.mark.parametrize(
    ("grammar", "param"),
    [
        (Grammar.regex("(", "guided_regex"), "guided_regex"),
        (Grammar.lark("start: undefined_rule", "guided_grammar"), "guided_grammar"),
        (Grammar("json_schema", "{not json", "response_format"), "response_format"),
        (Grammar.json_schema({"type": "no-such-type"}, "guided_json"), "guided_json"),
    ],
)
def test_a_grammar_that_cannot_compile_is_a_400_naming_it(grammar: Grammar, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validate_grammar(grammar)
    assert info.value.param == param
    assert str(info.value).startswith(f"{param} is invalid: ") and len(str(info.value)) > len(param) + 13


def test_a_valid_grammar_passes() -> None:
    for grammar in (Grammar.json_schema(SCHEMA), Grammar.regex("a+"), Grammar.choice(["x"])):
        validate_grammar(grammar)


def test_logit_bias_bounds() -> None:
    check_logit_bias(None, 10)
    check_logit_bias({}, 10)
    check_logit_bias({0: -LOGIT_BIAS_LIMIT, 9: LOGIT_BIAS_LIMIT}, 10)  # both ends are allowed
    for bad in ({10: 1.0}, {-1: 1.0}):
        with pytest.raises(InvalidRequestError, match=r"out of range \[0, 10\)") as info:
            check_logit_bias(bad, 10)
        assert info.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError) as info:
        check_logit_bias({t: 1.0 for t in range(10, 17)}, 10)  # seven bad ids: the first five are named
    assert str(info.value).endswith("[10, 11, 12, 13, 14]")
    for token in (1000, 1001):  # past the small-int cache: compared by value
        with pytest.raises(InvalidRequestError):
            check_logit_bias({int(str(token)): 1.0}, int("1000"))
    with pytest.raises(InvalidRequestError) as info:
        check_logit_bias({t: 200.0 + t for t in range(7)}, 10)
    assert str(info.value).endswith("[200.0, 201.0, 202.0, 203.0, 204.0]")
    for value in (LOGIT_BIAS_LIMIT + 0.5, -LOGIT_BIAS_LIMIT - 0.5):
        with pytest.raises(InvalidRequestError, match=r"\[-100, 100\]") as info:
            check_logit_bias({3: value}, 10)
        assert info.value.param == "logit_bias"
    assert LOGIT_BIAS_LIMIT == 100.0


def test_logit_bias_keys_arrive_as_strings() -> None:
    assert parse_logit_bias(None) is None and parse_logit_bias({}) is None
    assert parse_logit_bias({"5": 2, "7": -1.5}) == {5: 2.0, 7: -1.5}
    with pytest.raises(InvalidRequestError) as info:
        parse_logit_bias({"the": 1.0})
    assert info.value.param == "logit_bias"


# ---- bounds: what crashed or blew up the API process, refused before llguidance sees it -----------------

UUID = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"  # 6,144: well inside the bound


def _nested(depth: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _all_of(alternatives: int, terms: int) -> dict[str, object]:
    term = {"anyOf": [{"type": "string", "pattern": f"^a{{{i + 1}}}$"} for i in range(alternatives)]}
    return {"allOf": [term] * terms}


@pytest.mark.parametrize(
    ("grammar", "says"),
    [
        (
            Grammar.lark(
                "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(1001)) + 'r1001: "b"'
            ),
            "rules",
        ),
        (Grammar.lark("start: " + " | ".join(f'"{i:05}"' for i in range(6000))), "characters"),
        (Grammar.choice([f"c{i}" for i in range(1001)]), "choices"),
        (Grammar.regex("a{1000000}"), "repetition"),
        (Grammar.regex("((a{100}){100}){100}"), "repetition"),
        (Grammar.regex("a{3,200000}"), "repetition"),
        (Grammar.json_schema(_all_of(2, 11)), "allOf"),  # 2**11 > 1024 (the crash was 2**250)
        (Grammar.json_schema(_nested(17)), "deeper"),
        (
            Grammar.json_schema({"type": "object", "properties": {f"p{i}": {} for i in range(2000)}}),
            "schema objects",
        ),
        (Grammar.json_schema({"type": "string", "pattern": "^x{1000001}$"}), "repetition"),
    ],
    ids=[
        "lark rules",
        "size",
        "choices",
        "regex",
        "nested repeats",
        "repeat range",
        "allOf",
        "depth",
        "nodes",
        "schema pattern",
    ],
)
def test_a_grammar_past_the_bounds_is_a_400_before_it_compiles(grammar: Grammar, says: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"is too complex: .*{says}") as err:
        validate_grammar(grammar)
    assert err.value.param == grammar.param and len(str(err.value)) < 200


@pytest.mark.parametrize(
    "grammar",
    [
        Grammar.regex(UUID),
        Grammar.regex(r"\d{3}-\d{3}-\d{4}"),
        Grammar.choice([f"c{i}" for i in range(1000)]),
        Grammar.json_schema(_all_of(2, 10)),
        Grammar.json_schema(_nested(15)),
        Grammar.lark("start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(998)) + 'r998: "b"'),
    ],
    ids=["uuid", "phone", "1000 choices", "allOf of 1024", "15 levels", "1000 rules"],
)
def test_what_real_requests_need_is_inside_the_bounds(grammar: Grammar) -> None:
    validate_grammar(grammar)


def _chain(depth: int) -> dict[str, object]:
    schema: dict[str, object] = {}
    for _ in range(depth - 1):
        schema = {"items": schema}
    return schema


@pytest.mark.parametrize(
    ("kind", "at_the_bound", "past_it"),
    [
        ("regex", "a" * MAX_GRAMMAR_CHARS, "a" * (MAX_GRAMMAR_CHARS + 1)),
        ("regex", f"a{{{MAX_REPEAT_PRODUCT}}}", f"a{{{MAX_REPEAT_PRODUCT + 1}}}"),
        ("regex", "(a{10}){10000}", "(a{10,11}){10000}"),  # a range counts by its larger end
        ("json_schema", json.dumps(_chain(MAX_SCHEMA_DEPTH)), json.dumps(_chain(MAX_SCHEMA_DEPTH + 1))),
        (
            "json_schema",
            json.dumps({"anyOf": [{}] * (MAX_SCHEMA_NODES - 1)}),
            json.dumps({"anyOf": [{}] * MAX_SCHEMA_NODES}),
        ),
        (
            "json_schema",
            json.dumps({"allOf": [{"anyOf": [{}] * MAX_ALLOF_BRANCHES}]}),
            json.dumps({"allOf": [{"anyOf": [{}] * (MAX_ALLOF_BRANCHES + 1)}]}),
        ),
        ("choice", json.dumps(["c"] * MAX_CHOICES), json.dumps(["c"] * (MAX_CHOICES + 1))),
        ("lark", "r: x\n" * MAX_LARK_RULES, "r: x\n" * (MAX_LARK_RULES + 1)),
    ],
    ids=["size", "repeat", "repeat range", "depth", "nodes", "allOf", "choices", "rules"],
)
def test_each_bound_takes_its_value_and_refuses_one_more(
    kind: GrammarKind, at_the_bound: str, past_it: str
) -> None:
    assert _over_bounds(kind, at_the_bound) is None
    assert _over_bounds(kind, past_it)


def test_the_bounds_read_only_their_own_kind() -> None:
    many_rules = "r: x\n" * (MAX_LARK_RULES + 1)  # a regex of that text is not a grammar of rules
    assert _over_bounds("regex", many_rules) is None
    assert _over_bounds("choice", json.dumps([{} for _ in range(10)])) is None  # nodes count in schemas only
    assert _over_bounds("json_schema", json.dumps(["c"] * (MAX_CHOICES + 1))) is None


def test_a_long_library_error_is_cut_to_500_characters() -> None:
    with pytest.raises(InvalidRequestError) as err:
        validate_grammar(Grammar.lark("start: " + "x" * 600))
    message = str(err.value)
    assert message.endswith("...") and len(message) == len("guided_grammar is invalid: ") + 503
