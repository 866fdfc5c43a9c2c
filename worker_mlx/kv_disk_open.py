"""Opening the disk tier (--kv-disk-dir): its directory, budget and fingerprint, for one
process (worker_mlx.kv_disk.DiskTier) or a distributed worker's rank
(worker_mlx.kv_disk_group). The fingerprint covers what makes KV reusable: the model's
files, the pool's layout (and the states', a draft model's) and the block size."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from common.kv_store.file_store import FileBlockStore
from common.kv_store.fingerprint import fingerprint
from common.server_args import ServerArgs
from common.sizes import format_size, parse_size
from worker_mlx.kv_disk import DiskTier, token_bytes
from worker_mlx.kv_disk_group import GroupLayout
from worker_mlx.kv_pool import MlxKVPool
from worker_mlx.state_pool import StatePool

logger = logging.getLogger(__name__)

MAX_DEFAULT_BUDGET = 64 << 30


def default_budget(root: Path) -> int:
    """10% of the free space of the disk holding `root`, at most 64 GiB."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return min(shutil.disk_usage(probe).free // 10, MAX_DEFAULT_BUDGET)


def open_tier(
    args: ServerArgs, pool: MlxKVPool, states: StatePool | None, draft: MlxKVPool | None = None,
    rank=None,
) -> DiskTier | None:  # fmt: skip
    """The tier --kv-disk-dir asks for, or None (off). `states`: a recurrent model's
    state pool; `draft`: the draft model's pool; `rank`: a distributed worker's
    worker_mlx.distributed.Rank (every rank opens the tier at the same point: the group
    agrees on its layout)."""
    if not args.kv_disk_dir:
        return None
    root = Path(args.kv_disk_dir)
    budget = parse_size(args.kv_disk_budget) if args.kv_disk_budget else default_budget(root)
    block = args.kv_disk_block_tokens
    layout = repr(pool.layout) + (f" states={states.layout!r}" if states is not None else "")
    if draft is not None:  # its KV is in every block: its weights decide reuse too
        draft_print = fingerprint(args.speculative_draft_model_path, repr(draft.layout), block)
        layout += f" draft={draft_print}"
    if rank is None and any(pool.layout.windows):  # (DiskTier.split_windows)
        layout += " sliding=window-entries"  # blocks hold the full-attention layers' KV
    print_ = fingerprint(args.model_path, layout, block)
    group = None
    if rank is not None:  # this rank's part of each block, under the group's fingerprint
        per_token = sum(token_bytes([p for layer in pool.parts for p in layer]))
        group = GroupLayout.agree(rank, print_, budget, per_token)
        print_, budget = group.fingerprint, group.budget
    store = FileBlockStore(root, print_, budget, group.part if group else "")
    used, blocks = store.usage()
    logger.info(
        "kv disk tier: %s, %d blocks of %d tokens (%s of %s)",
        store.dir, blocks, block, format_size(used), format_size(budget),
    )  # fmt: skip
    if group is not None:
        return group.open(store, pool, block, states, verify=args.debug_invariants, draft=draft)
    return DiskTier(store, pool, block, states, verify=args.debug_invariants, draft=draft)
