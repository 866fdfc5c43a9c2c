"""A chat answer's text split into what the APIs return apart: the answer's content, the
model's reasoning (between its thinking markers) and its tool calls (between its tool-call
markers, parsed with mlx-lm's parser for the model's format).

Text arrives in streamed pieces; a piece that might be the start of a marker is held back
until the next piece (or the end) tells, so no marker ever leaks into the content. A tool
call's arguments stream as they are written where the format allows (router.api.tool_stream);
a call is otherwise parsed whole at its end.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field

from router.api.chat_format import ChatFormat
from router.api.tool_stream import ArgumentStream, streams_arguments

logger = logging.getLogger("router")

CONTENT, REASONING, TOOL = "content", "reasoning", "tool"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def openai(self) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass
class ToolDelta:
    """A streamed piece of the `index`th tool call: its id and name on its first piece."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def openai(self) -> dict:
        out = {"index": self.index}
        if self.id is not None:
            out |= {"id": self.id, "type": "function"}
        function = {"arguments": self.arguments}
        return out | {
            "function": function if self.name is None else {"name": self.name, **function}
        }


@dataclass
class Parts:
    """What one piece of text turned out to be, in order of kind: the tool calls complete
    (`tool_calls`, at their end) and as streamed pieces (`tool_deltas`)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_deltas: list[ToolDelta] = field(default_factory=list)


class OutputSplitter:
    """Feed the answer's text in order; each `feed` returns what became certain."""

    def __init__(self, fmt: ChatFormat, tools: list | None, thinking: bool):
        self.fmt, self.tools = fmt, tools
        self.state = REASONING if thinking else CONTENT
        self.buffer = ""  # text not yet classified: it may begin a marker
        self.tool_text = ""
        self.calls = 0  # tool calls so far, for finish_reason
        self.announced = 0  # tool calls whose first delta went out
        self.stream: ArgumentStream | None = None  # the open call's, if its format streams

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
            if to == TOOL and streams_arguments(self.fmt.tool_parser_type):
                self.stream = ArgumentStream(self.fmt.tool_parser_type)
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
            self._stream_arguments(parts)

    def _stream_arguments(self, parts: Parts) -> None:
        stream = self.stream
        if stream is None:
            return
        announced = stream.name is not None
        piece = stream.advance(self.tool_text)
        if stream.name is None:
            return
        if not announced:
            stream.id = stream.id or _new_id()
            parts.tool_deltas.append(ToolDelta(self.announced, stream.id, stream.name, piece))
            self.announced += 1
        elif piece:
            parts.tool_deltas.append(ToolDelta(self.announced - 1, None, None, piece))

    def _end_call(self, parts: Parts) -> None:
        text, self.tool_text = self.tool_text, ""
        stream, self.stream = self.stream, None
        try:
            parsed = self.fmt.tool_parser(text, self.tools)
        except Exception as exc:  # noqa: BLE001 - parsers raise what they raise
            logger.warning("unparsable tool call (%s: %s): %r", type(exc).__name__, exc, text)
            parts.content += self.fmt.tool_call_start + text  # the caller sees what came
            return
        for i, call in enumerate(parsed if isinstance(parsed, list) else [parsed]):
            if i == 0 and stream is not None and stream.name is not None:
                # streamed: the arguments as they were sent, which the parser read as JSON
                parts.tool_calls.append(ToolCall(stream.id, stream.name, stream.arguments))
                self.calls += 1
                continue
            arguments = call.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            tool_call = ToolCall(call.get("id") or _new_id(), call["name"], arguments)
            parts.tool_calls.append(tool_call)
            parts.tool_deltas.append(
                ToolDelta(self.announced, tool_call.id, tool_call.name, tool_call.arguments)
            )
            self.announced += 1
            self.calls += 1


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


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
