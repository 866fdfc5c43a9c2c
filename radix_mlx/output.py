"""One request's output chunks merged into one `Output`: the whole so far, or what came
since it was last taken. Used alike by the HTTP API (a response body, a stream's events),
the SDK front door (a streamed increment or the whole answer) and the SDK client.

Logprobs are per output token, 1:1 with the output's token ids. An output carries them
when the request has them (some chunk carried a list) and every one of its chunks with
tokens carried exactly one logprob and one list of alternatives per token; otherwise they
are None, never a list that is shorter than the token ids or shifted against them.
"""

from __future__ import annotations

from radix_mlx.messages import Output


class OutputAccumulator:
    """Feed a request's chunks in order with `add`; `output()` is everything so far,
    `take()` what came since the previous `take` (for streams that send increments).
    Either way `finish_reason` is the last chunk's, `prompt_tokens` and `cached_tokens`
    the latest chunk's, and `completion_tokens` counts every token added."""

    def __init__(self) -> None:
        self.chunks: list[Output] = []
        self.taken = 0  # chunks already returned by take()
        self.completion_tokens = 0
        self.has_logprobs = False  # some chunk carried them: the request asked

    def add(self, chunk: Output) -> None:
        self.chunks.append(chunk)
        self.completion_tokens += len(chunk.token_ids)
        self.has_logprobs = self.has_logprobs or chunk.logprobs is not None

    def output(self) -> Output:
        return self._merged(self.chunks)

    def take(self) -> Output:
        part = self._merged(self.chunks[self.taken :])
        self.taken = len(self.chunks)
        return part

    def _merged(self, chunks: list[Output]) -> Output:
        latest = self.chunks[-1] if self.chunks else None
        aligned = self.has_logprobs and all(_per_token(c) for c in chunks if c.token_ids)
        return Output(
            text="".join(c.text for c in chunks),
            token_ids=[t for c in chunks for t in c.token_ids],
            finish_reason=chunks[-1].finish_reason if chunks else None,
            prompt_tokens=latest.prompt_tokens if latest else 0,
            completion_tokens=self.completion_tokens,
            cached_tokens=latest.cached_tokens if latest else 0,
            logprobs=[x for c in chunks for x in c.logprobs or []] if aligned else None,
            top_logprobs=[x for c in chunks for x in c.top_logprobs or []] if aligned else None,
            prompt_logprobs=next(
                (c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None
            ),
        )


def _per_token(chunk: Output) -> bool:
    """Whether the chunk carries one logprob and one list of alternatives per token."""
    n = len(chunk.token_ids)
    lps, tops = chunk.logprobs, chunk.top_logprobs
    return lps is not None and tops is not None and len(lps) == n and len(tops) == n
