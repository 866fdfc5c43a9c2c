"""What every HTTP request body (OpenAI's and Anthropic's) shares: valid Unicode text, and
errors that name the request's own fields.

JSON may spell a lone UTF-16 surrogate (`"a\\ud800b"`), which Python's JSON parser keeps
as a str no tokenizer, grammar compiler or UTF-8 encoder accepts; such a body is refused
here, as it is parsed, so no endpoint sees it. Sampling limits are checked once, by
SamplingParams under its own names; `param_name` gives the name the request used
(OpenAI's `max_tokens` is `max_new_tokens` there), for the error's message and `param`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from common.cache_salt import salt_problem
from common.messages import InvalidParam
from router.request_error import RequestError


def field_path(loc: Sequence[str | int]) -> str:
    """A field's path as OpenAI's `param` spells it: `messages[0].content`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def lone_surrogate(value: Any, loc: tuple = ()) -> tuple[tuple, str] | None:
    """(path, surrogate) of the first str in `value` (keys included) that holds a lone
    UTF-16 surrogate, or None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return loc, value[exc.start]
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate(key, loc) or lone_surrogate(item, (*loc, key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate(item, (*loc, i))
            if found:
                return found
    return None


class RequestBody(BaseModel):
    """Base of the API's request bodies. Unknown fields are allowed (clients send other
    servers' extensions)."""

    model_config = ConfigDict(extra="allow")
    # SamplingParams field -> this request's name for it, where they differ
    SAMPLING_NAMES: ClassVar[dict[str, str]] = {}
    # vLLM's: only requests with the same salt share cached prefixes (common/cache_salt.py)
    cache_salt: Any = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """Refuse a lone surrogate with a 400 naming its field. A RequestError, not a
        ValueError: pydantic lets it through, to the API's error handler, as it is."""
        found = lone_surrogate(data)
        if found:
            path, surrogate = field_path(found[0]) or "body", f"\\u{ord(found[1]):04x}"
            raise RequestError(
                f"{path}: a lone UTF-16 surrogate ({surrogate}) is not valid Unicode text",
                param=None if path == "body" else path,
            )
        return data

    @field_validator("cache_salt")
    @classmethod
    def _valid_salt(cls, salt: Any) -> Any:
        problem = salt_problem(salt)
        if problem:
            raise RequestError(problem, param="cache_salt")
        return salt

    def param_name(self, sampling_field: str) -> str:
        return self.SAMPLING_NAMES.get(sampling_field, sampling_field)

    def invalid(self, exc: InvalidParam) -> RequestError:
        """A sampling parameter out of range, in the request's own words."""
        name = self.param_name(exc.field)
        return RequestError(f"{name} {exc.rule}", param=name)
