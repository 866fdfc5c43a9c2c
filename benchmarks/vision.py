"""Images through a real server: what a conversation that opened with an image pays on its
second turn, and what image rows cost the text rows decoding beside them.

    python -m benchmarks.vision [--arch qwen2_5_vl] [--preset medium] [--image-tokens 1024]
                                [--rounds 4]

On the tiny VLM builder's model (random weights, `--image-tokens` image tokens per
picture), through the OpenAI chat API with streaming, every figure a ratio against a
baseline measured in the same run, rounds alternating:

- **second turn ÷ first turn, TTFT.** A fresh picture and a question (the first turn:
  the image is decoded, preprocessed, through the vision tower, and its run prefilled),
  then the same chat with the answer and a follow-up question (the second turn: the
  radix cache holds the first turn, image included). Target: <= 0.1.
- **text rows' decode step, 8 rows of which 4 carry a new image ÷ 8 text rows.** Eight
  requests sent at once with 64 tokens out (`ignore_eos`): four short text rows, and four
  rows carrying a picture never seen before (their tower runs and their runs are
  prefilled while the text rows decode), or four text rows as long as those (the
  baseline: the same contexts without images), or four short ones. The text rows' decode
  step once every row decodes, image rows ÷ long text rows: target <= 1.1. Their time per
  token with the prefill stalls is printed too.

The machine may be shared: ratios, not absolute times, are what to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.serving import ManagedServer
from benchmarks.sse import aiter_sse_data

OUT = 64
TURN_SEED, BATCH_SEED = 1_000, 2_000  # pictures never repeat between the two measures


def picture(seed: int, side: int) -> str:
    """A seeded random PNG as a data: URL."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(url: str, question: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    return {"role": "user", "content": parts}


async def stream(client: httpx.AsyncClient, messages: list, out: int) -> tuple[list[float], str]:
    """(arrival times of the streamed content deltas, perf_counter's; the answer's text),
    the send's time first."""
    body = {"messages": messages, "max_tokens": out, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    times, text = [time.perf_counter()], []
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for data in aiter_sse_data(resp):
            if data.strip() == "[DONE]":
                break
            chunk = json.loads(data)
            delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if delta:
                times.append(time.perf_counter())
                text.append(delta)
    return times, "".join(text)


async def turns(client: httpx.AsyncClient, seed: int, side: int) -> tuple[float, float]:
    """TTFT of a conversation's first turn (a new picture) and of its second."""
    first = [image_message(picture(TURN_SEED + seed, side), "What is in the picture?")]
    times, answer = await stream(client, first, 16)
    second = first + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And what colours does it have?"},
    ]
    again, _ = await stream(client, second, 16)
    return times[1] - times[0], again[1] - again[0]


def long_text(tokenizer, n: int, seed: int) -> str:
    """A user message of about `n` tokens of seeded random words."""
    rng = np.random.default_rng(seed)
    words = [f"w{x}" for x in rng.integers(0, 10_000, n)]
    while len(tokenizer.encode(" ".join(words))) > n:
        words = words[: -max(1, len(words) // 50)]
    return " ".join(words)


async def batch(client: httpx.AsyncClient, seed: int, rows03: list) -> tuple[float, float]:
    """Rows 4-7 (short text) decoding beside rows 0-3 (`rows03`, their messages), all
    sent at once: the text rows' decode step, the median gap between their tokens once
    every row decodes (after rows 0-3's first token), so rows 0-3's prefill is not in it;
    and their time per token from the first to the last, the stalls for it included."""
    rows = list(rows03) + [
        [{"role": "user", "content": f"Row {k} of round {seed}: tell a story."}]
        for k in range(4, 8)
    ]
    got = await asyncio.gather(*[stream(client, m, OUT) for m in rows])
    decoding = max(t[1] for t, _ in got[:4])
    gaps = [b - a for t, _ in got[4:] for a, b in zip(t[1:], t[2:]) if a >= decoding]
    tpot = statistics.median((t[-1] - t[1]) / (len(t) - 2) for t, _ in got[4:])
    return statistics.median(gaps), tpot


def companions(kind: str, seed: int, side: int, tok, n: int) -> list:
    """Rows 0-3 of a batch: new pictures, text as long as their prompts (`n` tokens), or
    short text."""
    if kind == "image":
        return [[image_message(picture(BATCH_SEED + seed * 8 + k, side), f"Pic {k}?")]
                for k in range(4)]  # fmt: skip
    if kind == "long":
        return [[{"role": "user", "content": long_text(tok, n, seed * 8 + k)}] for k in range(4)]
    return [[{"role": "user", "content": f"Row {k} of round {seed}: a story."}] for k in range(4)]


KINDS = ("short", "long", "image")


async def run(args) -> None:
    from transformers import AutoTokenizer

    from common.tiny_vlm import ensure_tiny_vlm

    model = str(ensure_tiny_vlm(arch=args.arch, preset=args.preset, image_tokens=args.image_tokens))
    tok = AutoTokenizer.from_pretrained(model)
    side = 28 * int(args.image_tokens**0.5)  # a square picture of about that many tokens
    server = ManagedServer("radix-mlx", model, Path(args.logs), [])
    ep = await asyncio.to_thread(server.start)
    try:
        async with httpx.AsyncClient(base_url=ep.url, timeout=600) as client:
            await turns(client, 999, side)  # warm-up: compiles, loads the processor
            await batch(client, 999, companions("image", 999, side, tok, 0))
            ratios, steps = [], {k: [] for k in KINDS}
            for r in range(args.rounds):
                first, second = await turns(client, r, side)
                ratios.append(second / first)
                got = {}
                for kind in KINDS[:: 1 if r % 2 == 0 else -1]:  # the order alternates
                    rows = companions(kind, r, side, tok, args.image_tokens + 12)
                    got[kind] = await batch(client, r, rows)
                for kind in KINDS:
                    steps[kind].append(got[kind])
                print(f"round {r + 1}: TTFT first turn {first * 1e3:.1f} ms, second "
                      f"{second * 1e3:.1f} ms ({second / first:.3f}x); text rows' step / "
                      f"time per token beside 4 rows of short text "
                      + ", ".join(f"{kind}: {s * 1e3:.1f} / {t * 1e3:.1f} ms"
                                  for kind, (s, t) in got.items()), flush=True)  # fmt: skip
    finally:
        server.stop()

    def ratio(kind: str, base: str, at: int) -> float:
        return statistics.median(a[at] / b[at] for a, b in zip(steps[kind], steps[base]))

    print(f"median over {args.rounds} rounds: second/first turn TTFT "
          f"{statistics.median(ratios):.3f} (target <= 0.1); the text rows' decode step "
          f"beside 4 new image rows / beside 4 text rows as long {ratio('image', 'long', 0):.3f} "
          f"(target <= 1.1), / beside 4 short text rows {ratio('image', 'short', 0):.3f}; "
          f"their time per token, prefill stalls included, {ratio('image', 'long', 1):.3f} "
          f"and {ratio('image', 'short', 1):.3f}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen2_5_vl")
    p.add_argument("--preset", default="medium")
    p.add_argument("--image-tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--logs", default="bench_results/logs")
    asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    main()
