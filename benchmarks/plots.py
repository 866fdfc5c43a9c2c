"""PNG plots of a benchmark run: throughput against concurrency, TTFT distributions."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from benchmarks.records import RunResult


def save_plots(results: list[tuple[RunResult, dict]], out_dir: Path) -> list[Path]:
    """Throughput vs concurrency and TTFT distributions; skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; skipping plots (pip install matplotlib)")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [_throughput_plot(plt, results, out_dir / "throughput_vs_concurrency.png")]
    paths.append(_ttft_plot(plt, results, out_dir / "ttft_distribution.png"))
    return [p for p in paths if p is not None]


def _sweep_key(run: RunResult) -> str:
    params = {k: v for k, v in run.workload.params.items() if k != "num_prompts"}
    return f"{run.workload.name} {'-'.join(map(str, params.values()))}"


def _throughput_plot(plt, results, path: Path) -> Path | None:
    lines: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for run, m in results:
        conc = run.max_concurrency or len(run.requests)
        lines[(_sweep_key(run), run.backend)].append((conc, m["output_throughput"]))
    lines = {k: sorted(v) for k, v in lines.items() if len(v) > 1}
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (load, backend), pts in lines.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{backend}: {load}")
    ax.set(xlabel="max concurrency", ylabel="output tokens/s", title="Output throughput")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _ttft_plot(plt, results, path: Path) -> Path | None:
    loads: dict[str, dict[str, list[float]]] = defaultdict(dict)
    for run, _ in results:
        for r in run.requests:
            if r.ok:
                name = f"{run.backend} {r.label}" if run.workload.name == "repeat" else run.backend
                loads[run.load_key()].setdefault(name, []).append(r.ttft * 1000)
    if not loads:
        return None
    cols = min(3, len(loads))
    rows = -(-len(loads) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax, (key, per) in zip(axes.flat, loads.items()):
        ax.boxplot(list(per.values()), showfliers=True)
        ax.set_xticks(range(1, len(per) + 1), list(per.keys()), rotation=20, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(key, fontsize=8)
        ax.set_ylabel("TTFT (ms)")
        ax.grid(alpha=0.3, axis="y")
    for ax in list(axes.flat)[len(loads) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
