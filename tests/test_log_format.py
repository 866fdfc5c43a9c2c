"""Every line a server writes is in the project's log format (`[time process] ...`,
common/log.py), tracebacks included: a child's crash, an exception uvicorn caught, a
thread's, the main thread's. A raw dump on stderr is unreadable among the other
processes' lines and invisible to a log filter on the process name."""

from __future__ import annotations

import multiprocessing
import re
import subprocess
import sys

import httpx
import pytest

from common.log import run_logged, setup_logging
from tests.server import ServerProcess

LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [\w:-]+\] ")


def _foreign(log: str) -> list[str]:
    return [line for line in log.splitlines() if line and not LINE.match(line)]


def test_uncaught_exceptions_are_logged_in_our_format():
    code = (
        "import threading\n"
        "from common.log import setup_logging\n"
        "setup_logging('probe')\n"
        "t = threading.Thread(target=lambda: 1 / 0)\n"
        "t.start(); t.join()\n"
        "raise RuntimeError('boom')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 1
    assert "ZeroDivisionError" in out.stderr and "RuntimeError: boom" in out.stderr
    assert _foreign(out.stderr) == [], out.stderr


def _crashing_child() -> None:
    setup_logging("probe-child")
    raise RuntimeError("child boom")


def test_a_child_process_crash_is_logged_in_our_format(capfd):
    """How the supervisor starts the worker and the scheduler (`run_logged`)."""
    proc = multiprocessing.get_context("spawn").Process(target=run_logged,
                                                        args=(_crashing_child,))  # fmt: skip
    proc.start()
    proc.join(60)
    err = capfd.readouterr().err
    assert proc.exitcode == 1
    assert "probe-child] RuntimeError: child boom" in err, err
    assert _foreign(err) == [], err


@pytest.mark.slow
def test_a_crash_is_logged_in_our_format(tiny_model, tmp_path):
    """A --trace-dir that cannot be made: every process that opens its trace raises."""
    (tmp_path / "file").write_text("")
    server = ServerProcess(tiny_model, tmp_path / "log", ["--trace-dir", str(tmp_path / "file/x")])
    with pytest.raises(RuntimeError, match="exited with 1"):
        server.start()
    log = server.log()
    assert "] Traceback (most recent call last):" in log, log
    assert "NotADirectoryError" in log, log
    assert _foreign(log) == [], log


@pytest.mark.slow
def test_a_served_request_leaves_only_our_format(tiny_server):
    # a lone surrogate: a 500 and uvicorn's own traceback once; whatever it gets, the log
    # has only our lines
    body = '{"prompt": "a\\ud800b", "max_tokens": 2}'
    r = httpx.post(tiny_server.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert r.status_code in (200, 400, 500)
    # longer than the tokenizer's model_max_length (32768): refused by us, not by it
    long = " ".join(f"w{i}" for i in range(40000))
    r = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": long}, timeout=60)
    assert r.status_code == 400, r.text
    log = tiny_server.log()
    assert "PyTorch was not found" not in log
    assert "Token indices sequence length" not in log
    assert _foreign(log) == [], tiny_server.log(30)
