"""Logging set-up: every line names its process, so interleaved child output stays readable."""

from __future__ import annotations

import logging
import sys


def setup_logging(process_name: str, level: str = "info") -> None:
    fmt = f"[%(asctime)s {process_name}] %(message)s"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
