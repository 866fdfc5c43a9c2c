"""Which model names the API answers to: the served names (`--served-model-name`,
repeatable; the first is the one responses report), the model path as given, and any name
an alias glob (`--model-alias`) matches, so that an agent's side calls for another model
(`claude-haiku-4-5`) reach the one served. Any other name is a 404."""

from __future__ import annotations

from fnmatch import fnmatchcase

from router.request_error import RequestError


class ModelNames:
    def __init__(self, served: list[str], aliases: list[str], model_path: str):
        self.served, self.aliases, self.model_path = list(served), list(aliases), model_path

    @property
    def reported(self) -> str:
        return self.served[0]

    def accepts(self, name: str | None) -> bool:
        """Whether a request naming `name` (none: the served model) is served here."""
        if name in (None, "", self.model_path) or name in self.served:
            return True
        return any(fnmatchcase(name, pattern) for pattern in self.aliases)

    def check(self, name: str | None) -> None:
        if not self.accepts(name):
            raise RequestError(
                f"model {name!r} does not exist; serving {self.reported!r}",
                "model_not_found",
                404,
                param="model",
            )
