"""The `data:` payloads of a server-sent event stream, read as the SSE spec splits lines
(CR, LF or CRLF only). httpx's `iter_lines` splits like `str.splitlines`, also on U+0085,
U+2028 and U+2029, which a JSON event may carry raw (a model's text, `ensure_ascii=False`)
and which would cut the event in two."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterable, Iterator

import httpx

_EOL = re.compile(rb"\r\n|\r|\n")


def _lines(buffer: bytearray, chunk: bytes) -> list[bytes]:
    buffer += chunk
    *lines, rest = _EOL.split(bytes(buffer))
    buffer[:] = rest
    return lines


def _data(lines: Iterable[bytes]) -> Iterator[str]:
    for line in lines:
        if line.startswith(b"data:"):
            yield line[5:].removeprefix(b" ").decode()


async def aiter_sse_data(response: httpx.Response) -> AsyncIterator[str]:
    buffer = bytearray()
    async for chunk in response.aiter_bytes():
        for data in _data(_lines(buffer, chunk)):
            yield data
    for data in _data([bytes(buffer)]):
        yield data


def iter_sse_data(response: httpx.Response) -> Iterator[str]:
    buffer = bytearray()
    for chunk in response.iter_bytes():
        yield from _data(_lines(buffer, chunk))
    yield from _data([bytes(buffer)])
