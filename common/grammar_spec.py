"""A request's grammar (SamplingParams.grammar_kind + grammar) as llguidance's grammar.

The router validates it with this before anything is scheduled (a bad schema is a 400);
the worker compiles the same text into a matcher. llguidance was picked over xgrammar by
measurement (see benchmarks/grammar_mask.py and README "Structured output").
"""

from __future__ import annotations

import json

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

# JSON as compact as json.dumps: a random-weight model would otherwise fill the output
# with the whitespace a schema allows between tokens.
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar the engine rejects, with its message."""


def to_llguidance(kind: str, source: str) -> str:
    """llguidance's grammar for `source` of `kind` (common.messages.GRAMMAR_KINDS)."""
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not JSON: {exc}") from None
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(source)
    if kind == "ebnf":
        try:
            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(source))
        except Exception as exc:  # the converter raises its own parse errors and others
            raise GrammarError(f"invalid EBNF grammar: {exc}") from None
    raise GrammarError(f"unknown grammar kind {kind!r}")


def check(kind: str, source: str) -> None:
    """Raise GrammarError naming the problem if the engine rejects the grammar."""
    error = llguidance.LLMatcher.validate_grammar(to_llguidance(kind, source))
    if error:
        raise GrammarError(f"invalid {kind.replace('_', ' ')}: {error.strip()}")
