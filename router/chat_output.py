"""A chat answer's text split into what the APIs return apart: the answer's content, the
model's reasoning (between its thinking markers) and its tool calls (between its tool-call
markers, parsed with mlx-lm's parser for the model's format).

Text arrives in streamed pieces; a piece that might be the start of a marker is held back
until the next piece (or the end) tells, so no marker ever leaks into the content.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field

from router.chat_format import ChatFormat

logger = logging.getLogger("router")

CONTENT, REASONING, TOOL = "content", "reasoning", "tool"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function"}
        out["function"] = {"name": self.name, "arguments": self.arguments}
        return out if index is None else {"index": index, **out}


@dataclass
class Parts:
    """What one piece of text turned out to be, in order of kind."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class OutputSplitter:
    """Feed the answer's text in order; each `feed` returns what became certain."""

    def __init__(self, fmt: ChatFormat, tools: list | None, thinking: bool):
        self.fmt, self.tools = fmt, tools
        self.state = REASONING if thinking else CONTENT
        self.buffer = ""  # text not yet classified: it may begin a marker
        self.tool_text = ""
        self.calls = 0  # tool calls so far, for finish_reason

    def _markers(self) -> list[tuple[str, str]]:
        """(marker, state it switches to) that can end the current state."""
        fmt = self.fmt
        if self.state == REASONING:
            return [(fmt.think_end, CONTENT)]
        if self.state == TOOL:
            return [(fmt.tool_call_end, CONTENT)] if fmt.tool_call_end else []
        out = []
        if fmt.think_start:
            out.append((fmt.think_start, REASONING))
        if self.tools and fmt.tool_call_start:
            out.append((fmt.tool_call_start, TOOL))
        return out

    def feed(self, text: str, final: bool = False) -> Parts:
        parts = Parts()
        self.buffer += text
        while True:
            hits = [(self.buffer.find(m), m, to) for m, to in self._markers()]
            hits = [h for h in hits if h[0] >= 0]
            if not hits:
                break
            at, marker, to = min(hits)
            self._emit(parts, self.buffer[:at])
            self.buffer = self.buffer[at + len(marker) :]
            if self.state == TOOL:
                self._end_call(parts)
            self.state = to
        keep = 0 if final else _partial_marker(self.buffer, [m for m, _ in self._markers()])
        self._emit(parts, self.buffer[: len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep :]
        if final and self.state == TOOL and self.tool_text.strip():
            self._end_call(parts)  # unterminated (no end marker, or cut short): try it
        return parts

    def _emit(self, parts: Parts, text: str) -> None:
        if self.state == CONTENT:
            parts.content += text
        elif self.state == REASONING:
            parts.reasoning += text
        else:
            self.tool_text += text

    def _end_call(self, parts: Parts) -> None:
        text, self.tool_text = self.tool_text, ""
        try:
            parsed = self.fmt.tool_parser(text, self.tools)
        except Exception as exc:  # noqa: BLE001 - parsers raise what they raise
            logger.warning("unparsable tool call (%s: %s): %r", type(exc).__name__, exc, text)
            parts.content += self.fmt.tool_call_start + text  # the caller sees what came
            return
        for call in parsed if isinstance(parsed, list) else [parsed]:
            arguments = call.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            call_id = call.get("id") or f"call_{uuid.uuid4().hex[:24]}"
            parts.tool_calls.append(ToolCall(call_id, call["name"], arguments))
            self.calls += 1


def _partial_marker(text: str, markers: list[str]) -> int:
    """Length of the longest end of `text` that begins one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def finish_reason(reason: str | None, splitter: OutputSplitter) -> str | None:
    """OpenAI's: a chat that ended by itself after calling tools finished with tool_calls."""
    return "tool_calls" if reason == "stop" and splitter.calls else reason
