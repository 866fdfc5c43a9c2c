"""Req: one generation request and everything the scheduler knows about it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from common.messages import ImagePart, SamplingParams


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    namespace: int = 0  # the trie's namespace of its cache salt and adapter (cache_salt.py)
    lora: int = 0  # its LoRA adapter's id (0: the base model)
    priority_len: int = 0  # its prompt's first tokens to keep cached ahead of others
    images: list[ImagePart] = field(default_factory=list)  # a vision prompt's, for the worker
    output_ids: list[int] = field(default_factory=list)
    # KV bookkeeping: slots of the first `cache_len` tokens belong to the trie (locked via
    # `last_node`); the request owns the rest. `num_computed` tokens have KV.
    cache_len: int = 0
    num_computed: int = 0
    last_node: Any = None
    dup_slots: list[int] = field(default_factory=list)
    # Recurrent layers: the working state slot, held from admission to release, the
    # snapshots (token count, state slot) the worker takes in the step in flight, and
    # token counts where a later piece is to take one (where other prompts branch off).
    state_slot: int = 0
    pending_snapshots: list[tuple[int, int]] = field(default_factory=list)
    branch_points: list[int] = field(default_factory=list)
    cached_tokens: int = -1  # prefix hit at first admission, reported in usage
    # the disk tier: whether its prompt was looked up there, and the tokens loaded for it
    disk_checked: bool = False
    disk_loading: bool = False  # its blocks are being read: not admitted meanwhile
    disk_deferred: bool = False  # its blocks wait for loads ahead of it: not admitted yet
    disk_keys: list[str] | None = None  # its prompt's block keys, once hashed
    disk_namespace: int = 0  # its block keys' namespace: salt and adapter identity
    disk_tokens: int = 0
    disk_logged: bool = False
    finish_reason: str | None = None
    to_abort: bool = False
    arrival: float = field(default_factory=time.monotonic)
    sent_len: int = 0  # output tokens already reported to the router
    queue_time: float = -1.0  # seconds from arrival to the first prefill
    memory_blocked: float = 0.0  # monotonic time admission first found no memory for it
    logprobs: list[float] = field(default_factory=list)  # per output token, if asked
    top_logprobs: list[list] = field(default_factory=list)
    prompt_logprobs: list | None = None  # the prompt's, if asked, from its first prefill

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV a prefill must provide: the prompt and, after retraction, outputs."""
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return self.sampling.max_new_tokens - len(self.output_ids)

    def check_finished(self, eos_ids: frozenset[int]) -> None:
        """Set `finish_reason` after a new token: stop token, eos, or length."""
        tok = self.output_ids[-1]
        if tok in self.sampling.stop_token_ids or (not self.sampling.ignore_eos and tok in eos_ids):
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.sampling.max_new_tokens:
            self.finish_reason = "length"
