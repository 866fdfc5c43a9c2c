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
  requests sent at once with 64 tokens out (`ignore_eos`); the text rows' median time
  per output token after the first, with four of the rows carrying a picture never seen before
  (their tower runs and their runs are prefilled in the same steps) against all eight
  text. Target: <= 1.1.

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


async def batch(client: httpx.AsyncClient, seed: int, side: int, images: int) -> float:
    """The text rows' decode step and time per output token, 8 rows at once, `images` of
    them with a picture never sent before. The step: the median gap between the text
    rows' tokens once every row of the batch is decoding (after rows 0-3's first token,
    in both batches), so the image rows' prefill is not in it; the time per token: from
    the first token to the last, the stalls for that prefill included."""
    rows = []
    for k in range(8):
        if k < images:
            rows.append([image_message(picture(BATCH_SEED + seed * 8 + k, side), f"Pic {k}?")])
        else:
            rows.append([{"role": "user", "content": f"Row {k} of round {seed}: tell a story."}])
    got = await asyncio.gather(*[stream(client, m, OUT) for m in rows])
    decoding = max(t[1] for t, _ in got[:4])
    gaps = [b - a for t, _ in got[4:] for a, b in zip(t[1:], t[2:]) if a >= decoding]
    tpot = statistics.median((t[-1] - t[1]) / (len(t) - 2) for t, _ in got[4:])
    return statistics.median(gaps), tpot


async def run(args) -> None:
    from common.tiny_vlm import ensure_tiny_vlm

    model = str(ensure_tiny_vlm(arch=args.arch, preset=args.preset, image_tokens=args.image_tokens))
    side = 28 * int(args.image_tokens**0.5)  # a square picture of about that many tokens
    server = ManagedServer("radix-mlx", model, Path(args.logs), [])
    ep = await asyncio.to_thread(server.start)
    try:
        async with httpx.AsyncClient(base_url=ep.url, timeout=600) as client:
            await turns(client, 999, side)  # warm-up: compiles, loads the processor
            await batch(client, 999, side, 4)
            ratios, steps, tpots = [], [], []
            for r in range(args.rounds):
                first, second = await turns(client, r, side)
                ratios.append(second / first)
                order = (0, 4) if r % 2 == 0 else (4, 0)  # which batch goes first alternates
                got = {n: await batch(client, r, side, n) for n in order}
                (step0, tpot0), (step4, tpot4) = got[0], got[4]
                steps.append(step4 / step0)
                tpots.append(tpot4 / tpot0)
                print(f"round {r + 1}: TTFT first turn {first * 1e3:.1f} ms, second "
                      f"{second * 1e3:.1f} ms ({second / first:.3f}x); text rows' step "
                      f"{step0 * 1e3:.2f} ms text-only, {step4 * 1e3:.2f} ms beside 4 new "
                      f"image rows ({step4 / step0:.3f}x); their time per token "
                      f"{tpot0 * 1e3:.2f} and {tpot4 * 1e3:.2f} ms ({tpot4 / tpot0:.3f}x)",
                      flush=True)  # fmt: skip
    finally:
        server.stop()
    print(f"median over {args.rounds} rounds: second/first turn TTFT "
          f"{statistics.median(ratios):.3f} (target <= 0.1); text rows' decode step with "
          f"image rows / text-only {statistics.median(steps):.3f} (target <= 1.1); their "
          f"time per token, prefill stalls included, {statistics.median(tpots):.3f}")  # fmt: skip


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
