"""How a text completion's choice renders: OpenAI's `text_completion` body (or its
streamed increments), with logprobs whose text offsets count from the start of the
choice's text, an echoed prompt included."""

from __future__ import annotations

from collections.abc import Callable

from common.messages import Output
from router.api.openai_api import TokenPieces, completion_logprobs, with_prompt


class CompletionRenderer:
    """render(chunk, text) -> a response body with this choice; `body(kind, choice)` wraps
    the choice. Streaming, each call renders the text since the previous one, so the
    renderer keeps the offset the next text starts at."""

    def __init__(
        self,
        index: int,
        prompt_ids: list[int],
        logprobs: bool,
        pieces: TokenPieces,
        body: Callable[[str, dict], dict],
    ):
        self.index, self.prompt_ids, self.logprobs = index, prompt_ids, logprobs
        self.pieces, self.body = pieces, body
        self.offset = 0  # text offset of the next text rendered

    def __call__(self, c: Output, text: str) -> dict:
        lp = None
        if self.logprobs and (c.token_ids or c.prompt_logprobs is not None):
            start = self.offset + len(text) - len(c.text)  # after an echoed prompt
            lp = completion_logprobs(c.token_ids, c.logprobs, c.top_logprobs, self.pieces, start)
            if c.prompt_logprobs is not None:
                lp = with_prompt(self.prompt_ids, c.prompt_logprobs, lp, self.pieces)
        self.offset += len(text)
        choice = {"index": self.index, "text": text, "logprobs": lp}
        choice["finish_reason"], choice["token_ids"] = c.finish_reason, c.token_ids
        return self.body("text_completion", choice)
