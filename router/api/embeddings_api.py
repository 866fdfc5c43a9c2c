"""OpenAI's `POST /v1/embeddings`: inputs to token ids, checked here; the embeddings
come from the scheduler (`RouterManager.embed`) and are shaped here (`dimensions`,
`encoding_format`).

The worker returns each embedding pooled and, unless the model's sentence-transformers
config has no Normalize module, L2-normalized (worker_mlx/embed_pass.py). `dimensions`
keeps the first N and normalizes again, as OpenAI's text-embedding-3 models do (a model
that does not normalize is only truncated). `base64` is the little-endian float32 bytes,
as OpenAI sends them; `user` is accepted and ignored.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import StrictInt

from router.api.access_log import count_embedded
from router.api.api_context import ApiContext
from router.api.request_body import RequestBody
from router.request_error import RequestError

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request (scheduler/embedding.py too)


class EmbeddingRequest(RequestBody):
    model: str | None = None
    # a string, a list of strings, a list of token ids or of token-id lists: checked by
    # `_inputs`, whose message says so (pydantic's for a union lists every branch)
    input: Any
    dimensions: StrictInt | None = None
    encoding_format: Literal["float", "base64"] | None = None
    user: str | None = None


class EmbeddingRoutes:
    def __init__(self, models):
        self.models = models  # router.api.served_models: each request's model's ApiContext

    async def create(self, req: EmbeddingRequest):
        api = await self.models.context(req.model)
        if api.names.adapter(req.model):  # the embed pass runs no adapter: not silently
            raise RequestError(
                f"model {req.model!r} is a LoRA adapter, which does not embed: name its base "
                f"{api.model_name!r}", param="model",
            )  # fmt: skip
        width = self._width(api)
        if req.dimensions is not None and not 1 <= req.dimensions <= width:
            raise RequestError(
                f"dimensions must be between 1 and the model's {width}, not {req.dimensions}",
                param="dimensions",
            )
        inputs = self._inputs(api, req.input)
        out = await api.manager.embed(inputs)
        count_embedded(out.prompt_tokens)
        vectors = [np.frombuffer(v, dtype="<f4") for v in out.embeddings]
        if req.dimensions is not None:
            vectors = [self._truncate(api, v, req.dimensions) for v in vectors]
        as_base64 = req.encoding_format == "base64"
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(v, as_base64)}
            for i, v in enumerate(vectors)
        ]
        usage = {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens}
        return {"object": "list", "data": data, "model": api.model_name, "usage": usage}

    def _width(self, api: ApiContext) -> int:
        """The model's embedding width; a 400 when this server cannot embed."""
        args = api.args
        if args.tp_size > 1 or args.pp_size > 1:
            raise RequestError(
                "embeddings are not served by a distributed worker (--tp-size/--pp-size)",
                "unsupported_parameter",
            )
        ready = api.manager.ready
        width = ready.embedding_dim if ready is not None else 0
        if not width:
            raise RequestError(
                f"model {api.model_name!r} cannot embed here: the worker's log says "
                "why (a body that returns no hidden states, or a distributed worker)",
                param="model",
            )
        return width

    def _inputs(self, api: ApiContext, given) -> list[list[int]]:
        """Each input as token ids: a string, a list of strings, a list of token ids (one
        input) or a list of token-id lists."""
        if isinstance(given, str):
            given = [given]
        if not isinstance(given, list) or not given:
            raise RequestError("input must not be empty" if given == [] else _SHAPE, param="input")
        if all(_is_id(x) for x in given):
            given = [given]
        if not all(isinstance(x, str) or (isinstance(x, list) and all(map(_is_id, x)))
                   for x in given):  # fmt: skip
            raise RequestError(_SHAPE, param="input")
        if len(given) > MAX_INPUTS:
            raise RequestError(f"input has {len(given)} items; at most {MAX_INPUTS}", param="input")
        tok, vocab = api.tok, len(api.tokenizer)
        context = api.manager.ready.context_len
        inputs = []
        for i, item in enumerate(given):
            ids = tok.encode_text(item) if isinstance(item, str) else list(item)
            if not ids:
                raise RequestError(f"input[{i}] is empty", param="input")
            if min(ids) < 0 or max(ids) >= vocab:
                raise RequestError(f"input[{i}]: token ids must be in [0, {vocab})", param="input")
            if len(ids) > context:
                raise RequestError(
                    f"input[{i}] has {len(ids)} tokens, more than the model's context of "
                    f"{context}", "context_length_exceeded", param="input",
                )  # fmt: skip
            inputs.append(ids)
        return inputs

    def _truncate(self, api: ApiContext, vector: np.ndarray, n: int) -> np.ndarray:
        kept = vector[:n]
        if not api.manager.ready.embedding_normalized:
            return kept
        norm = float(np.linalg.norm(kept))
        return kept / max(norm, 1e-12)


_SHAPE = "input must be a string, a list of strings, a list of token ids or of token-id lists"


def _is_id(x) -> bool:
    return type(x) is int


def _encoded(vector: np.ndarray, as_base64: bool):
    if as_base64:
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float64).tolist()
