"""benchmarks.one_batch runs end to end on the tiny model and its figures add up."""

from __future__ import annotations

import json

from benchmarks import one_batch


def test_rounds_and_scaling_are_reported(tiny_model, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    rows = one_batch.main(
        ["--model-path", tiny_model, "--batch-size", "1", "3", "--input-len", "8"]
        + ["--output-len", "5", "--cached-prefix-len", "20", "--rounds", "3"]
        + ["--result-file", str(out)]
    )
    printed = capsys.readouterr().out
    assert printed.count("--- warmup") == 2
    assert printed.count("median of 3 passes") == 2
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        assert r["rounds"] == 3 and r["cached_prefix_len"] == 20
        assert r["median_decode_throughput"] == r["batch_size"] / r["median_decode_latency"]
    scaling = rows[1]["median_decode_throughput"] / rows[0]["median_decode_throughput"]
    assert rows[1]["decode_throughput_vs_first_batch"] == scaling
    assert f"batch size 3 / batch size 1: {scaling:.2f}x" in printed
    assert [json.loads(line)["batch_size"] for line in out.read_text().splitlines()] == [1, 3]


def test_mlx_lm_comparison_and_its_own_scaling(tiny_model, tmp_path, capsys):
    rows = one_batch.main(
        ["--model-path", tiny_model, "--batch-size", "1", "2", "--input-len", "8"]
        + ["--output-len", "6", "--compare-mlx-lm", "--result-file", str(tmp_path / "r.jsonl")]
    )
    printed = capsys.readouterr().out
    for r in rows:
        base = r["mlx_lm_median_decode_latency"]
        assert base > 0
        assert r["decode_ratio_vs_mlx_lm"] == r["median_decode_latency"] / base
        assert f"mlx-lm decode step, batch size {r['batch_size']}: {base:.5f} s" in printed
    own = (2 / rows[1]["mlx_lm_median_decode_latency"]) / (
        1 / rows[0]["mlx_lm_median_decode_latency"]
    )
    assert rows[1]["mlx_lm_decode_throughput_vs_first_batch"] == own
    ratio = rows[1]["decode_throughput_vs_first_batch"]
    assert f"batch size 2 / batch size 1: {ratio:.2f}x (mlx-lm's own: {own:.2f}x)" in printed


def test_pool_storages_alternate_and_are_compared(tiny_model, tmp_path, capsys):
    rows = one_batch.main(
        ["--model-path", tiny_model, "--batch-size", "2", "--input-len", "8", "--output-len", "5"]
        + ["--kv-cache-dtype", "auto", "fp16", "--rounds", "2"]
        + ["--result-file", str(tmp_path / "r.jsonl")]
    )
    printed = capsys.readouterr().out
    assert [r["kv_cache_dtype"] for r in rows] == ["auto", "fp16"]
    auto, fp16 = rows
    assert auto["kv_bytes_per_token"] == 2 * fp16["kv_bytes_per_token"]  # float32 vs fp16
    step = fp16["median_decode_latency"] / auto["median_decode_latency"]
    assert fp16["decode_latency_vs_first_storage"] == step
    assert fp16["tokens_per_byte_vs_first_storage"] == 2.0
    want = f"fp16 / auto, batch size 2: decode step {step:.3f}x, tokens in the same memory 2.00x"
    assert want in printed


def test_lora_rows_are_timed_against_plain_rows(tiny_model, tmp_path, capsys):
    rows = one_batch.main(
        ["--model-path", tiny_model, "--batch-size", "4", "--input-len", "8", "--output-len", "4"]
        + ["--loras", "2", "--result-file", str(tmp_path / "r.jsonl")]
    )
    printed = capsys.readouterr().out
    plain, lora = rows
    assert (plain["loras"], lora["loras"]) == (0, 2)
    step = lora["median_decode_latency"] / plain["median_decode_latency"]
    assert lora["decode_latency_vs_first_storage"] == step
    assert f"auto+2 LoRAs / auto, batch size 4: decode step {step:.3f}x" in printed
