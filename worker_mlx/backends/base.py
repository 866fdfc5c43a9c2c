"""The device profile every backend fills in (see the package's docstring); its own module
so that the profiles (cpu.py, gpu.py) and `select` in `__init__` import it one way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Name = Literal["cpu", "metal", "cuda"]


@dataclass(frozen=True)
class Backend:
    name: Name
    prefill_step: int
    mem_fraction: float
    compile_decode: bool

    def max_memory(self) -> int:
        """The default --max-memory: bytes this process may hold on the device, in all."""
        raise NotImplementedError

    def wire(self, model_bytes: int) -> None:
        """Keep the weights resident where the device can (Metal's wired memory)."""

    def install(self, model: Any, positions: int | None = None) -> Callable[[], None]:
        """Apply this backend's changes to the process and `model`; returns their undo.
        `positions`: the most a request's can reach (the server's context length; None:
        the model's own)."""
        return _nothing

    def describe(self) -> str:
        """One line for the start-up log."""
        compiled = "compiled" if self.compile_decode else "uncompiled"
        return f"{self.name}: prefill step {self.prefill_step}, {compiled} decode step"


def _nothing() -> None:
    pass
