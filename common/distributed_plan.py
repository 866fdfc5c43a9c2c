"""What each rank of a distributed worker holds, decided before any process starts.

Pure Python (no MLX): the router checks a model against --tp-size / --pp-size from its
config.json and refuses what cannot be split with one line, before it spawns a rank.
Under tensor parallelism (mlx-lm's `model.shard`) every rank holds 1/N of each layer's
attention heads, KV heads and MLP columns; under pipeline parallelism a contiguous run of
layers, the first ranks one more when the layers do not divide evenly. Each rank's KV
pool holds its share only; all ranks use the same slot ids, so the pool is as many slots
as the rank with the least room has (`agree_pool_size` in worker_mlx.distributed).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# The exit status of a rank that left because its group broke (a peer died mid-step):
# the supervisor names the rank that died first, not this one.
GROUP_BROKEN = 3


class PlanError(ValueError):
    """A model that cannot be split as asked; the message says why, in one line."""


@dataclass(frozen=True)
class GroupSpec:
    """One rank's place in the worker group, as the router hands it to the process.
    `fanout[r]` is where rank r (r >= 1) receives the descriptors rank 0 forwards
    (rank 0 binds them); `hostfile` is the JSON file mx.distributed joins with
    ("" when the environment, e.g. mlx.launch, already says where it is)."""

    rank: int
    tp: int
    pp: int
    backend: str
    hostfile: str
    fanout: tuple[str, ...] = field(default=())
    ranks_on_host: int = 1  # how many ranks share this machine's memory budget

    @property
    def size(self) -> int:
        return self.tp * self.pp

    @property
    def mode(self) -> str:
        return "tensor" if self.tp > 1 else "pipeline"

    @property
    def name(self) -> str:
        """The process name (and title): `worker` for rank 0, `worker-1`, ... for the others."""
        return "worker" if self.rank == 0 else f"worker-{self.rank}"


def layer_ranges(num_layers: int, stages: int) -> list[range]:
    """Contiguous layers per pipeline stage, in order; the first stages get the extra ones."""
    if not 1 <= stages <= num_layers:
        raise PlanError(
            f"--pp-size {stages} needs at least {stages} layers; the model has {num_layers}"
        )
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def check_model(config: dict, tp: int, pp: int) -> None:
    """Raise PlanError when the model (its config.json) cannot be split as asked."""
    text = config.get("text_config") or config
    if tp > 1:
        heads = text.get("num_attention_heads")
        kv_heads = text.get("num_key_value_heads", heads)
        inter = text.get("intermediate_size")
        for what, n in (("attention heads", heads), ("KV heads", kv_heads), ("MLP columns", inter)):
            if n is not None and n % tp:
                raise PlanError(
                    f"--tp-size {tp}: the model's {n} {what} do not divide into {tp} equal shares"
                )
    if pp > 1:
        layers = text.get("num_hidden_layers")
        if layers is None:
            raise PlanError(f"--pp-size {pp}: the model's config names no num_hidden_layers")
        layer_ranges(int(layers), pp)


def check_model_dir(model_dir: str, tp: int, pp: int) -> None:
    with open(os.path.join(model_dir, "config.json")) as f:
        check_model(json.load(f), tp, pp)


def loopback_hostfile(ports: list[int]) -> list[list[str]]:
    """The ring backend's hostfile for ranks all on this machine: one address per rank."""
    return [[f"127.0.0.1:{p}"] for p in ports]


def write_loopback_hostfile(directory: str, ports: list[int]) -> str:
    """The loopback hostfile written to `directory`; its path, for MLX_HOSTFILE."""
    path = os.path.join(directory, "hostfile.json")
    with open(path, "w") as f:
        json.dump(loopback_hostfile(ports), f)
    return path


def hostfile_hosts(hostfile: list) -> list[str]:
    """Each rank's host, from the ring's list-of-addresses form or mlx.launch's
    `{"ssh": ..., "ips": [...]}` form (its first IP, else its ssh name)."""
    if isinstance(hostfile, dict):  # mlx.launch's full form: {"backend", "envs", "hosts"}
        hostfile = hostfile.get("hosts", [])
    hosts = []
    for entry in hostfile:
        if isinstance(entry, dict):
            hosts.append((entry.get("ips") or [entry.get("ssh", "?")])[0])
        else:
            hosts.append(str(entry[0]).rsplit(":", 1)[0] if entry else "?")
    return hosts
