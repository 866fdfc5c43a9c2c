"""Forced tool calls in every tool format radix-mlx writes a grammar for: the tiny agent
model's tokenizer with a chat template in that format (tests/agent_model.py) makes mlx-lm
pick the parser; a seeded random walk through llguidance's token masks for the forced-call
grammar (the worker's own matcher) gives an output, which mlx-lm's parser, through the
router's output splitter, must read back as a call to the forced function whose arguments
validate against its schema."""

from __future__ import annotations

import json
import random
import shutil

import jsonschema
import pytest
from transformers import AutoTokenizer

from common.messages import SamplingParams
from router.api.chat_format import ChatFormat
from router.api.chat_output import OutputSplitter
from router.api.constraints import tool_grammar
from router.api.tool_grammars import FORCEABLE_FORMATS
from router.request_error import RequestError
from tests.agent_model import FORMATS, agent_template

LOOKUP = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "exact": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
FLAT = {k: v for k, v in LOOKUP.items() if k != "properties"}
FLAT["properties"] = {k: v for k, v in LOOKUP["properties"].items() if k != "tags"}
FLAT_LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": FLAT}}
PING = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}},
    {"type": "function", "function": {"name": "ping", "parameters": PING}},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_model, agent_model, tmp_path_factory):
    """The agent model's tokenizer files (its thinking and tool tokens), no weights."""
    out = tmp_path_factory.mktemp("tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src := f"{agent_model}/{name}") and shutil.os.path.exists(src):
            shutil.copy(src, out / name)
    return out


def tokenizer_in(tokenizer_dir, tool_format: str):
    config_path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = agent_template(tool_format)
    config_path.write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if tool_format == "kimi_k3":  # mlx-lm picks its parser by these tokens
        tokenizer.add_tokens(["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"])
    return tokenizer


def random_walk(tokenizer, grammar: tuple[str, str], seed: int, limit: int = 400) -> str:
    """An output the grammar allows: each token drawn uniformly from the allowed ones."""
    import numpy as np

    from worker_mlx.grammar import Grammars

    eos = [tokenizer.eos_token_id]
    grammars = Grammars(tokenizer, len(tokenizer), eos)
    params = SamplingParams(grammar_kind=grammar[0], grammar=grammar[1])
    matcher = grammars.matcher(params, [])
    rng, ids = random.Random(seed), []
    import llguidance.numpy as llg_np

    while not matcher.is_stopped() and len(ids) < limit:
        mask = llg_np.allocate_token_bitmask(1, grammars.vocab_size)
        llg_np.fill_next_token_bitmask(matcher, mask, 0)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: len(tokenizer)]
        allowed = [t for t in np.flatnonzero(bits).tolist() if t not in eos]
        if not allowed:
            break
        token = rng.choice(allowed)
        assert matcher.consume_token(token), matcher.get_error()
        ids.append(token)
    assert matcher.is_accepting(), tokenizer.decode(ids)
    return tokenizer.decode(ids)


@pytest.mark.parametrize("tool_format", sorted(FORMATS))
def test_forced_calls_parse_in_every_format(tokenizer_dir, tool_format):
    tokenizer = tokenizer_in(tokenizer_dir, tool_format)
    fmt = ChatFormat.of(tokenizer)
    assert fmt.tool_parser_type == tool_format
    choices = [["lookup"], ["lookup"], ["lookup", "ping"], ["ping"]]
    tools = TOOLS
    if tool_format == "function_gemma":  # its parser reads no object or array values
        with pytest.raises(RequestError, match="parameter 'tags'"):
            tool_grammar(fmt, TOOLS, ["lookup"], thinking=False)
        tools = [FLAT_LOOKUP, TOOLS[1]]
    if tool_format == "longcat":  # its parser cannot read a call without arguments
        with pytest.raises(RequestError, match="cannot read a call without arguments"):
            tool_grammar(fmt, TOOLS, ["ping"], thinking=False)
        choices = choices[:2]
    for seed, names in enumerate(choices):
        grammar = tool_grammar(fmt, tools, names, thinking=False)
        text = random_walk(tokenizer, grammar, seed)
        splitter = OutputSplitter(fmt, tools, thinking=False)
        parts = splitter.feed(text, final=True)
        assert parts.content.strip() == "", text
        (call,) = parts.tool_calls
        assert call.name in names, text
        arguments = json.loads(call.arguments)
        if call.name == "lookup":
            jsonschema.validate(arguments, LOOKUP)


def test_every_forceable_format_has_a_template():
    assert set(FORCEABLE_FORMATS) - set(FORMATS) == {"laguna"}  # glm47's own parser


def test_a_format_without_a_grammar_is_refused(tokenizer_dir):
    fmt = ChatFormat.of(tokenizer_in(tokenizer_dir, "json_tools"))
    fmt = ChatFormat(fmt.think_start, fmt.think_end, tool_parser_type="a_future_format")
    with pytest.raises(RequestError, match="'a_future_format': use tool_choice auto"):
        tool_grammar(fmt, TOOLS, ["lookup"], thinking=False)
