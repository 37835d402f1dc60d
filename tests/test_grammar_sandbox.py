"""The grammar sandbox with the real library: what crashes llguidance (a segfault found by issue 30,
behind the bounds of `grammar.py`, which these tests go around) or runs past the limits ends the child,
not this process, and the next check gets a fresh child."""

from __future__ import annotations

import json
import os
import signal

import pytest

from pagoda.service import grammar as grammar_module
from pagoda.service.errors import InvalidRequestError
from pagoda.service.grammar import Grammar, validate_grammar
from pagoda.service.grammar_sandbox import GrammarSandbox

PERSON = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})


def _chained_rules(n: int) -> str:
    """A Lark grammar of n chained rules: 5,000 segfault llguidance (1,000 are served)."""
    return "\n".join(["start: r0", *(f'r{i}: "a" r{i + 1}' for i in range(n)), f'r{n}: "b"'])


@pytest.fixture
def sandbox() -> GrammarSandbox:
    box = GrammarSandbox()
    yield box
    box.close()


def test_a_valid_grammar_comes_back_converted_and_an_invalid_one_with_the_library_error(
    sandbox: GrammarSandbox,
) -> None:
    error, serialized = sandbox.check("json_schema", PERSON)
    assert error == "" and serialized == Grammar("json_schema", PERSON).to_llguidance()
    error, serialized = sandbox.check("regex", "(")
    assert error and serialized == ""
    error, _ = sandbox.check("json_schema", "{not json")
    assert error == "key must be a string at line 1 column 2"  # the parse error, as before the sandbox


def test_a_segfault_ends_the_child_only_and_the_next_check_gets_a_new_one(sandbox: GrammarSandbox) -> None:
    assert sandbox.check("regex", "[a-z]+") == ("", Grammar.regex("[a-z]+").to_llguidance())
    first = sandbox._child
    assert first is not None
    error, serialized = sandbox.check("lark", _chained_rules(5000))
    assert error == "it crashed the grammar compiler (SIGSEGV)" and serialized == ""
    assert first.poll() == -signal.SIGSEGV and sandbox._child is None
    assert sandbox.check("json_schema", PERSON)[0] == ""  # a new child
    assert sandbox._child is not None and sandbox._child.pid != first.pid


def test_a_check_past_its_time_is_stopped(sandbox: GrammarSandbox) -> None:
    """20,000 choices take ~0.35 s to validate; the limit here is 0.05 s (the real one is 10 s)."""
    choices = json.dumps([f"w{i}x" for i in range(20_000)])
    sandbox.check("regex", "a")  # the child is up: its start is not what times out
    quick = GrammarSandbox(timeout_s=0.05)
    try:
        quick.check("regex", "a")
        error, _ = quick.check("choice", choices)
        assert error == "compiling it took more than 0.05 s" and quick._child is None
        assert quick.check("regex", "a")[0] == ""
    finally:
        quick.close()
    assert sandbox.check("choice", choices)[0] == ""  # within the default limit it is valid


def test_a_child_killed_while_idle_is_replaced_without_failing_the_check(sandbox: GrammarSandbox) -> None:
    sandbox.check("regex", "a")
    child = sandbox._child
    assert child is not None
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert sandbox.check("regex", "b") == ("", Grammar.regex("b").to_llguidance())


def test_a_memory_limit_too_small_for_a_grammar_fails_it_cleanly() -> None:
    """The address-space cap holds: 100 MiB lets the interpreter and the library load (29 MB) and check
    a small grammar, not 40,000 choices (a peak of 131 MB)."""
    small = GrammarSandbox(memory_bytes=100 << 20)
    try:
        assert small.check("regex", "a")[0] == ""
        error, _ = small.check("choice", json.dumps([f"choice number {i}" * 4 for i in range(40_000)]))
        assert error.startswith(("it crashed the grammar compiler (SIGABRT", "it needs more than 100 MiB"))
        assert small.check("regex", "b")[0] == ""
    finally:
        small.close()


def test_validate_grammar_refuses_a_crashing_grammar_with_a_400_and_keeps_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(grammar_module, "MAX_GRAMMAR_CHARS", 1 << 20)  # past the bounds: the sandbox
    monkeypatch.setattr(grammar_module, "MAX_LARK_RULES", 10_000)
    grammar_module._over_bounds.cache_clear()
    try:
        with pytest.raises(InvalidRequestError) as info:
            validate_grammar(Grammar.lark(_chained_rules(5000)))
        assert info.value.param == "guided_grammar"
        assert str(info.value) == "guided_grammar is invalid: it crashed the grammar compiler (SIGSEGV)"
    finally:
        grammar_module._over_bounds.cache_clear()
    checked = validate_grammar(Grammar("json_schema", PERSON))
    assert checked.llguidance == Grammar("json_schema", PERSON).to_llguidance() and checked.source == PERSON
