"""The messages of the SDK link (client <-> the router's ZMQ front door) and the sampling
parameters they carry: the SDK's half of the wire protocol, which the server's own
messages (`common.messages`) build on.

Here, under the `radix_mlx` package, so that `from radix_mlx import Client` imports them
whatever the user's directory holds (a `common.py` or a `router.py` of their own would
shadow the server's top-level packages); `common.messages` re-exports them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------- sampling

GRAMMAR_KINDS = ("", "json_schema", "regex", "lark", "ebnf")


@dataclass
class SamplingParams:
    """Per-request sampling; `temperature == 0` means greedy."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # 0 is off too, as in mlx-lm (its default) and vLLM
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # token id (a decimal string, as in OpenAI's JSON) -> added to its logit, in [-100, 100]
    logit_bias: dict[str, float] = field(default_factory=dict)
    # Constrained decoding (common/grammar_spec.py): the kind of `grammar` ("" for none,
    # or one of GRAMMAR_KINDS) and its source text; the worker masks every step with it.
    grammar_kind: str = ""
    grammar: str = ""
    # The prompt's own logprobs (echo + logprobs): every prompt token's after the first,
    # with `top_logprobs` alternatives each.
    prompt_logprobs: bool = False

    def __post_init__(self):
        if isinstance(self.logit_bias, dict):  # the SDK's int keys as the wire's strings
            self.logit_bias = {str(k): v for k, v in self.logit_bias.items()}

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidParam naming the first parameter out of range."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):  # fmt: skip
            value = getattr(self, name)
            if not _finite(value):  # NaN compares false with every bound: say what it is
                raise InvalidParam(name, f"must be a finite number, not {value}")
        checks = [
            (self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be >= 1, or 0 or -1 for off"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (0 <= self.top_logprobs <= 20, "top_logprobs", "must be in [0, 20]"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise InvalidParam(name, rule)
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise InvalidParam("stop_token_ids", f"must be in [0, {vocab_size})")
        self.bias_by_token(vocab_size)
        if self.grammar_kind not in GRAMMAR_KINDS or bool(self.grammar_kind) != bool(self.grammar):
            raise InvalidParam("grammar_kind", f"must be one of {GRAMMAR_KINDS[1:]} with a grammar")

    def bias_by_token(self, vocab_size: int | None = None) -> dict[int, float]:
        """`logit_bias` with int token ids; InvalidParam naming the first bad entry."""
        if not isinstance(self.logit_bias, dict):
            raise InvalidParam("logit_bias", "must map token ids to biases")
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.isdecimal() or (vocab_size is not None and int(key) >= vocab_size):
                vocab = f"[0, {vocab_size})" if vocab_size is not None else "the vocabulary"
                raise InvalidParam("logit_bias", f"keys must be token ids in {vocab}, got {key!r}")
            if type(bias) not in (int, float) or not (_finite(bias) and -100 <= bias <= 100):
                raise InvalidParam("logit_bias", f"values must be in [-100, 100], got {bias!r}")
            out[int(key)] = float(bias)
        return out

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1
            or self.frequency_penalty != 0
            or self.presence_penalty != 0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _finite(x: float) -> bool:
    return math.isfinite(x)


class InvalidParam(ValueError):
    """A sampling parameter out of range: `field` (SamplingParams' name, which an API may
    call otherwise: OpenAI's max_tokens is max_new_tokens) and the rule it breaks."""

    def __init__(self, field: str, rule: str):
        super().__init__(f"{field} {rule}")
        self.field, self.rule = field, rule


# ---------------------------------------------------------------- SDK <-> router


@dataclass
class ClientGenerate:
    rid: str
    sampling: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    stream: bool = False
    api_key: str | None = None  # required when the server runs with --api-key
    # only requests with the same salt share cached prompt prefixes (vLLM's cache_salt)
    cache_salt: str | None = None
    # the model, on a server with several (`radix-mlx serve --model-dir`); None: the first
    model: str | None = None


@dataclass
class ClientAbort:
    rid: str


@dataclass
class Output:
    """What a generation produced: an increment of it (a chunk) or all of it, with
    `finish_reason` set on the last and usage counted so far. The one output record of
    the router (HTTP and the SDK front door) and, as ClientResult, of the SDK link;
    `router.output.OutputAccumulator` merges chunks into wholes.

    `logprobs` and `top_logprobs` are per output token, 1:1 with `token_ids`: the sampled
    token's logprob, and its best alternatives as [[token_id, logprob], ...]. Both are
    None when the request did not ask for them, or when they cannot be aligned with the
    token ids (a chunk with tokens came without them)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[list[Any]] | None = None
    prompt_logprobs: list[Any] | None = None  # as TokenOut's, on the first chunk


@dataclass(kw_only=True)
class ClientResult(Output):
    """An Output of the SDK request `rid`: a streamed increment, or the whole answer when
    the request does not stream."""

    rid: str


@dataclass
class ClientError:
    rid: str
    message: str
    code: str = "invalid_request_error"
    status: int = 400


def _registry(*classes: type) -> dict[str, type]:
    return {c.__name__: c for c in classes}


FRONTDOOR_INBOX = _registry(ClientGenerate, ClientAbort)
CLIENT_INBOX = _registry(ClientResult, ClientError)
