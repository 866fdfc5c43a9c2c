"""From the chunks of one or more generations to an HTTP response: a JSON body or
server-sent events. Each generation is one choice of the response (`n` samples of a prompt,
or a batch of prompts); the choices run concurrently and a client that goes away aborts
them all upstream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from common.messages import Output
from router.api.openai_api import error_body, usage
from router.output import OutputAccumulator
from router.request_error import RequestError


@dataclass
class Choice:
    """One generation of a response: its chunks, how a chunk renders (a response body
    with this choice alone), the prompt it answers (usage counts each prompt once) and the
    text echoed before it."""

    chunks: AsyncIterator[Output]
    render: Callable[[Output, str], dict]
    prompt: int = 0
    prefix: str = ""


async def collect(request: Request, choices: list[Choice]) -> dict:
    """The whole response body; 499 if the client goes away first."""
    tasks = [asyncio.ensure_future(_collect(c)) for c in choices]
    try:
        done = await _unless_disconnected(request, asyncio.gather(*tasks))
    finally:
        await _cancel(tasks)  # one failed, or the client left: the others stop too
    bodies = [body for body, _ in done]
    body = bodies[0]
    body["choices"] = [b["choices"][0] for b in bodies]
    body["usage"] = _usage(choices, [whole for _, whole in done])
    return body


async def _collect(choice: Choice) -> tuple[dict, Output]:
    acc = OutputAccumulator()
    async with _closing(choice.chunks):
        async for c in choice.chunks:
            acc.add(c)
    whole = acc.output()
    return choice.render(whole, choice.prefix + whole.text), whole


def _usage(choices: list[Choice], wholes: list[Output]) -> dict:
    """Each prompt counted once, however many choices answer it; every completion."""
    first_of = {c.prompt: i for i, c in reversed(list(enumerate(choices)))}
    prompt = sum(wholes[i].prompt_tokens for i in first_of.values())
    cached = sum(wholes[i].cached_tokens for i in first_of.values())
    return usage(prompt, sum(w.completion_tokens for w in wholes), cached)


async def whole(request: Request, chunks: AsyncIterator[Output]) -> Output:
    """All of one generation; 499 if the client goes away first."""

    async def run() -> Output:
        acc = OutputAccumulator()
        async with _closing(chunks):
            async for c in chunks:
                acc.add(c)
        return acc.output()

    return await _unless_disconnected(request, run())


async def first_chunk(request: Request, chunks: AsyncIterator[Output]) -> Output:
    """The first chunk of a generation about to stream, so early errors get a 4xx."""
    try:
        return await _unless_disconnected(request, anext(chunks))
    except BaseException:
        await aclose_shielded(chunks)
        raise


async def stream(request: Request, choices: list[Choice], include_usage: bool):
    """Server-sent events; every choice's first chunk is awaited first, so early errors
    get a 4xx.

    Chunks whose text is still held back (half a character, a possible stop string) are
    not sent on their own: their token ids ride along with the choice's next chunk that
    has text.
    """
    starts = [asyncio.ensure_future(anext(c.chunks)) for c in choices]
    try:
        firsts = await _unless_disconnected(request, asyncio.gather(*starts))
    except BaseException:
        await _cancel(starts)  # a generator cannot be closed while one of them reads it
        for c in choices:
            await aclose_shielded(c.chunks)
        raise

    async def events():
        accs = [OutputAccumulator() for _ in choices]
        merged = _interleaved([c.chunks for c in choices])
        try:
            for choice, acc, first in zip(choices, accs, firsts):
                if choice.prefix:
                    yield _event(choice.render(_textual(choice.prefix), choice.prefix))
                acc.add(first)
                yield _event(_increment(choice, acc))
            async for i, c in merged:
                accs[i].add(c)
                if c.text or c.finish_reason is not None:
                    yield _event(_increment(choices[i], accs[i]))
            if include_usage:
                body = choices[0].render(_textual(""), "")
                body["choices"] = []
                body["usage"] = _usage(choices, [acc.output() for acc in accs])
                yield _event(body)
        except RequestError as exc:
            yield _event(error_body(exc.message, exc.code, exc.status, exc.param))
        finally:
            await aclose_shielded(merged)  # its readers stop before their streams close
            for c in choices:
                await aclose_shielded(c.chunks)
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _interleaved(
    streams: list[AsyncIterator[Output]],
) -> AsyncIterator[tuple[int, Output]]:
    """(index, chunk) of several streams as they come; one stream is read directly."""
    if len(streams) == 1:
        async for c in streams[0]:
            yield 0, c
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, chunks: AsyncIterator[Output]) -> None:
        try:
            async for c in chunks:
                await queue.put((i, c))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, exc))
        await queue.put((i, None))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        await _cancel(pumps)


def _increment(choice: Choice, acc: OutputAccumulator) -> dict:
    """The choice's chunks since its previous event, as one."""
    part = acc.take()
    return choice.render(part, part.text)


def _textual(text: str) -> Output:
    """An output of text alone: the echoed prompt, or nothing."""
    return Output(text, [], None, 0, 0, 0)


async def _until_disconnected(request: Request) -> None:
    """Returns when the client goes away (after the body was read, uvicorn's `receive`
    only answers with `http.disconnect`)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable):
    """Await `work`; if the client disconnects first, cancel it (which aborts the request
    upstream) and answer 499, which nobody will read."""
    # a Task ends cancelled when cancelled; a bare gather would end with an error instead
    task = asyncio.ensure_future(_awaited(work))
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            await _cancel([task])
    if task.cancelled():
        raise RequestError("client closed the request", "client_closed_request", 499)
    return task.result()


async def _awaited(work: Awaitable):
    return await work


async def _cancel(tasks: list[asyncio.Future]) -> None:
    """Cancel what is still running and wait for it, even from a cancelled task."""
    for t in tasks:
        t.cancel()
    with anyio.CancelScope(shield=True):
        await asyncio.gather(*tasks, return_exceptions=True)


class _closing:
    """`contextlib.aclosing` whose close survives a cancelled task."""

    def __init__(self, gen):
        self.gen = gen

    async def __aenter__(self):
        return self.gen

    async def __aexit__(self, *exc):
        await aclose_shielded(self.gen)


async def aclose_shielded(gen) -> None:
    """Close an async generator, even from a cancelled task."""
    with anyio.CancelScope(shield=True):
        await gen.aclose()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
