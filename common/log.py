"""Logging set-up: every line names its process, so interleaved child output stays readable.

Tracebacks too: an uncaught exception (the main thread's, another thread's, a child
process's entry point's) and uvicorn's (it propagates to the root logger, see
router.serving.launcher) are logged through the same handler, each line of the traceback with
the process's prefix, rather than dumped raw onto stderr.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

# What transformers would say that is not ours to say: that PyTorch is absent (we use its
# tokenizers only), that a prompt exceeds the tokenizer's length (the router checks
# lengths itself and answers the client). Read when transformers is imported.
QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


class _Formatter(logging.Formatter):
    """`[time process] message`, the prefix on every line (a traceback's too)."""

    def __init__(self, process_name: str):
        super().__init__("%(message)s")
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        when = self.formatTime(record, "%Y-%m-%d %H:%M:%S")
        prefix = f"[{when} {self.process_name}] "
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


def quiet_libraries() -> None:
    """Before anything imports transformers; the children inherit the environment. An
    operator's own setting wins."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


def setup_logging(process_name: str, level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(process_name))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_thread_uncaught


def _log_uncaught(exc_type, exc, tb) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        return sys.__excepthook__(exc_type, exc, tb)
    logging.getLogger().critical("uncaught exception", exc_info=(exc_type, exc, tb))


def _log_thread_uncaught(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "a thread"
    logging.getLogger().error(
        "uncaught exception in %s",
        name,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )


def run_logged(target, *args) -> None:
    """A child process's entry point: `target(*args)`, an exception it raises logged (and
    the process exits 1, as multiprocessing's own report of it would)."""
    try:
        target(*args)
    except Exception:
        logging.getLogger().exception("uncaught exception in %s", target.__name__)
        sys.exit(1)
