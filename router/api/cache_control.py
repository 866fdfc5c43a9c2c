"""Anthropic `cache_control` breakpoints as a token count: how many of the prompt's first
tokens the scheduler keeps cached ahead of unmarked ones (GenerateReq.priority_prefix_len).

Anthropic caches the prompt up to the end of each block marked with `cache_control`; what
matters to the radix cache is the last one, which covers all the others. Its position in
tokens is found by rendering the chat once more with a marker (a private-use character
run no tokenizer or template treats specially) at the end of that block's text: the
rendered text before the marker, tokenized, shares with the prompt's own ids exactly the
tokens that block ends after. Their common prefix is taken, so a template that moves or
rewrites text, or a tokenizer that merges across the cut, can only shorten the marked
prefix, never mark tokens the prompt does not have.

Marks on text blocks (system or message) and on tool_result blocks are placed so; a mark
on another block (tool_use, image, a tool definition) counts from the last marked text
before it, as its own text position is the template's to choose. A request's top-level
`cache_control` marks its last message.
"""

from __future__ import annotations

import copy

from common.prefix import common_prefix_len
from router.api.generation import Tokenization

MARKER = "\ue000\ue001\ue000"


def marked_prefix_len(tok: Tokenization, req, ids: list[int]) -> int:
    """Tokens of `ids` (the prompt of the Anthropic request `req`) up to the end of its
    last cache_control breakpoint; 0 for none."""
    marked = _with_marker(req)
    if marked is None:
        return 0
    text = tok.render_chat(
        marked.openai_messages(), marked.openai_tools(), marked.template_kwargs()
    )
    cut = text.find(MARKER)
    if cut < 0:  # the template dropped that block's text
        return 0
    return common_prefix_len(tok.encode_rendered(text[:cut]), ids)


def _with_marker(req):
    """A copy of `req` with MARKER at the end of its last marked text, or None."""
    system = copy.deepcopy(req.system)
    messages = copy.deepcopy(req.messages)
    spots = []  # (a list holding text, the index of the text's block) in prompt order
    if isinstance(system, list):
        spots += [(system, j) for j, b in enumerate(system) if _marked(b)]
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            spots += [(content, j) for j, b in enumerate(content) if _marked(b)]
    if getattr(req, "cache_control", None) and messages:  # top-level: the last message
        last = messages[-1]
        if isinstance(last.get("content"), str):
            last["content"] = [{"type": "text", "text": last["content"]}]
        if isinstance(last.get("content"), list) and last["content"]:
            spots.append((last["content"], len(last["content"]) - 1))
    for blocks, j in reversed(spots):
        if _append_marker(blocks[j]):
            return req.model_copy(update={"system": system, "messages": messages})
    return None


def _marked(block) -> bool:
    return isinstance(block, dict) and bool(block.get("cache_control"))


def _append_marker(block: dict) -> bool:
    """Put MARKER at the end of a text or tool_result block's text; False for others."""
    kind = block.get("type")
    if kind == "text" and isinstance(block.get("text"), str):
        block["text"] += MARKER
        return True
    if kind != "tool_result":
        return False
    content = block.get("content", "")
    if isinstance(content, str):
        block["content"] = content + MARKER
        return True
    if not isinstance(content, list):
        return False
    texts = [b for b in content if isinstance(b, dict) and b.get("type") == "text"]
    if texts and isinstance(texts[-1].get("text"), str):
        texts[-1]["text"] += MARKER
        return True
    return False
