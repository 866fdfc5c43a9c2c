"""Constrained decoding on the worker (ModelRunner + llguidance), on the tiny model.

Constrained rows share their batch with unconstrained ones: every unconstrained row must
stay token-exact with mlx-lm's greedy generation, and every constrained row's output must
parse and validate against its schema (checked with `jsonschema`).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from common.grammar_spec import GrammarError, check
from common.messages import ReleaseReq, SamplingParams
from tests.conftest import load_model
from tests.test_model_runner import Harness, reference, vocab_size

CLOSED = {"additionalProperties": False}  # else a random model adds keys forever
S = {"type": "string", "maxLength": 8}
I = {"type": "integer", "minimum": -50, "maximum": 500}  # noqa: E741
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": I}, "required": ["name", "age"], **CLOSED},
    {"type": "array", "items": I, "minItems": 1, "maxItems": 4},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], **CLOSED},
    {
        "type": "object",
        "properties": {
            "outer": {"type": "object", "properties": {"inner": I}, "required": ["inner"], **CLOSED}
        },
        "required": ["outer"],
        **CLOSED,
    },
    {"anyOf": [I, {"type": "string", "enum": ["none"]}]},
    {"type": "string", "pattern": "^[a-c]{2,4}-[0-9]{2}$"},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}},
        "required": ["tags"],
        **CLOSED,
    },
    {"type": "number", "minimum": 0, "maximum": 10},
    {"type": "null"},
    {
        "type": "object",
        "properties": {
            "kind": {"const": "point"},
            "xy": {"type": "array", "items": I, "minItems": 2, "maxItems": 2},
        },
        "required": ["kind", "xy"],
        **CLOSED,
    },
    {
        "type": "array",
        "items": {"type": "object", "properties": {"id": I}, "required": ["id"], **CLOSED},
        "maxItems": 2,
    },
]


def constrained(kind: str, source: str, n: int = 96) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, grammar_kind=kind, grammar=source)


def grammar_harness(path: str) -> Harness:
    from worker_mlx.grammar import Grammars

    tokenizer = load_model(path)[1]
    eos = sorted(tokenizer.eos_token_ids)
    h = Harness(path, grammars=Grammars(tokenizer._tokenizer, vocab_size(path), eos))
    h.eos, h.tokenizer = set(eos), tokenizer
    return h


def run(h: Harness, prompts: dict, sampling: dict, steps: int) -> dict[str, list[int]]:
    """Extend all, decode until every request is done; a request stops at EOS or its max."""
    h.extend([h.ereq(rid, p, sampling=sampling[rid]) for rid, p in prompts.items()])
    for _ in range(steps):
        done = [
            rid for rid in h.running
            if h.out[rid][-1] in h.eos or len(h.out[rid]) >= sampling[rid].max_new_tokens
        ]  # fmt: skip
        release = [ReleaseReq(rid, True) for rid in done]
        if len(done) == len(h.running):
            h.release(release)
            break
        h.decode(release=release)
    return h.out


def text_of(h: Harness, ids: list[int]) -> str:
    return h.tokenizer.decode([t for t in ids if t not in h.eos])


def test_schemas_validate_with_unconstrained_rows_exact(tiny_model):
    """Batch of 8: 4 constrained rows (JSON schemas), 4 unconstrained greedy rows."""
    h = grammar_harness(tiny_model)
    for start in range(0, len(SCHEMAS), 4):
        schemas = SCHEMAS[start : start + 4]
        prompts, sampling = {}, {}
        for i in range(8):
            rid = f"s{start}-{i}"
            prompts[rid] = [(31 * i + 7 * start + 5) % h.vocab for _ in range(3)] + [i + 3]
            if i % 2 == 0:
                sampling[rid] = constrained("json_schema", json.dumps(schemas[i // 2]))
            else:
                sampling[rid] = SamplingParams(temperature=0, max_new_tokens=12)
        out = run(h, prompts, sampling, steps=200)
        for i, rid in enumerate(prompts):
            if i % 2:
                ref = reference(tiny_model, prompts[rid], 12)
                assert out[rid] == ref[: len(out[rid])], rid  # up to its EOS, if it met one
            else:
                assert out[rid][-1] in h.eos, f"{rid} did not finish: {text_of(h, out[rid])!r}"
                value = json.loads(text_of(h, out[rid]))
                jsonschema.validate(value, schemas[i // 2])


def test_regex_and_ebnf(tiny_model):
    h = grammar_harness(tiny_model)
    prompts = {"re": [5, 6, 7], "eb": [8, 9, 10]}
    sampling = {
        "re": constrained("regex", r"[a-z]{3,6} [0-9]{2}"),
        "eb": constrained("ebnf", 'root ::= "yes" | "no" | "maybe"'),
    }
    out = run(h, prompts, sampling, steps=40)
    assert re.fullmatch(r"[a-z]{3,6} [0-9]{2}", text_of(h, out["re"]))
    assert text_of(h, out["eb"]) in ("yes", "no", "maybe")


def test_sampled_rows_obey_their_grammar(tiny_model):
    h = grammar_harness(tiny_model)
    schema = SCHEMAS[0]
    prompts = {f"t{i}": [i + 1, 2 * i + 3] for i in range(4)}
    sampling = {
        rid: SamplingParams(
            temperature=1.0,
            seed=i,
            max_new_tokens=96,
            grammar_kind="json_schema",
            grammar=json.dumps(schema),
        )  # fmt: skip
        for i, rid in enumerate(prompts)
    }
    out = run(h, prompts, sampling, steps=200)
    for rid in prompts:
        jsonschema.validate(json.loads(text_of(h, out[rid])), schema)


@pytest.mark.parametrize(
    "kind,source,needle",
    [
        ("json_schema", json.dumps({"type": "frobnicate"}), "frobnicate"),
        ("json_schema", "{not json", "not JSON"),
        ("regex", "a[b", "unclosed character class"),
        ("ebnf", "root ::= foo", "'foo' not found"),
    ],
)
def test_rejected_grammars_name_the_problem(kind, source, needle):
    with pytest.raises(GrammarError, match=re.escape(needle)):
        check(kind, source)
