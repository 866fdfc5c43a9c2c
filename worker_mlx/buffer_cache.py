"""A bound on mlx's buffer cache that follows what the steps need.

mlx keeps freed buffers for reuse up to its cache limit (the CPU backend raises it to
1 GiB), but it reuses one only for an allocation of nearly the same size. Under traffic
of varied prompt lengths almost every step's temporaries have new sizes, so the cache
fills with buffers no later step reuses: the worker's RSS grew by the whole limit over
minutes (1.2 -> 1.8 GiB in the soak, `mx.get_cache_memory()` growing one for one with
RSS while active memory stayed at 17-35 MiB on the tiny model).

What reuse needs is room for a step's own temporaries: those of one layer for the next
layer, and a whole step's for the next step of the same shape (decode). So the limit is
held at FACTOR x the biggest step's temporaries seen so far (peak active memory less
what was resident after loading), within [FLOOR, the limit the backend installed]. It
only grows, to what the largest step needs, so the worker's RSS levels off once the
longest prompts have been seen instead of creeping up to the backend's limit.
"""

from __future__ import annotations

import mlx.core as mx

FACTOR = 2
FLOOR = 64 << 20  # bytes: more than the tiny and small models' decode-step temporaries


class BufferCacheBound:
    def __init__(self, cap: int | None = None):
        """`cap`: the most --max-memory leaves the cache (worker_mlx/memory.py)."""
        self.ceiling = mx.set_cache_limit(FLOOR)  # the backend's limit
        if cap is not None:
            self.ceiling = min(self.ceiling, cap)
        self.resident = mx.get_active_memory()  # the weights and the pools
        mx.reset_peak_memory()  # loading's own temporaries are not a step's
        self.limit = min(FLOOR, self.ceiling)
        mx.set_cache_limit(self.limit)

    def after_step(self) -> None:
        temporaries = mx.get_peak_memory() - self.resident
        wanted = min(self.ceiling, max(FLOOR, FACTOR * temporaries))
        if wanted > self.limit:
            self.limit = wanted
            mx.set_cache_limit(wanted)
