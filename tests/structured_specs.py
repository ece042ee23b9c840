"""Structured-outputs specs of issue #32's shapes (deep schemas, `$ref` chains, an EBNF chain), and xgrammar
compiles made slow on purpose, for the tests of structured outputs."""

import threading

import pytest


def nested_schema(depth: int) -> dict:
    """An integer inside `depth` objects, each requiring the next: 2 levels of JSON per object."""
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def ref_chain(links: int, via: str = "$ref") -> dict:
    """`links` definitions each referring to the next (directly, or as a branch of an anyOf), then an integer."""

    def link(i: int) -> dict:
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        return ref if via == "$ref" else {"anyOf": [ref, {"type": "null"}]}

    return {
        "$defs": {**{f"d{i}": link(i) for i in range(links)}, f"d{links}": {"type": "integer"}},
        "$ref": "#/$defs/d0",
    }


def ebnf_chain(rules: int) -> str:
    """`r{i} ::= r{i+1} | "x{i}"`: xgrammar compiles it in about rules³ time."""
    chain = "\n".join(f'r{i} ::= r{i + 1} | "x{i}"' for i in range(rules))
    return f'root ::= r0\n{chain}\nr{rules} ::= "end"'


def slow_compiles(monkeypatch: pytest.MonkeyPatch, marker: str | None = None) -> threading.Event:
    """xgrammar compiles (of grammars whose text holds `marker`, or all) wait until the returned event is set."""
    import xgrammar

    release = threading.Event()
    compile_grammar = xgrammar.GrammarCompiler.compile_grammar

    def slow(self, grammar):
        if marker is None or marker in str(grammar):
            release.wait(30)
        return compile_grammar(self, grammar)

    monkeypatch.setattr(xgrammar.GrammarCompiler, "compile_grammar", slow)
    return release
