"""HTTP fuzzing with schemathesis against the server's own OpenAPI schema (FastAPI
publishes it at /openapi.json): every generated request gets a 2xx, or a 4xx with an
OpenAI error body (Anthropic's on /v1/messages); never a 5xx, a hang or a dead process.
A bounded number of examples per operation keeps it to seconds."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.conftest import mlx_greedy

pytestmark = pytest.mark.slow
EXAMPLES = 25  # per operation
TIMEOUT = 30  # seconds for any one request: more is a hang


def _operations(url: str) -> list:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def _check(case, server) -> None:
    if case.method == "POST" and isinstance(case.body, dict):
        # short generations: what is fuzzed is the input, not long outputs
        for key in ("max_tokens", "max_completion_tokens", "n"):
            if isinstance(case.body.get(key), int) and case.body[key] > 8:
                case.body[key] = 8
    response = case.call(base_url=server.url, timeout=TIMEOUT)
    assert response.status_code < 500, (case.method, case.path, case.body,
                                        response.status_code, response.text[:500])  # fmt: skip
    if response.status_code >= 400:
        body = response.json()
        if case.path.startswith("/v1/messages"):  # Anthropic's error body
            assert body["type"] == "error" and {"type", "message"} <= set(body["error"]), body
        else:
            assert {"message", "type", "code"} <= set(body["error"]), body
    assert server.proc.poll() is None


def test_no_5xx_no_hang_on_any_operation(tiny_server):
    # schemathesis's own pytest plugin does not run under pytest 9: drive its strategies
    operations = _operations(tiny_server.url)
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    seen = []
    cases = [(op, GenerationMode.POSITIVE) for op in operations]
    cases += [(op, GenerationMode.NEGATIVE) for op in operations if op.method.upper() == "POST"]
    for op, mode in cases:  # an operation without inputs has no invalid ones

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)  # fmt: skip
        def fuzz(case):
            _check(case, tiny_server)
            seen.append(case.path)

        fuzz()
    assert len(seen) >= len(cases)  # every operation, valid and (POST) invalid inputs


def test_still_serving_exactly_after_the_fuzzing(tiny_server, tiny_model):
    prompt = [7, 8, 9, 10]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == mlx_greedy(tiny_model, prompt, 6)
    assert len(tiny_server.children()) >= 2
