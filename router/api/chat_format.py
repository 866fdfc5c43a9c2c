"""What a model's chat format is, as mlx-lm's tokenizer wrapper knows it: its thinking
markers, its tool-call markers and parser (`mlx_lm/tool_parsers/`), and how a chat with
tools and template arguments renders through its chat template.

The choice is mlx-lm's own (`mlx_lm.tokenizer_utils.load`): the tokenizer config's
`tool_parser_type` (which `--tool-call-parser` sets), else the parser inferred from the
template or the vocabulary; the thinking markers are the ones inferred from the vocabulary.
A model for which none is found takes tools in the generic format (router.generic_tools).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from router.api.generic_tools import GENERIC, PARSER
from router.request_error import RequestError

_ALIAS = "_radix_mlx_lm"


def mlx_lm_module(name: str) -> types.ModuleType:
    """`mlx_lm.<name>` without running `mlx_lm/__init__.py`, which imports MLX (2 s, and
    a second copy of the array library in a process that never computes): the modules
    used here import only the standard library and transformers. A process that already
    imported mlx_lm gets its own modules."""
    if "mlx_lm" in sys.modules:
        return importlib.import_module(f"mlx_lm.{name}")
    if _ALIAS not in sys.modules:
        package = types.ModuleType(_ALIAS)
        package.__path__ = list(importlib.util.find_spec("mlx_lm").submodule_search_locations)
        sys.modules[_ALIAS] = package
    return importlib.import_module(f"{_ALIAS}.{name}")


def _added_token_id(tokenizer, text: str | None) -> int | None:
    """The id of `text` when the tokenizer holds it as one added (special) token."""
    added = getattr(tokenizer, "get_added_vocab", dict)()
    return added.get(text) if text else None


@dataclass(frozen=True)
class ChatFormat:
    think_start: str | None = None
    think_end: str | None = None
    thinking_kwarg: str = "enable_thinking"
    tool_parser_type: str | None = None
    tool_call_start: str | None = None
    tool_call_end: str | None = None
    tool_parser: Callable | None = None
    generic_tools: bool = False  # the router writes the tools into the chat, not the template
    # the end marker's token id when the tokenizer has it as one added token: a grammar
    # must name that token (`<[id]>`), as llguidance's lexer does not let the marker's text
    # end a thought once the thought has text (tests/test_thought_end.py)
    think_end_id: int | None = None

    @classmethod
    def of(cls, tokenizer) -> ChatFormat:
        tokenizer_utils = mlx_lm_module("tokenizer_utils")
        think_start, think_end, _, _ = tokenizer_utils._infer_thinking(tokenizer)
        kwarg, _ = tokenizer_utils._infer_thinking_kwarg(tokenizer)
        kind = getattr(tokenizer, "init_kwargs", {}).get("tool_parser_type")
        kind = kind or tokenizer_utils._infer_tool_parser(tokenizer)
        generic = kind in (None, GENERIC)
        module = mlx_lm_module(f"tool_parsers.{PARSER if generic else kind}")
        return cls(
            think_start, think_end, kwarg, PARSER if generic else kind,
            module.tool_call_start, module.tool_call_end, module.parse_tool_call, generic,
            _added_token_id(tokenizer, think_end),
        )  # fmt: skip

    def template_kwargs(self, given: dict | None) -> dict:
        """The template's arguments: the request's, under the name its template uses for
        the thinking switch. A request that does not ask for thinking gets none (as on
        Anthropic's API): the switch is set off explicitly, because templates such as
        Qwen3's think when it is undefined, and an agent that did not ask for a thought
        would see its answer cut short by one."""
        kwargs = dict(given or {})
        if self.thinking_kwarg != "enable_thinking" and "enable_thinking" in kwargs:
            kwargs[self.thinking_kwarg] = kwargs.pop("enable_thinking")
        kwargs.setdefault(self.thinking_kwarg, False)
        return kwargs

    def starts_thinking(self, prompt: str) -> bool:
        """Whether the rendered prompt leaves the model inside a thinking block (its
        template opened one), so its output starts as reasoning."""
        if self.think_start is None:
            return False
        return prompt.rfind(self.think_start) > prompt.rfind(self.think_end)


def tool_parser_names() -> list[str]:
    """The --tool-call-parser choices: mlx-lm's tool parsers and the generic format."""
    package = importlib.util.find_spec("mlx_lm").submodule_search_locations[0]
    parsers = Path(package, "tool_parsers").glob("*.py")
    return sorted([p.stem for p in parsers if not p.stem.startswith("_")] + [GENERIC])


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates take them: an assistant's tool call arguments as
    objects rather than JSON strings (as mlx-lm's server passes them)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if calls:
            message = copy.deepcopy(message)
            for j, call in enumerate(message["tool_calls"]):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise RequestError(f"messages[{i}].tool_calls[{j}] needs a function name")
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        function["arguments"] = json.loads(arguments or "{}")
                    except json.JSONDecodeError:
                        raise RequestError(
                            f"messages[{i}].tool_calls[{j}].function.arguments is not JSON"
                        ) from None
        out.append(message)
    return out
