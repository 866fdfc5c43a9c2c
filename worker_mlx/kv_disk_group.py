"""The disk tier on a distributed worker (--tp-size / --pp-size): each rank keeps its own
part of every block, and the group agrees on what it can serve.

- **Parts.** A rank's pool holds its share of the KV (TP: its KV heads of every layer;
  PP: all heads of its layers), so it saves and loads exactly that: the blocks of
  ReleaseBatch and LoadBatch (which rank 0 forwards to every rank) go through each rank's
  own DiskTier, its files named `<key>.r<rank>of<n>.safetensors` in one directory.
- **Layout.** That directory is `DIR/<group fingerprint>/`: a digest of tp, pp and every
  rank's own fingerprint (model, its pool's layout: which heads or layers it holds), which
  the ranks exchange with one all_gather at start-up. A server split otherwise (another
  tp or pp, or a single process) never reads these blocks. The budget is the group's:
  each rank keeps a share proportional to its bytes per token, so that every rank holds
  as many blocks and the ranks' LRUs evict the same ones.
- **What is present.** At start-up the ranks all_gather their keys and the scheduler is
  told only the blocks every rank holds. Later, a part one rank dropped (its budget, a
  damaged file) is found by rank 0's rescan every 5 s when the ranks share the
  directory (one machine: rank 0 then drops its own part too, and the scheduler
  forgets the block), and in any case at the next load of that block: the group
  refuses it (below) and the scheduler forgets it, as for a damaged block.
- **Loads.** Every rank's reader thread reads its own part. Rank 0 does not answer when
  its own read is done but forwards `GroupInstall(step)` to the other ranks; at that
  point of the frame stream every rank waits for its own read of that LoadBatch, the
  group takes the smallest number of blocks any rank read (an all_min) and every rank
  installs that many. So BlocksLoaded counts only blocks in every rank's pool, and a
  block missing or damaged on any rank is answered as not loaded: it and the blocks
  after it are recomputed, never served from a partial copy. The wait is at most the
  difference between the ranks' reads of the same blocks (they read in parallel).
- **Directories.** Ranks on one machine share `--kv-disk-dir`. Ranks on other machines
  (mlx.launch) use the same path on their own disk, each holding only its own parts, or
  a shared mount; either works, since no rank reads another's files. A rank whose disk
  lost its parts (a fresh machine) makes the group refuse those blocks once each.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import time

import mlx.core as mx
import numpy as np

from common.distributed_plan import GROUP_BROKEN
from common.kv_store.fingerprint import FINGERPRINT_CHARS
from common.messages import BlocksLoaded, GroupInstall
from common.protocol import encode
from worker_mlx.kv_disk import DiskTier, drain_wakes
from worker_mlx.kv_disk_reader import ReadLoad

logger = logging.getLogger(__name__)

KEY_WORDS = 4  # a block key: 16 bytes, four int32 words on the wire
# a part this old whose sibling parts are absent will not get them: its writers are done
PART_GRACE_SECONDS = 30.0


class GroupLayout:
    """What the ranks agreed at start-up: the group's fingerprint, this rank's budget and
    the part of each block it stores."""

    def __init__(self, rank, fingerprint: str, budget: int):
        self.rank = rank  # worker_mlx.distributed.Rank
        self.fingerprint, self.budget = fingerprint, budget
        self.part = f"r{rank.spec.rank}of{rank.spec.size}"

    @classmethod
    def agree(cls, rank, own_print: str, budget: int, token_bytes: int) -> GroupLayout:
        """Every rank calls it at the same point (one all_gather). `own_print`: this
        rank's fingerprint (model and its pool's layout); `token_bytes`: its pool's bytes
        per token; `budget`: the group's."""
        digest = hashlib.blake2b(own_print.encode(), digest_size=4 * KEY_WORDS).digest()
        mine = np.frombuffer(digest, dtype="<i4").tolist() + [token_bytes]
        every = np.array(mx.distributed.all_gather(mx.array(mine, mx.int32), group=rank.group))
        every = every.reshape(rank.spec.size, KEY_WORDS + 1)
        spec = rank.spec
        group = hashlib.blake2b(f"tp={spec.tp} pp={spec.pp}\0".encode(), digest_size=16)
        group.update(every[:, :KEY_WORDS].astype("<i4").tobytes())
        sizes = every[:, KEY_WORDS].astype(np.int64)
        share = budget * int(sizes[spec.rank]) // max(int(sizes.sum()), 1)
        return cls(rank, group.hexdigest()[:FINGERPRINT_CHARS], share)

    def open(self, store, pool, block_tokens, states, verify=False, draft=None) -> GroupDiskTier:
        return GroupDiskTier(store, pool, block_tokens, states, verify, draft, rank=self.rank)


class GroupDiskTier(DiskTier):
    """One rank's DiskTier in a group. Rank 0's `forward` (its Fanout) is set by the
    worker before it serves."""

    # a rank's pool may hold no windowed layer where another's does (PP): every rank
    # stores every layer's KV of every block, and the scheduler is told no window
    split_windows = False

    def __init__(self, *args, rank, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = rank.group
        self.leader = rank.spec.rank == 0
        self.forward = None
        spec = rank.spec
        # ranks on one machine share the directory: rank 0 sees every rank's parts
        self.siblings = [f"r{r}of{spec.size}" for r in range(1, spec.size)]
        self.shared_dir = self.leader and spec.ranks_on_host >= spec.size
        self._agree_writable()
        self._known = _common_keys(self.group, self.store.keys())
        if self.leader:
            logger.info(
                "kv disk tier: %d blocks on every rank of the group (each rank keeps its "
                "part: %s)", len(self._known), self.store.part,
            )  # fmt: skip

    def known_keys(self) -> list[str]:
        """The blocks every rank held at start-up (in this rank's LRU order)."""
        return [k for k in self.store.keys() if k in self._known]

    def install_ready(self) -> list[BlocksLoaded]:
        """Rank 0, between steps: for each LoadBatch its own reader is done with, the
        other ranks are told to install theirs, and the group installs alike."""
        drain_wakes(self)  # (the reader's wake-ups: this loop takes every read)
        answers = []
        while True:
            try:
                read = self.reader.done.get_nowait()
            except queue.Empty:
                return answers
            self.forward(encode(GroupInstall(read.step)))
            try:
                answers.append(self._agree_install(read))
            except Exception as exc:  # a peer lost mid-collective: the group restarts
                logger.error("kv disk: load %d failed in the group (%s); exiting", read.step, exc)
                raise SystemExit(GROUP_BROKEN) from exc

    def install_step(self, step: int) -> None:
        """A rank > 0 at rank 0's GroupInstall: its own read of that LoadBatch (LoadBatches
        come in one order to every rank), then the group's agreement."""
        read = self.reader.done.get()
        if read.step != step:
            raise RuntimeError(f"kv disk: read LoadBatch {read.step}, rank 0 installs {step}")
        self._agree_install(read)
        self.report()  # nobody reads a rank > 0's report: its figures are dropped

    def save(self, blocks) -> None:
        super().save(blocks)
        if not self.leader:
            self.report()  # (as above) so that its lists do not grow

    def _rescan(self) -> None:
        """(The writer thread.) Rank 0 on the ranks' shared directory also drops the
        blocks another rank no longer holds (its budget, a damaged file), so that the
        scheduler stops matching them before a load would find out."""
        super()._rescan()
        if self.shared_dir and hasattr(self.store, "part_path"):
            for key in partial_blocks(self.store, self.siblings, time.time()):
                logger.info("kv disk: block %s lost another rank's part; dropped", key)
                self.store.forget(key)

    def _agree_install(self, read: ReadLoad) -> BlocksLoaded:
        """Install the blocks every rank read, in order (all_min of the counts)."""
        blocks = read.blocks
        mine = mx.array([len(blocks), int(self.store.writable)], mx.int32)
        count, writable = np.array(mx.distributed.all_min(mine, group=self.group)).tolist()
        if count < len(blocks):
            logger.warning(
                "kv disk: block %s is missing or damaged on another rank; recomputing from "
                "there", blocks[count][0].key,
            )  # fmt: skip
            self.counts.error("missing")
        if not writable:
            self._stop_writing()
        if count < len(blocks):
            read = self.reader.assemble(read.step, blocks[:count])
        return self._install_read(read)

    def _agree_writable(self) -> None:
        mine = mx.array([int(self.store.writable)], mx.int32)
        if not int(mx.distributed.all_min(mine, group=self.group).item()):
            self._stop_writing()

    def _stop_writing(self) -> None:
        """A rank that cannot write stops the group's saves: a block needs every part."""
        if self.store.writable:
            logger.warning("kv disk: another rank cannot write; the group's tier stops writing")
        self.store.writable = False


def partial_blocks(store, siblings: list[str], now: float) -> list[str]:
    """Keys of `store` (a FileBlockStore) whose part is older than PART_GRACE_SECONDS
    and some of whose sibling parts are absent from the directory."""
    out = []
    for key in store.keys():
        try:
            age = now - store.part_path(key, store.part).stat().st_mtime
        except OSError:
            continue  # gone meanwhile: the store's own rescan forgets it
        if age > PART_GRACE_SECONDS and not all(
            store.part_path(key, part).exists() for part in siblings
        ):
            out.append(key)
    return out


def _common_keys(group, keys: list[str]) -> set[str]:
    """The keys every rank of `group` holds (an all_max of the counts, one all_gather)."""
    words = []
    for key in keys:
        try:
            raw = bytes.fromhex(key)
        except ValueError:
            continue  # not a block key: never listed
        if len(raw) == 4 * KEY_WORDS:
            words.append(np.frombuffer(raw, dtype="<i4"))
    n = int(mx.distributed.all_max(mx.array([len(words)], mx.int32), group=group).item())
    if n == 0:
        return set()
    mine = np.zeros((n, KEY_WORDS), dtype=np.int32)  # zero rows: padding, never a key
    if words:
        mine[: len(words)] = np.stack(words)
    every = np.array(mx.distributed.all_gather(mx.array(mine), group=group))
    per_rank = every.reshape(group.size(), n, KEY_WORDS).astype("<i4")
    sets = [{row.tobytes().hex() for row in rows if row.any()} for rows in per_rank]
    return set.intersection(*sets)
