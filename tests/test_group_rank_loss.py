"""A rank whose peer is lost outside a step: two real rank processes joined by
mx.distributed's ring on loopback; rank 1 exits, and rank 0's timing of the decode step's
collectives (which runs after the reply, outside `execute`) must end the rank with the
group's exit code and one line, not an uncaught traceback (the supervisor restarts the
group; a traceback in the log is a crash the operator would chase)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

from common.distributed_plan import GROUP_BROKEN
from common.server_args import ServerArgs
from router.serving.worker_group import local_group

RANK = textwrap.dedent(
    """
    import pickle, sys, types
    from common.log import setup_logging
    from common.messages import DecodeBatch
    from worker_mlx.distributed import CollectiveProbe, join_group
    from worker_mlx import worker

    spec = pickle.loads(bytes.fromhex(sys.argv[1]))
    setup_logging(spec.name)
    rank = join_group(spec)
    if spec.rank == 1:
        sys.exit(0)  # the peer lost: its sockets close
    sys.stdin.readline()  # the test says when rank 1 is gone
    args = types.SimpleNamespace(hidden_size=8, num_hidden_layers=2)
    probe = CollectiveProbe(rank, types.SimpleNamespace(args=args))
    msg = DecodeBatch(step=7, rids=["a"], out_cache_loc=[0])
    worker._follow_up(None, msg, 7, probe, False)
    """
)


def test_a_peer_lost_while_timing_the_collectives_ends_the_rank_with_one_line(tmp_path):
    # pipeline parallel: its send fails at once on a closed peer (a tensor-parallel
    # all_sum may wait instead, until the supervisor ends the rank)
    specs = local_group(ServerArgs(model_path="m", pp_size=2), str(tmp_path), "ipc")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, pickle.dumps(spec).hex()],
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for spec in specs
    ]
    gone = procs[1].communicate(timeout=120)[1]  # joined the group, then exited
    assert procs[1].returncode == 0, gone
    out = procs[0].communicate("go\n", timeout=120)[1]
    assert procs[0].returncode == GROUP_BROKEN, out
    assert "after step 7: failed in the group" in out, out
    assert "Traceback" not in out, out
