"""`from radix_mlx import Client` works whatever the user's directory holds: a script
beside its own `router.py`, `common.py`, `scheduler.py` (names the server's top-level
packages also use) generates against a real server, and its own modules stay its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import radix_mlx
from router.client import Client as OldName

SHADOWS = ("router", "common", "scheduler", "worker_mlx", "benchmarks")

SCRIPT = textwrap.dedent(
    """
    import sys

    from radix_mlx import AsyncClient, Client, RadixMLXError, __version__

    import common
    import router

    assert router.MINE and common.MINE, "the user's own modules"
    with Client(sys.argv[1], timeout=60) as client:
        r = client.generate(input_ids=[5, 6, 7], max_new_tokens=4, temperature=0,
                            ignore_eos=True)
    print(__version__, r.finish_reason, len(r.output_ids), r.usage.prompt_tokens)
    """
)


def test_the_sdk_imports_beside_a_users_own_router_and_common(tiny_server, tmp_path):
    for name in SHADOWS:
        (tmp_path / f"{name}.py").write_text("MINE = True\n")
    (tmp_path / "script.py").write_text(SCRIPT)
    for argv in (["script.py"], ["-c", SCRIPT]):  # the script's directory, then the cwd
        out = subprocess.run(
            [sys.executable, *argv, tiny_server.zmq_address],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [radix_mlx.__version__, "length", "4", "3"], out.stdout


def test_the_old_name_is_the_same_sdk():
    assert OldName is radix_mlx.Client
    assert radix_mlx.__version__ not in ("", "0+unknown")  # installed: the package's version
