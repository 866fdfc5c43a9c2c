"""The disk tier on the scheduler's side: the radix tree's lower tier.

The scheduler knows which blocks the worker's store holds (their keys: reported in
WorkerReady at start-up, added as it asks for saves, removed as the worker reports them
dropped) and, from a prompt's block keys, how far the disk continues a prompt past its
pool match. Two things cross to the worker:

- **saves**: when a request finishes, its whole blocks not on disk yet are named with
  the trie's slots for them (`BlockSave`) in a ReleaseBatch sent before any later
  descriptor, so the worker copies them out before a slot can be reused. Every prefix
  the trie holds from a finished request is thus on disk before eviction can take it
  (write-through at finish is also the write-back).
- **loads**: before a prefill, a waiting prompt whose match runs past the pool into the
  disk tier gets fresh slots for those blocks and a LoadBatch; the blocks the worker
  loaded go into the trie as cached tokens, and the prompt's admission then matches
  them like any other prefix (the rest is freed and recomputed).

A model with recurrent layers resumes only where a state snapshot is (the trie's
`match_snapshot`), so the tier also keeps states: the scheduler has each prompt snapshot
its state at its last block end (`KVCacheManager.block_tokens`), a block saved while the
trie holds a snapshot at its end takes it along (stored as `state_key(key)`), and a load
runs to the deepest block whose state is on disk, bringing that state into a fresh state
slot that becomes the loaded prefix's snapshot.

A sliding-window model's sliding layers attend only the `window` tokens before a token, so
(as SGLang's SWA radix cache keeps only those) a block's entry holds the full-attention
layers' KV, and the sliding layers' KV is stored (`window_key`) only for the blocks a
later prompt resuming at the saved prompt's last block end, or at the end of all it
saved, attends: the last ceil(window / block) before each. A load runs to the deepest
block end whose window is all stored (or in the pool), and the blocks loaded without it
join the trie as windowless nodes (scheduler/sliding_windows.py), where no match ends.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from itertools import groupby

from common.cache_salt import stored_namespace
from common.kv_store.block_keys import block_key, block_keys, root_key, state_key, window_key
from common.kv_store.fingerprint import adapter_identity
from common.messages import BlockLoad, BlockSave, BlocksLoaded, DiskReport
from scheduler.cache import KVCacheManager
from scheduler.request import Req
from scheduler.sliding_windows import windowed, windowless_runs

MAX_LOAD_TOKENS = 1 << 16  # per LoadBatch: a longer load goes in several
PREFETCH_SHARE = 2  # loads ahead of admission take at most 1 / this of the pool


@dataclass
class PlannedLoad:
    """One prompt's load: its pool match (`prefix` slots) and the blocks after it."""

    req: Req
    tokens: list[int]  # the prompt's tokens to the end of its last block to load
    prefix: list[int]
    loads: list[BlockLoad]


class DiskIndex:
    def __init__(
        self, keys: list[str], block_tokens: int, states: bool = False, adapters: list[str] = (),
        window: int = 0,
    ):  # fmt: skip
        self.keys = set(keys)  # blocks' keys, and the state_keys of stored states
        # per LoRA adapter id (0: the base), its identity (fingerprint.adapter_identity);
        # adapters loaded at run time join it (`adapter_loaded`)
        self.adapters = dict(enumerate(["", *adapters]))
        self.block_tokens = block_tokens
        self.states = states  # recurrent layers: a prefix resumes only from a stored state
        self.window = window  # sliding layers' largest window (0: none), see above
        self.saves: list[BlockSave] = []  # for the next ReleaseBatch
        self.touches: list[str] = []  # keys used again, for the next ReleaseBatch
        self.reports: list[DiskReport] = []  # for the router's metrics
        self.writable = True  # the worker's store writes (else nothing is asked to save)
        self.in_flight = 0  # tokens of LoadBatches not answered yet
        # per parent key, the tails stored after it by length (see `save_finished`), and
        # per tail key, its parent
        self.tails: dict[str, dict[int, str]] = {}
        self.tail_parents: dict[str, str] = {}

    def namespace(self, salt: str | None, lora: int) -> int:
        """The namespace of a request's block keys (`Req.disk_namespace`)."""
        return stored_namespace(salt, self.adapters[lora])

    def adapter_loaded(self, lora: int, path: str) -> None:
        """An adapter loaded at run time (/admin/loras/load) as id `lora`, or (`path` "")
        unloaded: its blocks are keyed by a digest of its files, as a --lora adapter's,
        so a name loaded again with other weights never meets the old blocks, and the
        same files loaded again (after a restart too) do."""
        if path:
            try:
                self.adapters[lora] = adapter_identity(path)
            except OSError:  # the worker's load fails too; if not, its blocks meet nothing
                self.adapters[lora] = f"unreadable:{uuid.uuid4()}"
        else:
            self.adapters.pop(lora, None)

    # ------------------------------------------------------------ saves

    def save_finished(self, kv: KVCacheManager, req: Req, tokens: list[int]) -> None:
        """After `req` released `tokens` into the trie: queue its blocks not on disk, then
        its tail (`_save_tail`)."""
        if not self.writable:
            return
        B = self.block_tokens
        keys = block_keys(tokens, req.disk_namespace, B)
        states = self._block_states(kv, req, tokens, keys)
        m = kv.tree.match_prefix(tokens[: len(keys) * B], req.namespace)
        windows = self._block_windows(kv, req, keys, m)
        missing = [
            i for i, key in enumerate(keys) if key not in self.keys or i in states or i in windows
        ]
        # the blocks it used again are the disk's most recent too: a prefix the pool keeps
        # hot must not age out of the disk meanwhile (and their states and windows)
        used = keys + [state_key(key) for key in keys if self.states]
        used += [window_key(key) for key in keys if self.window]
        self.touches += [key for key in used if key in self.keys]
        slots = m.slot_ids
        if len(slots) < len(keys) * B:
            return  # not all in the trie (--disable-radix-cache): nothing to copy from
        for i in missing:
            parent = keys[i - 1] if i else root_key(req.disk_namespace)
            piece = slice(i * B, (i + 1) * B)
            state = states.get(i, 0)
            save = BlockSave(keys[i], parent, tokens[piece], slots[piece], state, i in windows)
            self.saves.append(save)
            self.keys.add(keys[i])  # one writer per block: later finishes do not ask again
            if state:
                self.keys.add(state_key(keys[i]))
            if save.window:
                self.keys.add(window_key(keys[i]))
        self._save_tail(kv, req, tokens, keys)

    def _save_tail(self, kv: KVCacheManager, req: Req, tokens: list[int], keys) -> None:
        """Queue the request's tail (the tokens after its last whole block) as a short
        block of its own, chained to that block: the next turn of a conversation starts
        with all of `tokens`, and would otherwise recompute up to a block of them. (Not
        for recurrent or sliding-window models: their blocks carry a state or window
        entry at whole blocks only.)"""
        whole = len(keys) * self.block_tokens
        if len(tokens) == whole or self.states or self.window:
            return
        parent = keys[-1] if keys else root_key(req.disk_namespace)
        tail = block_key(parent, tokens[whole:])
        slots = kv.tree.match_prefix(tokens, req.namespace).slot_ids
        if tail in self.keys or len(slots) < len(tokens):
            return
        self.saves.append(BlockSave(tail, parent, tokens[whole:], slots[whole:]))
        self.keys.add(tail)  # one writer per block
        self.tails.setdefault(parent, {})[len(tokens) - whole] = tail
        self.tail_parents[tail] = parent

    def _block_states(self, kv: KVCacheManager, req: Req, tokens, keys) -> dict[int, int]:
        """Block index -> the trie's snapshot at its end, for the blocks whose state is
        not on disk yet (recurrent models; the snapshots the prompt took at block ends)."""
        if not self.states:
            return {}
        B = self.block_tokens
        on_path = kv.tree.snapshots_on_path(tokens[: len(keys) * B], req.namespace)
        return {
            end // B - 1: slot
            for end, slot in on_path.items()
            if end % B == 0 and state_key(keys[end // B - 1]) not in self.keys
        }

    def _block_windows(self, kv: KVCacheManager, req: Req, keys, m) -> set[int]:
        """The blocks whose sliding layers' KV to store (not on disk yet): those the
        window before the prompt's last block end and before the end of `keys` reaches,
        where the trie's slots hold it (`m`: the trie's match of the blocks)."""
        if not self.window:
            return set()
        B, n = self.block_tokens, len(keys)
        reach = -(-self.window // B)
        runs = windowless_runs(kv.tree, m)
        ends = {n, min(n, (len(req.input_ids) - 1) // B)}
        return {
            i
            for end in ends
            for i in range(max(0, end - reach), end)
            if window_key(keys[i]) not in self.keys and windowed(runs, i * B, (i + 1) * B)
        }

    def take_saves(self) -> tuple[list[BlockSave], list[str]]:
        out, touched, self.saves, self.touches = self.saves, self.touches, [], []
        return out, touched

    # ------------------------------------------------------------ loads

    def plan(self, waiting: list[Req], kv: KVCacheManager, reserve: int = 0) -> list[PlannedLoad]:
        """Loads for waiting prompts (first admissions) that the disk continues, leaving
        `reserve` slots obtainable beside each prompt's own. A prompt is done with once
        planned or found to have no block on disk; one whose blocks another planned
        load brings, or that finds no room, is looked at again later."""
        planned: list[PlannedLoad] = []
        taken: set[str] = set()
        # loaded ahead of admission, the blocks are evictable cache: a long queue must not
        # load more than a share of the pool, or its loads would evict each other
        ahead = self.in_flight + sum(r.disk_tokens for r in waiting if r.cached_tokens < 0)
        budget = min(MAX_LOAD_TOKENS, kv.capacity // PREFETCH_SHARE - ahead)
        for req in waiting:
            req.disk_deferred = False
            if req.disk_checked or req.rid in kv.req_to_token:
                continue
            # the first load may take what its prompt needs (the pool holds the prompt)
            alone = not planned and ahead == 0
            limit = MAX_LOAD_TOKENS if alone else budget
            got = self._plan_one(req, kv, taken, limit, reserve)
            if got is None:
                # its blocks are on disk but wait for room (or come with another's load):
                # admitted now it would recompute them; the loads ahead of it free the
                # budget once their prompts are admitted
                req.disk_deferred = not req.disk_checked and bool(planned or ahead)
                continue
            planned.append(got)
            need = sum(len(x.slots) for x in got.loads)
            budget -= need
            self.in_flight += need
        return planned

    def _plan_one(self, req: Req, kv: KVCacheManager, taken: set[str], budget: int, reserve: int):
        B = self.block_tokens
        head = req.fill_ids[:-1]  # at least one token is computed
        if req.disk_keys is None:  # hashed once: a prompt may be looked at again
            req.disk_keys = block_keys(head, req.disk_namespace, B)
        keys = req.disk_keys
        # a recurrent model's pool prefix is usable to its deepest snapshot only: KV past
        # it is loaded again with the state at its end (the trie frees the duplicates)
        # (a sliding-window model's, where its window holds KV)
        m = kv.match_head(head, req.namespace)
        pooled = len(m.slot_ids)
        blocks = []  # (index, tokens, key) of each block to load, then of a tail
        for k in range(pooled // B, len(keys)):
            if keys[k] not in self.keys:
                break
            blocks.append((k, B, keys[k]))
        # resumable only where a state was stored, and the window before is: cut back
        while blocks and not self._resumable(keys, blocks[-1][0], pooled):
            blocks.pop()
        if not (self.states or self.window):  # then a stored tail, if one continues it
            k = blocks[-1][0] + 1 if blocks else pooled // B
            blocks += self._tail(head, keys, k, pooled, req.disk_namespace)
        if any(key in taken for _, _, key in blocks):
            return None  # another prompt of this round loads them
        if not blocks:
            req.disk_checked = True
            return None
        end = blocks[-1][0] * B + blocks[-1][1]
        need = end - pooled
        if need > budget or kv.budget() < len(req.fill_ids) - pooled + reserve:
            return None
        kv.tree.inc_lock_ref(m.last_node)  # the pool part must survive the allocation
        slots = kv.alloc(need)
        state = kv.alloc_state() if self.states and slots is not None else 0
        kv.tree.dec_lock_ref(m.last_node)
        if slots is not None and self.states and not state:
            kv.allocator.free(slots)
            slots = None
        if slots is None:
            return None
        req.disk_checked = True
        loads, at = [], 0
        for k, n, key in blocks:
            offset = max(pooled - k * B, 0)
            window = bool(self.window) and window_key(key) in self.keys
            loads.append(BlockLoad(key, offset, slots[at : at + n - offset], window=window))
            at += n - offset
        loads[-1].state_slot = state
        taken.update(key for _, _, key in blocks)
        return PlannedLoad(req, head[:end], m.slot_ids, loads)

    def _resumable(self, keys: list[str], k: int, pooled: int) -> bool:
        """Whether a prompt can resume after block `k` loaded (the pool holds `pooled`
        tokens of it, where it can resume): the state after it is stored (recurrent
        layers), the sliding layers' KV of the window before it is (sliding windows)."""
        if self.states and state_key(keys[k]) not in self.keys:
            return False
        end = (k + 1) * self.block_tokens
        first = max(end - self.window, pooled) // self.block_tokens
        return not self.window or all(window_key(keys[j]) in self.keys for j in range(first, k + 1))

    def _tail(self, head: list[int], keys: list[str], k: int, pooled: int, namespace: int):
        """The longest stored tail that continues `head` at block `k` past the pool's
        `pooled` tokens, as [(k, its tokens, its key)], or []."""
        B = self.block_tokens
        parent = keys[k - 1] if k else root_key(namespace)
        for n, stored in sorted(self.tails.get(parent, {}).items(), reverse=True):
            if pooled < k * B + n <= len(head):
                key = block_key(parent, head[k * B : k * B + n])
                if key == stored and key in self.keys:
                    return [(k, n, key)]
        return []

    def _forget(self, keys) -> None:
        """Keys no longer on disk (dropped, or refused at a load)."""
        self.keys.difference_update(keys)
        for key in keys:
            parent = self.tail_parents.pop(key, None)
            if parent is not None:
                tails = self.tails[parent]
                del tails[next(n for n, k in tails.items() if k == key)]
                if not tails:
                    del self.tails[parent]

    def loaded(self, kv: KVCacheManager, planned: list[PlannedLoad], answer) -> None:
        """The worker's answer (BlocksLoaded, or a WorkerError: nothing loaded): loaded
        blocks into the trie, the rest's slots freed and their keys forgotten."""
        left = answer.loaded if isinstance(answer, BlocksLoaded) else 0
        refused = isinstance(answer, BlocksLoaded)  # the first block not loaded was refused
        self.in_flight -= sum(len(x.slots) for p in planned for x in p.loads)
        for plan in planned:
            n = min(left, len(plan.loads))
            left -= n
            slots = [s for x in plan.loads[:n] for s in x.slots]
            kv.allocator.free([s for x in plan.loads[n:] for s in x.slots])
            if refused and n < len(plan.loads):
                bad = plan.loads[n].key  # missing or damaged (or its state): not asked again
                self._forget((bad, state_key(bad), window_key(bad)))
                refused = False
            state = plan.loads[-1].state_slot  # read with the last block, else unused
            if state and n < len(plan.loads):
                kv.states.free([state])
                state = 0
            if not slots:
                continue
            tokens = plan.tokens[: len(plan.prefix) + len(slots)]
            self._insert_loaded(kv, plan, plan.loads[:n], tokens)
            plan.req.disk_tokens = len(slots)
            if state:  # the loaded prefix's snapshot (freed if the trie has one there)
                kv.attach_snapshot(tokens, state, plan.req.namespace)

    def _insert_loaded(self, kv: KVCacheManager, plan: PlannedLoad, loads, tokens) -> None:
        """The loaded blocks into the trie (runs of blocks loaded without their sliding
        layers' KV as windowless nodes); slots of tokens the trie held already are freed."""
        ns, given, at = plan.req.namespace, list(plan.prefix), len(plan.prefix)
        for windowless, run in groupby(loads, lambda x: bool(self.window) and not x.window):
            given += [s for x in run for s in x.slots]
            end, part = len(given), list(given)
            done = kv.tree.insert(tokens[:end], part, ns, windowless)
            kv.allocator.free(part[at:done])  # (an unlocked windowless node's, if swapped)
            if end < len(tokens):  # the next run's walk must meet the trie's own slots
                given = kv.tree.match_prefix(tokens[:end], ns).slot_ids
            at = end

    # ------------------------------------------------------------ reports

    @staticmethod
    def log_field(reqs: list[Req]) -> str:
        """`#disk-cached-token: N, ` for the per-batch log: of #cached-token, what the
        tier loaded for this batch's first admissions."""
        n = 0
        for req in reqs:
            if req.cached_tokens >= 0 and not req.disk_logged:
                req.disk_logged = True
                n += min(req.disk_tokens, req.cached_tokens)
        return f"#disk-cached-token: {n}, "

    def on_report(self, report: DiskReport | None) -> None:
        if report is None:
            return
        self._forget(report.dropped)
        self.keys.update(report.added)
        self.writable = report.writable
        self.reports.append(report)

    def take_reports(self) -> list[DiskReport]:
        out, self.reports = self.reports, []
        return out
