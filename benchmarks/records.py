"""The serving benchmark's data: prompts, workloads, and what each request and run measured.

Every other benchmark module imports these from here, so none imports another for a type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

# benchmarks.replay's backend: the scheduler and the worker in the benchmark's process
INPROCESS = "radix-mlx-inprocess"


@dataclass
class Prompt:
    """One prompt as token ids (for radix-mlx) and as text (for text-only servers)."""

    ids: list[int]
    text: str


@dataclass
class Session:
    """Requests sent one after another: turns of a conversation, or cold then warm.

    With `carry_history` each turn's prompt is the previous prompt, the answer the server
    actually gave, and then this turn's prompt as the new user message. `history_as_text`
    re-tokenizes that answer's text for every backend, as a text client would.
    """

    turns: list[Prompt]
    output_lens: list[int]
    labels: list[str]
    carry_history: bool = False
    history_as_text: bool = False


@dataclass
class WorkloadSpec:
    """A workload's name and parameters, recorded with every run."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        """Short id of the load, used to line runs up in the comparison."""
        short = "-".join(f"{v}" for v in self.params.values())
        return f"{self.name}[{short}]"


class SuiteLoad(NamedTuple):
    """One load of a suite: its workload, at these concurrencies, on these backends, on
    the preset's looping build (outputs that repeat, `--loop`) or its plain one."""

    spec: WorkloadSpec
    concurrencies: list[int]
    backends: tuple[str, ...]
    loop: bool = False


@dataclass
class RequestResult:
    """One request as the client saw it (times in seconds)."""

    label: str
    prompt_len: int
    requested_len: int
    ok: bool = False
    error: str = ""
    output_len: int = 0  # the server's completion_tokens (or the streamed count)
    streamed_tokens: int | None = None  # token ids seen in chunks; None if not sent
    reported_prompt_len: int | None = None
    cached_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""


@dataclass
class RunResult:
    """One workload against one backend at one concurrency and rate."""

    backend: str
    transport: str
    workload: WorkloadSpec
    max_concurrency: int | None
    request_rate: float
    duration: float
    requests: list[RequestResult]
    info: dict[str, Any] = field(default_factory=dict)
    repeat: int = 0  # which repeat of the plan (another seed, fresh servers)

    def load_key(self) -> str:
        """Which runs are comparable: same load, different backend."""
        return f"{self.workload.key()} c{self.max_concurrency or 'inf'} r{self.request_rate}"
