"""The memory admission's arithmetic: what a step will hold at its peak, from the worker's
`MemoryReport`, and whether that stays under --max-memory. Pure: no MLX, no sockets.

What the worker holds for its life (`fixed`: weights, KV pool, state pool) is measured by
the worker; what the scheduler decides on top of it is counted here:

- the decode buffer: the running requests' K/V gathered from the pool into one
  left-padded row each, `round_up(longest + 1, 256)` columns, doubled when full, the old
  and the new buffers both alive while it grows (worker_mlx/decode_buffer.py): at most
  rows x 3 x that x `kv_token_bytes`;
- a prefill pass (worker_mlx/extend_pass.py): rows of at most `prefill_step` new tokens after
  a prefix, all read back from the pool, so per pass B x L x C score-and-mask pairs (the
  CPU's attention materialises the (B, H, L, C) scores), B x C gathered tokens, B x L
  tokens of activations and B sampled rows; the worst pass of an extend is its last round
  (the longest context), and rows are counted as if they shared that pass;
- a decode step: one query per row over the buffer's columns, activations and logits.

An extend step holds the running requests' decode buffer too (it stays alive).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.messages import MemoryReport, ReqError
from common.sizes import format_size
from scheduler.request import Req

GROW_STEP = 256  # the decode buffer's column rounding (DecodeBuffer.GROW_STEP)
BUFFER_COPIES = 3  # doubled capacity, plus the old buffer while it grows
MIN_CHUNK = 32  # the smallest prefill chunk admission shrinks a prompt's chunk to
RETRY_AFTER = 5.0  # seconds, the Retry-After of a 503 for want of memory


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclass(frozen=True)
class MemoryBudget:
    report: MemoryReport

    @property
    def headroom(self) -> int:
        """Bytes the steps may use beyond what the worker holds for good."""
        return self.report.budget - self.report.fixed

    # ------------------------------------------------------------ what steps hold

    def buffer_bytes(self, rows: int, longest: int) -> int:
        """The decode buffer of `rows` running requests, the longest `longest` tokens."""
        if rows == 0:
            return 0
        columns = _round_up(longest + 1, GROW_STEP)
        return rows * BUFFER_COPIES * columns * self.report.kv_token_bytes

    def decode_bytes(self, lens: list[int]) -> int:
        """A decode step of rows at these sequence lengths: its buffer and temporaries."""
        if not lens:
            return 0
        r = self.report
        columns = _round_up(max(lens) + 1, GROW_STEP)
        step = len(lens) * (columns * r.score_bytes + r.act_token_bytes + r.row_bytes)
        return self.buffer_bytes(len(lens), max(lens)) + step

    def extend_bytes(self, rows: list[tuple[int, int]]) -> int:
        """A prefill step's worst pass for rows of (tokens before, new tokens)."""
        if not rows:
            return 0
        r = self.report
        B = len(rows)
        L = min(r.prefill_step, max(new for _, new in rows))
        C = max(before + new for before, new in rows)
        return B * (L * C * r.score_bytes + C * r.kv_token_bytes + L * r.act_token_bytes) + (
            B * r.row_bytes
        )

    def whole_prompt_bytes(self, running: list[int], n: int) -> int:
        """The prompt-logprobs pass (worker_mlx/prompt_logprobs.py): the whole prompt of
        `n` tokens once more, in one pass without a cache, beside the running requests."""
        r = self.report
        whole = n * (n * r.score_bytes + r.kv_token_bytes + r.act_token_bytes) + r.row_bytes
        return self.buffer_bytes(len(running), max(running, default=0)) + whole

    def step_bytes(self, running: list[int], extend: list[tuple[int, int]]) -> int:
        """An extend step beside running requests of `running` lengths."""
        longest = max(running, default=0)
        return self.buffer_bytes(len(running), longest) + self.extend_bytes(extend)

    # ------------------------------------------------------------ decisions

    def largest_chunk(
        self, running: list[int], picked: list[tuple[int, int]], before: int, new: int
    ) -> int:
        """The most of `new` tokens after `before` that fit beside the running requests
        and the rows already picked for this step (0: not even MIN_CHUNK, or all of a
        shorter remainder)."""

        def fits(take: int) -> bool:
            step = self.step_bytes(running, picked + [(before, take)])
            return step <= self.headroom

        smallest = min(MIN_CHUNK, new)
        if not fits(smallest):
            return 0
        lo, hi = smallest, new
        while lo < hi:  # the largest take that fits (the bytes grow with it)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def over(self, lens: list[int]) -> bool:
        """Whether a decode step of rows at these lengths would exceed the budget."""
        return self.decode_bytes(lens) > self.headroom

    def can_join(self, decoding: list[int], seq_len: int) -> bool:
        """Whether a request of `seq_len` tokens can decode beside requests of `decoding`
        lengths (those running and those this step's prefill completes): admitting one
        that cannot would only prefill it to retract it at the next decode step."""
        return self.decode_bytes(decoding + [seq_len + 1]) <= self.headroom

    def never_fits(self, prompt: int, max_new: int, whole_prompt: bool = False) -> str | None:
        """Why a request can never run under the budget, even alone, or None: the last
        chunk of its prompt at the smallest size, its last decode step, or (`whole_prompt`:
        it asks for the prompt's logprobs) the prompt's pass in one piece."""
        last = min(MIN_CHUNK, prompt)
        needs = {
            "its prefill": self.extend_bytes([(prompt - last, last)]),
            "its last decode step": self.decode_bytes([prompt + max_new]),
        }
        if whole_prompt:
            needs["its prompt logprobs (the whole prompt in one pass)"] = self.whole_prompt_bytes(
                [], prompt
            )
        what, need = max(needs.items(), key=lambda kv: kv[1])
        if need <= self.headroom:
            return None
        return (
            f"prompt ({prompt} tokens) + max_tokens ({max_new}) needs {format_size(need)} "
            f"for {what}, more than the {format_size(max(self.headroom, 0))} that "
            f"--max-memory ({format_size(self.report.budget)}) leaves beside what the "
            f"worker holds ({format_size(self.report.fixed)}: weights, KV pool, process)"
        )

    def longest_fitting(self, max_new: int = 1, limit: int = 1 << 24) -> int:
        """The longest prompt that can run alone with `max_new` new tokens (0: none)."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.never_fits(mid, max_new) is None else (lo, mid - 1)
        return lo


def waited_too_long(waiting: list[Req], limit: float) -> list[Req]:
    """Waiting requests that admission has found no memory for, for over `limit` s."""
    now = time.monotonic()
    return [r for r in waiting if r.memory_blocked and now - r.memory_blocked > limit]


def wait_error(req: Req, running: int) -> ReqError:
    """The 503 of a request that fits alone but found no room beside the running ones."""
    message = (
        f"not enough memory beside the {running} running request(s) for "
        f"{time.monotonic() - req.arrival:.0f} s (--max-memory); retry later"
    )
    return ReqError(req.rid, message, "insufficient_memory", 503, RETRY_AFTER)
