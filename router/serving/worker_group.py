"""Where a distributed worker's ranks meet: the hostfile they join with and the sockets
rank 0 forwards descriptors on (worker_mlx.distributed).

All ranks on this machine (no --dist-hostfile): the router writes a loopback ring
hostfile with one port per rank, as mlx.launch would, fresh free ports at every start
(a restarted group does not wait for the old one's ports), or --dist-port and the ones
after it. Ranks on several machines (--dist-hostfile, run under mlx.launch): every
machine runs the same `radix-mlx serve`; mlx.launch gives each its rank in MLX_RANK and
the hostfile in MLX_HOSTFILE; rank 0's machine runs the router, the scheduler and rank
0, the others run only their rank, which fetches its descriptors from rank 0's address
at --dist-port + rank.
"""

from __future__ import annotations

import json
import os

from common.distributed_plan import GroupSpec, hostfile_hosts, write_loopback_hostfile
from common.ipc import free_ports
from common.server_args import ServerArgs

DEFAULT_FANOUT_PORT = 31400  # with --dist-hostfile and no --dist-port


def local_group(args: ServerArgs, group_dir: str, transport: str) -> list[GroupSpec]:
    """Every rank's spec for a group on this machine, with a fresh hostfile."""
    n = args.group_size
    ports = list(range(args.dist_port, args.dist_port + n)) if args.dist_port else free_ports(n)
    hostfile = write_loopback_hostfile(group_dir, ports)
    if transport == "ipc":
        fanout = tuple(f"ipc://{os.path.join(group_dir, f'rank{r}.sock')}" for r in range(n))
    else:
        fanout = tuple(f"tcp://127.0.0.1:{p}" for p in free_ports(n))
    return [
        GroupSpec(r, args.tp_size, args.pp_size, args.dist_backend, hostfile, fanout, n)
        for r in range(n)
    ]


def launched_rank() -> int | None:
    """This machine's rank under mlx.launch (None: not launched by it)."""
    rank = os.environ.get("MLX_RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


def launched_spec(args: ServerArgs, rank: int) -> GroupSpec:
    """This machine's rank of a group spread over the machines of --dist-hostfile."""
    with open(args.dist_hostfile) as f:
        hosts = hostfile_hosts(json.load(f))
    if len(hosts) != args.group_size:
        raise ValueError(
            f"--dist-hostfile lists {len(hosts)} hosts; --tp-size/--pp-size ask for "
            f"{args.group_size} ranks"
        )
    base = args.dist_port or DEFAULT_FANOUT_PORT
    fanout = tuple(f"tcp://{hosts[0]}:{base + r}" for r in range(len(hosts)))
    here = sum(h == hosts[rank] for h in hosts)
    return GroupSpec(rank, args.tp_size, args.pp_size, args.dist_backend, "", fanout, here)
