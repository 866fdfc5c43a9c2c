"""The tiny-model builder's sizes, in a module without mlx: benchmarks list them before
they load OpenBLAS, which must precede the first `import mlx`."""

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128),
    "small": dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768),
    # Qwen3-0.6B's widths in 4 layers: wide enough that a CPU's decode step is bound by
    # reading the weights, as on a Mac, rather than by the GEMM's per-call packing, which
    # dominates at small's width (docs/performance.md, speculative decoding).
    "medium": dict(hidden=1024, layers=4, heads=16, kv_heads=8, head_dim=128, intermediate=3072),
}
