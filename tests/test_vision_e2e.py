"""Images through a real server on the tiny Qwen2.5-VL: the official openai and anthropic
SDKs send them, the answers are mlx-vlm's own greedy tokens, a repeated image is served
from the radix cache (its run of pad values) and another image at the same place is not,
and every bad image part gets a 400 naming it."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import time

import anthropic
import httpx
import openai
import pytest

from common.tiny_vlm import ensure_tiny_vlm
from router.metrics import PREFIX
from tests.conftest import load_vlm, random_image, vlm_greedy
from tests.server import ServerProcess
from tests.test_metrics import scrape
from tests.vision_prompts import IMAGE, Prompt, chat, png, text
from worker_mlx.vision_model import VisionLanguageModel

pytestmark = pytest.mark.slow
N = 8
QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def server(tiny_vlm, tmp_path_factory):
    log = tmp_path_factory.mktemp("vision") / "server.log"
    proc = ServerProcess(
        tiny_vlm,
        log,
        extra=["--max-total-tokens", "4096", "--max-image-bytes", "200000"]
        + ["--max-request-bytes", str(32 << 20)],  # so a 20 MB image reaches the image check
    )
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "gemma3"])
def family(request, model_cache, tmp_path_factory):
    """(model path, openai client) of a server for each family (Qwen2.5-VL's is `server`)."""
    if request.param == "qwen2_5_vl":
        path = request.getfixturevalue("tiny_vlm")
        yield path, request.getfixturevalue("oai")
        return
    path = str(ensure_tiny_vlm(model_cache, arch=request.param))
    log = tmp_path_factory.mktemp(request.param) / "server.log"
    proc = ServerProcess(path, log, extra=["--max-total-tokens", "2048"])
    proc.start()
    try:
        with openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0) as client:
            yield path, client
    finally:
        proc.stop()


def _data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def _ask(oai, image, question: str = QUESTION, url: str | None = None):
    content = [
        {"type": "image_url", "image_url": {"url": url or _data_url(image)}},
        {"type": "text", "text": question},
    ]
    return oai.chat.completions.create(
        model=oai.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        max_tokens=N,
        temperature=0,
    )


def test_openai_sdk_image_parity_and_cache(family):
    """Each family: mlx-vlm's tokens cold, from the cache (cached_tokens cover the image),
    and for another image at the same place (only the text before it is reused)."""
    tiny_vlm, oai = family
    picture, other = random_image(20), random_image(21)
    want = vlm_greedy(tiny_vlm, chat(IMAGE, text(QUESTION)), [picture], N)
    first = _ask(oai, picture)
    assert first.choices[0].token_ids == want
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = _ask(oai, picture)
    assert again.choices[0].token_ids == want
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    # another image at the same place: only the text before it is reused
    swapped = _ask(oai, other)
    assert swapped.choices[0].token_ids == vlm_greedy(
        tiny_vlm, chat(IMAGE, text(QUESTION)), [other], N
    )
    assert swapped.usage.prompt_tokens_details.cached_tokens == _run_start(tiny_vlm, picture)


def _vision_counts(url: str, before: tuple | None = None) -> tuple[float, float]:
    """(tower runs, tower-cache hits) from /metrics; with `before`, once they moved from it
    (the scheduler reports every 0.5 s)."""
    names = [PREFIX + "vision_tower_runs_total", PREFIX + "vision_cache_hits_total"]
    deadline = time.monotonic() + 10
    while True:
        series = scrape(url)
        counts = tuple(series.get(n, 0.0) for n in names)
        if before is None or counts != before or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def test_a_resent_image_whose_kv_was_evicted_skips_the_tower(family):
    """Each family: the image's KV evicted by other prompts (twice the tokens the pool
    holds), the same image again runs no tower (the metrics' counters say so: a cache
    hit, no run), its cached tokens stop before the image, and the tokens are mlx-vlm's."""
    tiny_vlm, oai = family
    url = str(oai.base_url).removesuffix("/v1/")
    picture = random_image(40)
    runs, hits = _vision_counts(url)
    first = _ask(oai, picture)
    assert _vision_counts(url, (runs, hits)) == (runs + 1, hits)
    # twice the pool: the leaves older than the picture's are not all the eviction takes
    capacity = 2 * scrape(url)[PREFIX + "kv_pool_capacity_tokens"]
    filler = " ".join(f"word{k}" for k in range(200))
    model = oai.models.list().data[0].id
    while capacity > 0:
        ask = [{"role": "user", "content": f"{capacity} {filler}"}]
        done = oai.chat.completions.create(model=model, messages=ask, max_tokens=1)
        capacity -= done.usage.prompt_tokens
    again = _ask(oai, picture)
    assert again.usage.prompt_tokens_details.cached_tokens <= _run_start(tiny_vlm, picture)
    assert _vision_counts(url, (runs + 1, hits)) == (runs + 1, hits + 1)
    assert (
        again.choices[0].token_ids
        == first.choices[0].token_ids
        == vlm_greedy(tiny_vlm, chat(IMAGE, text(QUESTION)), [picture], N)
    )


def _span(path: str, image):
    vlm, processor = load_vlm(path)
    model = VisionLanguageModel(vlm, vlm.config.model_type)
    return Prompt(model, processor, chat(IMAGE, text(QUESTION)), [image]).spans[0]


def _run_start(path: str, image) -> int:
    """How many prompt tokens come before the image's run (the chat's opening text)."""
    return _span(path, image).start


def _run_end(path: str, image) -> int:
    span = _span(path, image)
    return span.start + span.length


def test_anthropic_sdk_sends_an_image(tiny_vlm, server):
    picture = random_image(22)
    source = {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(png(picture)).decode(),
    }
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as claude:
        reply = claude.messages.create(
            model=_model(server),
            max_tokens=N,
            extra_body={"temperature": 0.0},
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": source},
                        {"type": "text", "text": QUESTION},
                    ],
                }
            ],
        )
    want = vlm_greedy(tiny_vlm, chat(IMAGE, text(QUESTION)), [picture], N)
    assert reply.usage.output_tokens == N
    assert reply.content[0].text == _decode(tiny_vlm, want)


def test_responses_sdk_sends_an_input_image(tiny_vlm, oai):
    """The Responses API's input_image part goes through the chat's image pipeline: the
    answer is mlx-vlm's, a repeat is served from the cache, a follow-up by
    previous_response_id is mlx-vlm's answer to the whole conversation with the image
    from the cache, a bad detail is a 400."""
    picture = random_image(27)
    content = [
        {"type": "input_image", "image_url": _data_url(picture), "detail": "low"},
        {"type": "input_text", "text": QUESTION},
    ]
    model = oai.models.list().data[0].id

    def ask(parts, **extra):
        return oai.responses.create(
            model=model, input=[{"role": "user", "content": parts}], max_output_tokens=N,
            temperature=0.0, **({"store": False} | extra),
        )  # fmt: skip

    first, again = ask(content), ask(content, store=True)
    want = vlm_greedy(tiny_vlm, chat(IMAGE, text(QUESTION)), [picture], N)
    assert first.output_text == again.output_text == _decode(tiny_vlm, want)
    assert first.usage.input_tokens_details.cached_tokens <= _run_start(tiny_vlm, picture)
    assert again.usage.input_tokens_details.cached_tokens == again.usage.input_tokens - 1
    with pytest.raises(openai.BadRequestError) as bad:
        ask([{**content[0], "detail": "huge"}, content[1]])
    assert bad.value.body["param"] == "input[0].content[0].detail"
    follow = oai.responses.create(
        model=model, previous_response_id=again.id, input="And the colours?",
        max_output_tokens=N, temperature=0.0,
    )  # fmt: skip
    ref = chat(IMAGE, text(QUESTION)) + [
        {"role": "assistant", "content": again.output_text},
        {"role": "user", "content": "And the colours?"},
    ]
    assert follow.output_text == _decode(tiny_vlm, vlm_greedy(tiny_vlm, ref, [picture], N))
    assert follow.usage.input_tokens_details.cached_tokens > _run_end(tiny_vlm, picture)


def _model(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def _decode(path: str, ids: list[int]) -> str:
    from tests.conftest import load_vlm

    return load_vlm(path)[1].tokenizer.decode(ids, skip_special_tokens=True)


def _encoded(image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def _b64(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_bad_images_get_a_400_naming_the_part(server, tmp_path):
    tiff = _encoded(random_image(23), "TIFF")
    (tmp_path / "a.png").write_bytes(png(random_image(24)))
    small = _b64(png(random_image(25, 30, 30)))
    cases = [  # (the image part's url, or several parts; the message's needle)
        ("data:image/png;base64,@@not base64@@", "base64 does not decode"),
        (_b64(b"hello, not an image"), "not an image"),
        (_b64(tiff, "image/tiff"), "TIFF images are not served"),
        ("https://example.com/cat.png", "--allow-image-urls"),
        ("ftp://example.com/cat.png", "must be data:, file: or http(s)"),
        (_b64(b"\0" * (20 << 20)), "more than --max-image-bytes (200000)"),  # 20 MB
        ([small] * 9, "9 images, more than --max-images-per-request (8)"),
    ]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        model = _model(server)
        for url, needle in cases:
            urls = url if isinstance(url, list) else [url]
            parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
            body = {"model": model, "messages": [{"role": "user", "content": parts}]}
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (needle, r.text)
            err = r.json()["error"]
            assert needle in err["message"], err
            assert err["param"] == f"messages[0].content[{8 if len(urls) > 8 else 0}]"
        # a file: URL is read on the server; the server still answers after all of these
        part = {"type": "image_url", "image_url": {"url": f"file://{tmp_path / 'a.png'}"}}
        body = {"model": model, "messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        # Anthropic's image source, named in its own path style
        block = {"type": "image", "source": {"type": "file", "file_id": "x"}}
        body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [block]}]}
        r = http.post("/v1/messages", json=body)
        assert r.status_code == 400 and "messages.0.content.0.source" in r.text


def test_multi_turn_and_a_mixed_batch_of_8(tiny_vlm, oai):
    """The second turn reuses the first turn's image from the cache; eight requests at
    once, half with an image, each get mlx-vlm's own tokens."""
    picture = random_image(26)
    url = {"type": "image_url", "image_url": {"url": _data_url(picture)}}
    first = [{"role": "user", "content": [url, {"type": "text", "text": QUESTION}]}]
    model = oai.models.list().data[0].id
    one = oai.chat.completions.create(model=model, messages=first, max_tokens=N, temperature=0)
    answer = one.choices[0].message.content
    second = first + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And the colours?"},
    ]
    two = oai.chat.completions.create(model=model, messages=second, max_tokens=N, temperature=0)
    ref = chat(IMAGE, text(QUESTION)) + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And the colours?"},
    ]
    assert two.choices[0].token_ids == vlm_greedy(tiny_vlm, ref, [picture], N)
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens

    def ask(k: int):
        if k % 2:
            return _ask(oai, random_image(30 + k), f"Picture {k}?").choices[0].token_ids
        messages = [{"role": "user", "content": f"Question number {k}, no picture."}]
        reply = oai.chat.completions.create(
            model=model, messages=messages, max_tokens=N, temperature=0
        )
        return reply.choices[0].token_ids

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    for k, tokens in enumerate(got):
        if k % 2:
            want = vlm_greedy(
                tiny_vlm, chat(IMAGE, text(f"Picture {k}?")), [random_image(30 + k)], N
            )
        else:
            want = vlm_greedy(
                tiny_vlm, [{"role": "user", "content": f"Question number {k}, no picture."}], [], N
            )
        assert tokens == want, k
