"""A child notices its parent's death even when the parent died before it looked."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.server import exited

PARENT = """
import multiprocessing, os, time
from tests.test_child_process import late_watcher
if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=late_watcher)
    child.start()
    print(child.pid, flush=True)
    time.sleep(0.5)  # the child has read what spawn sends it
    os._exit(0)  # dies while its child is still starting (a worker importing mlx-lm)
"""


def late_watcher() -> None:
    from common.ipc import ParentWatch

    time.sleep(1.0)  # the parent is gone by now: this child belongs to init
    watch = ParentWatch()
    while watch.parent_alive():
        time.sleep(0.05)


def test_a_child_whose_parent_died_before_it_watched_exits():
    root = os.path.dirname(os.path.dirname(__file__))
    with subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                          cwd=root) as parent:  # fmt: skip
        pid = int(parent.stdout.readline())
    assert exited([pid], timeout=20), "the orphaned child kept running"
