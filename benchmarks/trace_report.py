"""Where each request's time to first token went, from a `--trace-dir` of a server run.

    python -m benchmarks.trace_report DIR

For every request it follows the first token through the processes: router to scheduler,
waiting and scheduling, scheduler to worker, the worker's step, back to the scheduler,
the scheduler's output, and back to the router. The stages add up to the router-side
TTFT. It also prints the disk tier's loads (send, read, answer, admission) and the
worker's step times by kind.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

STAGES = (
    ("router -> scheduler", "submit", "request"),
    ("queue + scheduling", "request", "sent"),
    ("scheduler -> worker", "sent", "recv"),
    ("worker step", "recv", "done"),
    ("worker -> scheduler", "done", "result"),
    ("scheduler output", "result", "out"),
    ("scheduler -> router", "out", "tokens"),
)


def read_events(directory: str) -> list[tuple[int, str, str, list[str]]]:
    """(ns, process, event, ids) of every trace file, in time order."""
    events = []
    for path in Path(directory).glob("*.trace"):
        process = path.name.split(".")[0]
        for line in path.read_text().splitlines():
            ns, event, *ids = line.split()
            events.append((int(ns), process, event, ids))
    return sorted(events, key=lambda e: e[0])


def first_token_timelines(events) -> dict[str, dict[str, int]]:
    """For each request, the time of each point its first token passed."""
    marks: dict[str, dict[str, int]] = defaultdict(dict)
    worker: dict[str, dict[str, int]] = defaultdict(dict)  # step -> its points
    last_batch: dict[str, str] = {}  # rid -> step of the latest batch that carried it
    for ns, process, event, ids in events:
        if process == "router" and event == "submit":
            marks[ids[0]]["submit"] = ns
        elif process == "scheduler" and event == "request":
            marks[ids[0]].setdefault("request", ns)
        elif process == "scheduler" and event in ("extend", "decode"):
            step, rids = ids[0], ids[1:]
            worker[step]["sent"] = ns
            for rid in rids:
                last_batch[rid] = step
        elif process == "worker" and event in ("recv", "done"):
            worker[ids[0]][event] = ns
        elif process == "scheduler" and event == "result":
            worker[ids[0]]["result"] = ns
        elif process == "scheduler" and event == "out":
            for rid in ids:
                if rid in marks and "out" not in marks[rid] and rid in last_batch:
                    marks[rid]["out"] = ns
                    marks[rid].update(worker[last_batch[rid]])
        elif process == "router" and event == "tokens":
            for rid in ids:
                marks[rid].setdefault("tokens", ns)
    complete = {p for _, a, b in STAGES for p in (a, b)}
    return {rid: m for rid, m in marks.items() if complete <= m.keys()}


def step_times(events) -> dict[str, list[float]]:
    """The worker's step times in ms, by descriptor kind: extend, decode, and decode steps
    the worker had already started ahead, which show only what was left of them."""
    kind, recv, out = {}, {}, defaultdict(list)
    for ns, process, event, ids in events:
        if process == "scheduler" and event in ("extend", "decode"):
            kind[ids[0]] = event
        elif process == "worker" and event == "recv":
            recv[ids[0]] = (ns, "ahead" in ids[1:])
        elif process == "worker" and event == "done" and ids[0] in recv and ids[0] in kind:
            start, ahead = recv[ids[0]]
            name = kind[ids[0]] + (" computed ahead" if ahead else "")
            out[name].append((ns - start) / 1e6)
    return out


def load_times(events) -> dict[str, list[float]]:
    """The disk tier's loads in ms (`--kv-disk-dir`): from the scheduler's send to the
    reader's read, from there to the scheduler's BlocksLoaded, and from that to the
    extend that admits the load's first request."""
    marks: dict[str, dict[str, int]] = defaultdict(dict)
    first: dict[str, str] = {}  # a load's step -> its first request
    extended: dict[str, int] = {}  # rid -> its first extend's send
    for ns, process, event, ids in events:
        if process == "scheduler" and event == "load" and len(ids) > 1:
            marks[ids[0]]["sent"], first[ids[0]] = ns, ids[1]
        elif (process, event) in (("worker", "read"), ("scheduler", "loaded")):
            marks[ids[0]].setdefault(event, ns)
        elif process == "scheduler" and event == "extend":
            for rid in ids[1:]:
                extended.setdefault(rid, ns)
    out = defaultdict(list)
    for step, m in marks.items():
        m["extend"] = extended.get(first.get(step, ""), 0)
        for name, a, b in (("sent -> read", "sent", "read"), ("read -> loaded", "read",
                           "loaded"), ("loaded -> extend", "loaded", "extend")):  # fmt: skip
            if m.get(a) and m.get(b):
                out[name].append((m[b] - m[a]) / 1e6)
    return out


def report(directory: str) -> str:
    events = read_events(directory)
    timelines = first_token_timelines(events)
    lines = [f"{len(timelines)} requests with a complete first-token timeline"]
    if timelines:
        lines.append(f"{'stage':24}{'p50 ms':>10}{'p90 ms':>10}")
        marks = list(timelines.values())
        rows = [(name, [(m[b] - m[a]) / 1e6 for m in marks]) for name, a, b in STAGES]
        rows.append(("TTFT (router side)", [(m["tokens"] - m["submit"]) / 1e6 for m in marks]))
        for name, values in rows:
            lines.append(f"{name:24}{_pct(values, 50):10.2f}{_pct(values, 90):10.2f}")
    for name, values in load_times(events).items():
        lines.append(
            f"disk loads, {name}: {len(values)}, p50 {_pct(values, 50):.2f} ms, "
            f"p90 {_pct(values, 90):.2f} ms"
        )
    for kind, values in sorted(step_times(events).items()):
        lines.append(
            f"worker steps, {kind}: {len(values)}, p50 {_pct(values, 50):.2f} ms, "
            f"p90 {_pct(values, 90):.2f} ms, total {sum(values) / 1e3:.3f} s"
        )
    return "\n".join(lines)


def _pct(values: list[float], q: int) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, len(values) * q // 100)] if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", help="the server's --trace-dir")
    print(report(p.parse_args().directory))


if __name__ == "__main__":
    main()
