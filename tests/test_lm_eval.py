"""lm-eval's `local-completions` model (loglikelihood through `echo` + `logprobs` on
/v1/completions) against a real server on the tiny model, with the local multiple-choice
task in tests/lm_eval_task/: each choice's loglikelihood equals the sum of mlx-lm's own
`log_softmax` over the same tokens within 1e-4.

lm-eval is the `clients` extra's, pinned in pyproject.toml.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from tests.conftest import load_model

pytestmark = pytest.mark.slow
TASK_DIR = Path(__file__).with_name("lm_eval_task")


def mlx_loglikelihood(model_dir: str, context: list[int], continuation: list[int]) -> float:
    """log P(continuation | context) from mlx-lm's logits, in float64."""
    import mlx.core as mx

    model, _ = load_model(model_dir)
    tokens = context + continuation
    logits = np.array(model(mx.array([tokens[:-1]]))[0].astype(mx.float32), dtype=np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    logprobs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    start = len(context) - 1
    return float(sum(logprobs[start + i, t] for i, t in enumerate(continuation)))


def test_multiple_choice_loglikelihoods_equal_mlx_lm(tiny_server, tiny_model, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    # the task, with its data file's absolute path (datasets reads it relative to the cwd)
    config = yaml.safe_load((TASK_DIR / "radix_mlx_choice.yaml").read_text())
    config["dataset_kwargs"]["data_files"]["test"] = str(TASK_DIR / "choice.jsonl")
    (tmp_path / "radix_mlx_choice.yaml").write_text(yaml.safe_dump(config))
    served = httpx.get(tiny_server.url + "/v1/models").json()["data"][0]["id"]
    lm = LocalCompletionsAPI(
        base_url=tiny_server.url + "/v1/completions", model=served, tokenizer=tiny_model,
        tokenizer_backend="huggingface", tokenized_requests=True, max_retries=1, timeout=60,
    )  # fmt: skip
    results = simple_evaluate(
        model=lm, tasks=["radix_mlx_choice"], log_samples=True,
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
    )  # fmt: skip
    samples = results["samples"]["radix_mlx_choice"]
    assert len(samples) == 4
    for sample in samples:
        assert len(sample["resps"]) == 3  # a loglikelihood per choice
        for (context, continuation), [(served, _greedy)] in zip(
            sample["arguments"], sample["resps"]
        ):
            want = mlx_loglikelihood(tiny_model, *lm._encode_pair(context, continuation))
            assert abs(served - want) < 1e-4, (context, continuation, served, want)
    assert 0 <= results["results"]["radix_mlx_choice"]["acc,none"] <= 1
