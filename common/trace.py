"""Per-process event traces, to find where a request's time goes (`--trace-dir`).

Each process appends `<monotonic ns> <event> <ids...>` lines to its own file in the
directory. CLOCK_MONOTONIC is shared by the processes of one machine, so
`python -m benchmarks.trace_report DIR` can follow one request across the router, the
scheduler and the worker. Without a directory a trace is a no-op.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


class Trace:
    def __init__(self, directory: str | None, process: str):
        self._file = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            path = Path(directory) / f"{process}.{os.getpid()}.trace"
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives with the process

    def __call__(self, event: str, *ids: object) -> None:
        if self._file is not None:
            self._file.write(f"{time.monotonic_ns()} {event} {' '.join(map(str, ids))}\n")

    @property
    def enabled(self) -> bool:
        return self._file is not None
