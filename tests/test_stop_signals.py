"""A stop signal that comes while the signals are held is delivered once the loop runs,
whichever thread the kernel hands it to. A thread that existed before the hold (as
OpenBLAS's pool does in the router) does not block it; with the default action there,
the signal killed the router while it loaded the model (CI: status -15)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import asyncio, signal, threading
    from router.serving.stop_signals import hold_stop_signals, on_loop

    release = threading.Event()
    early = threading.Thread(target=release.wait)  # started before the hold: unblocked
    early.start()
    hold_stop_signals()
    signal.pthread_kill(early.ident, signal.SIGTERM)  # to the one thread that takes it
    signal.pthread_kill(early.ident, signal.SIGINT)
    release.set()
    early.join()

    async def main():
        got = []
        on_loop(asyncio.get_running_loop(), got.append)
        await asyncio.sleep(0.1)
        return got

    print(asyncio.run(main()))
    """
)


def test_a_signal_taken_by_an_earlier_thread_while_held_reaches_the_loop():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, (done.returncode, done.stderr)
    # Python runs pending handlers in signal-number order, not arrival order
    assert sorted(eval(done.stdout)) == sorted([signal.SIGINT, signal.SIGTERM])
