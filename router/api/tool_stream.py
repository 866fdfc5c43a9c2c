"""A tool call's arguments streamed as the model writes them, for the tool formats whose
call is a header naming the function followed by the arguments as one JSON object (what
their mlx-lm parsers `json.loads`): the header gives the name (and, for Kimi K2, the id
the parser reads), then every character of the object is passed on as it arrives, up to
the brace that closes it. The other formats' calls are parsed whole at their end marker.
"""

from __future__ import annotations

import regex as re  # partial matches; what mlx-lm's tool parsers import too

# format -> the header before the arguments: group "name", and "id" where the parser has one
_HEADERS = {
    "json_tools": re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]+)"\s*,\s*"arguments"\s*:'),
    "mistral": re.compile(r"\s*(?P<name>[\w-]+)\s*\[ARGS\]"),
    "kimi_k2": re.compile(
        r"\s*<\|tool_call_begin\|>\s*(?P<id>(?:functions\.)?(?P<name>.+?):\d+)\s*"
        r"<\|tool_call_argument_begin\|>"
    ),
}


def streams_arguments(kind: str | None) -> bool:
    return kind in _HEADERS


class ArgumentStream:
    """Fed a call's text as it grows; `name` is set once the header is complete, after
    which `advance` returns each new piece of the arguments' JSON."""

    def __init__(self, kind: str):
        self.header = _HEADERS[kind]
        self.name: str | None = None
        self.id: str | None = None
        self.start = -1  # where the arguments begin in the call's text
        self.scanned = 0  # how far the arguments were scanned (and passed on)
        self.depth, self.in_string, self.escaped = 0, False, False
        self.done = False  # the object closed
        self.abandoned = False  # not this shape: the call is parsed whole at its end

    @property
    def arguments(self) -> str:
        return self.text[self.start : self.scanned] if self.start >= 0 else ""

    def advance(self, text: str) -> str:
        """The new piece of the arguments in `text` (the call's text so far)."""
        self.text = text
        if self.abandoned or self.done:
            return ""
        if self.name is None and not self._read_header(text):
            return ""
        if self.start < 0:
            rest = text[self.scanned :]
            if not rest.strip():
                return ""
            self.start = self.scanned = self.scanned + len(rest) - len(rest.lstrip())
            if text[self.start] != "{":
                self.abandoned = True
                return ""
        before = self.scanned
        while self.scanned < len(text) and not self.done:
            self._scan(text[self.scanned])
            self.scanned += 1
        return text[before : self.scanned]

    def _read_header(self, text: str) -> bool:
        match = self.header.match(text)
        if match is None:
            # a header that cannot become this one (the text already runs past it): give up
            self.abandoned = self.header.match(text, partial=True) is None
            return False
        self.name, self.id = match.group("name"), match.groupdict().get("id")
        self.scanned = match.end()
        return True

    def _scan(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.done = self.depth == 0
