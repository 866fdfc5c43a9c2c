"""How rank 0 of a distributed worker should hand each descriptor to the other ranks:
over ZeroMQ (what worker_mlx.distributed does) or as a broadcast over the mx.distributed
group (an all_sum of a fixed-size byte buffer that only rank 0 fills).

    python -m benchmarks.fanout [--frames 500] [--rids 8]

Two rank processes on a loopback ring (started by this command with MLX_RANK and
MLX_HOSTFILE, as mlx.launch does: benchmarks.ranks.run_ranks). ZeroMQ: rank 0 sends
the encoded DecodeBatch, rank 1 decodes it and answers one byte; the round trip is
timed, so the hand-off itself costs at most that. Broadcast: rank 0 copies the frame
into the buffer, both all_sum it, rank 1 decodes it; the collective is timed on rank 0.
Medians are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

BUFFER = 16384  # bytes: a broadcast needs a size fixed in advance, the largest frame's


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if os.environ.get("MLX_RANK") is None:
        from benchmarks.ranks import run_ranks

        run_ranks("benchmarks.fanout", sys.argv[1:] if argv is None else argv, 2)
        return
    _run(args)


def _run(args: argparse.Namespace) -> None:
    import mlx.core as mx
    import numpy as np
    import zmq

    from common.messages import WORKER_INBOX, DecodeBatch
    from common.protocol import decode, encode

    group = mx.distributed.init(backend="ring", strict=True)
    rank, tmp = group.rank(), os.environ["RANKS_DIR"]
    ctx = zmq.Context()
    there, back = f"ipc://{tmp}/to1.sock", f"ipc://{tmp}/to0.sock"
    rids = [f"{i:032x}" for i in range(args.rids)]
    frame = encode(DecodeBatch(1, rids, list(range(1, args.rids + 1)), lookahead=True))
    if rank == 0:
        out, ack = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        out.bind(there)
        ack.bind(back)
    else:
        out, ack = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        ack.connect(there)
        out.connect(back)
    mx.eval(mx.distributed.all_sum(mx.ones(1), group=group))  # both sockets are up
    zmq_times, bcast_times = [], []
    for _ in range(args.frames):
        if rank == 0:
            t = time.perf_counter()
            out.send(frame)
            ack.recv()
            zmq_times.append(time.perf_counter() - t)
        else:
            decode(ack.recv(), WORKER_INBOX)
            out.send(b"k")
    for _ in range(args.frames):
        buf = np.zeros(BUFFER, dtype=np.uint8)
        if rank == 0:
            buf[: len(frame)] = np.frombuffer(frame, dtype=np.uint8)
        t = time.perf_counter()
        got = mx.distributed.all_sum(mx.array(buf), group=group)
        mx.eval(got)
        bcast_times.append(time.perf_counter() - t)
        if rank == 1:
            decode(bytes(np.array(got)[: len(frame)]), WORKER_INBOX)
    if rank == 0:
        z, b = statistics.median(zmq_times), statistics.median(bcast_times)
        print(f"descriptor of {args.rids} requests: {len(frame)} bytes")
        print(f"ZeroMQ round trip (ipc):          {z * 1e3:.3f} ms (median of {args.frames})")
        print(f"broadcast over the group (ring):  {b * 1e3:.3f} ms ({BUFFER}-byte buffer)")
        print(f"broadcast / ZeroMQ: {b / z:.1f}x")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=500)
    p.add_argument("--rids", type=int, default=8, help="requests in the decode descriptor")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
