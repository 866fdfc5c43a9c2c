"""The worker on the 2026 model families, against mlx-lm's own greedy generation.

Sliding-window layers (Mistral-style, Gemma 3's local/global pattern, gpt-oss's
alternating layers with attention sinks), multi-head latent attention (DeepSeek-V3: keys
and values of different widths) and mixtures of experts (qwen3_moe, gpt-oss), each in the
scenarios the classic models pass: batched mixed lengths, a cached prefix cut inside the
prompt and inside the output, an exact repeat, turns that include generated tokens, and
chunked prefill. The tiny families' windows are 16 tokens, so every prompt here is at
least 4 windows long and every generation outlives a window.
"""

from __future__ import annotations

import random

import pytest

from common.messages import ReleaseReq
from tests.test_model_runner import Harness, assert_parity, generate, random_prompt, reference

FAMILIES = ["mistral_swa", "local_swa", "gemma3", "gemma4", "gpt_oss", "deepseek_v3", "qwen3_moe"]
LONG = 70  # > 4 windows of 16
STEPS = 24  # > a window


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_arch) -> str:
    return tiny_arch(request.param)


def test_each_family_probes_to_its_layer_kinds(family):
    from worker_mlx.model_probe import probe_kv_layout

    layout = probe_kv_layout(Harness(family).model)
    windows = [w for w in layout.windows if w is not None]
    # local and (twice as wide) global layers; the others' layers are alike
    assert len(set(layout.layer_widths)) == (2 if "gemma4" in family else 0)
    if "deepseek" in family:
        assert layout.v_head_dim is not None and layout.v_head_dim != layout.head_dim
    elif "qwen3_moe" in family:
        assert layout.windows == () and layout.v_head_dim is None
    else:
        assert windows and max(windows) * 4 <= LONG
        # the families keep global layers too, but for the one built without any
        assert (None in layout.windows) != ("local_swa" in family)


@pytest.mark.parametrize("compile_decode", [True, False], ids=["compiled", "eager"])
def test_eight_mixed_lengths_batched(family, compile_decode):
    h = Harness(family, compile_decode=compile_decode)
    rng = random.Random(21)
    lengths = [LONG, 1, 90, 5, 64, 17, 100, 33]
    prompts = {f"r{i}": random_prompt(rng, n, h.vocab) for i, n in enumerate(lengths)}
    # different lengths of output: rows leave the decode buffer while others go on
    max_new = {rid: STEPS - 2 * i for i, rid in enumerate(prompts)}
    got = generate(h, prompts, max_new, free_finished=True)
    assert_parity(h, prompts, got)


@pytest.mark.parametrize("cut", ["prompt", "generated"])
def test_cached_prefix_inside_prompt_or_output(family, cut):
    """B reuses A's KV up to a cut, batched with a cold request (per-row prefix lengths
    either side of the window)."""
    h = Harness(family)
    rng = random.Random(22)
    a = random_prompt(rng, LONG, h.vocab)
    got_a = generate(h, {"A": a}, STEPS)["A"]
    assert got_a == reference(h.path, a, STEPS)
    n = {"prompt": 50, "generated": LONG + 20}[cut]
    full = (a + got_a)[: LONG + STEPS - 1] + random_prompt(rng, 9, h.vocab)
    cold = random_prompt(rng, 66, h.vocab)
    h.extend([h.ereq("B", full[n:], prefix=h.prefix("A", n)), h.ereq("C", cold)])
    for _ in range(STEPS - 1):
        h.decode()
    assert h.out["B"] == reference(h.path, full, STEPS)
    assert h.out["C"] == reference(h.path, cold, STEPS)


def test_exact_repeat_and_turns_with_generated_tokens(family):
    """A prompt sent again computes its last token only; each next turn extends the whole
    previous turn (prompt + output) and matches mlx-lm on the full history."""
    h = Harness(family)
    rng = random.Random(23)
    history = random_prompt(rng, LONG, h.vocab)
    got = generate(h, {"t0": history}, 12)["t0"]
    h.extend([h.ereq("again", history[-1:], prefix=h.prefix("t0", LONG - 1))])
    for _ in range(11):
        h.decode()
    h.release([ReleaseReq("again", flush=True)])
    assert h.out["again"] == got == reference(h.path, history, 12)
    for turn in (1, 2, 3):
        prefix = h.prefix(f"t{turn - 1}")
        history = history + got + random_prompt(rng, 3 + 5 * turn, h.vocab)
        rid = f"t{turn}"
        h.extend([h.ereq(rid, history[len(prefix[0]) :], prefix=prefix)])
        for _ in range(11):
            h.decode()
        h.release([ReleaseReq(rid, flush=True)])
        got = h.out[rid]
        assert got == reference(h.path, history, 12), f"turn {turn}"


@pytest.mark.parametrize("prefill_step", [16, 256])
def test_chunked_prefill_across_windows(family, prefill_step):
    """A 100-token prompt in scheduler chunks of 24 while another request decodes between
    them; with a 16-token prefill step each chunk is cut again inside the worker."""
    h = Harness(family, prefill_step=prefill_step)
    rng = random.Random(24)
    prompt, other = random_prompt(rng, 100, h.vocab), random_prompt(rng, LONG, h.vocab)
    h.extend([h.ereq("other", other)])
    for i in range(0, 100, 24):
        chunk, last = prompt[i : i + 24], i + 24 >= 100
        prefix = h.prefix("long") if i else ([], [])
        h.extend([h.ereq("long", chunk, prefix=prefix, last_chunk=last)])
        h.decode(["other"])
    for _ in range(STEPS - 1):
        h.decode()
    assert h.out["long"] == reference(h.path, prompt, STEPS)
    assert h.out["other"] == reference(h.path, other, len(h.out["other"]))


@pytest.mark.parametrize("compile_decode", [True, False], ids=["compiled", "eager"])
def test_batched_with_the_cpu_kernels(family, compile_decode):
    """The CPU backend's attention (sinks, per-head score biases, windows' masks) and SwiGLU
    in prefill and decode, batched, against stock mlx-lm."""
    from worker_mlx.backends import cpu_kernels

    h = Harness(family, compile_decode=compile_decode)
    rng = random.Random(25)
    prompts = {f"r{i}": random_prompt(rng, n, h.vocab) for i, n in enumerate((300, 7, 90, 130))}
    want = {rid: reference(h.path, p, STEPS) for rid, p in prompts.items()}
    uninstall = cpu_kernels.install(h.model)
    assert uninstall is not None
    try:
        got = generate(h, prompts, STEPS)
    finally:
        uninstall()
    assert got == want
