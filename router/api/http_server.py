"""The OpenAI-compatible HTTP API (FastAPI on uvicorn): requests in, choices out
(`router.api.response_assembly` turns them into a body or a stream).

A client that goes away aborts its requests in the scheduler: a stream when Starlette sees
the disconnect (the stream task is cancelled), a non-streaming request through a watcher
that waits for `http.disconnect` while the answer is being generated.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from common.messages import Output
from router.api.access_log import AccessLog
from router.api.admin import AdminRoutes, LoraRoutes
from router.api.anthropic_api import anthropic_error_body
from router.api.anthropic_messages import AnthropicRoutes
from router.api.api_context import ApiContext
from router.api.cache_salt_header import SaltHeader
from router.api.chat_response import chat_renderer, plan_chat
from router.api.completion_response import CompletionRenderer
from router.api.constraints import output_grammar
from router.api.embeddings_api import EmbeddingRoutes
from router.api.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_logprobs,
    error_body,
    prompt_only,
)
from router.api.openai_responses import ResponsesRoutes
from router.api.request_body import field_path
from router.api.response_assembly import Choice, collect, stream
from router.api.served_models import SingleModel
from router.request_error import RequestError

# paths that need the API key, if one is set
_GUARDED = ("/v1/", "/tokenize", "/detokenize", "/admin/")
_ANTHROPIC = "/v1/messages"  # paths of the Anthropic API (its error bodies)
MAX_CHOICES = 64  # prompts x n in one request; each is a request of its own upstream

_STATUS_CODES = {
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
}


def create_app(models: SingleModel, args, metrics=None) -> FastAPI:
    """The app over `models`: a `SingleModel`, or the set of models loaded on demand
    (router.serving.model_pool.ModelPool, with the same methods and the admin routes)."""
    # the schema is published (schemathesis fuzzes the API from it); the docs UIs are not
    app = FastAPI(title="radix-mlx", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.add_middleware(_Guard, api_key=args.api_key, max_bytes=args.max_request_bytes)
    if args.allowed_origins:  # outside the guard: a preflight carries no API key
        app.add_middleware(
            CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=["*"],
            allow_headers=["*"],
        )  # fmt: skip
    if args.cache_salt_header:
        app.add_middleware(SaltHeader, header=args.cache_salt_header)
    app.add_middleware(AccessLog)  # outermost: it sees every answer, the guard's and CORS's
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    routes = _Routes(models, metrics)
    app.api_route("/", methods=["GET", "HEAD"])(routes.root)
    app.api_route("/health", methods=["GET", "HEAD"])(routes.health)
    app.get("/v1/models")(routes.models)
    app.get("/v1/models/{model_id:path}")(routes.model)
    app.get("/metrics")(routes.metrics_text)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    anthropic = AnthropicRoutes(models)
    app.post("/v1/messages")(anthropic.messages)
    app.post("/v1/messages/count_tokens")(anthropic.count_tokens)
    responses = ResponsesRoutes(models, args.responses_store_size)
    app.post("/v1/responses")(responses.create)
    app.get("/v1/responses/{response_id}")(responses.retrieve)
    app.delete("/v1/responses/{response_id}")(responses.delete)
    app.get("/v1/responses/{response_id}/input_items")(responses.input_items)
    app.post("/v1/embeddings")(EmbeddingRoutes(models).create)
    app.post("/tokenize")(routes.tokenize)
    app.post("/detokenize")(routes.detokenize)
    if hasattr(models, "load"):  # several models: loaded and unloaded on demand, or by hand
        admin = AdminRoutes(models)
        app.post("/admin/models/load")(admin.load)
        app.post("/admin/models/unload")(admin.unload)
    loras = LoraRoutes(models)
    app.post("/admin/loras/load")(loras.load)
    app.post("/admin/loras/unload")(loras.unload)
    return app


def _error(path: str, message: str, code: str, status: int, headers=None, param=None):
    """The API's error body: Anthropic's on its paths, OpenAI's elsewhere."""
    if path.startswith(_ANTHROPIC):
        return JSONResponse(anthropic_error_body(message, status), status, headers=headers)
    return JSONResponse(error_body(message, code, status, param), status, headers=headers)


async def _request_error(request: Request, exc: RequestError):
    return _error(request.url.path, exc.message, exc.code, exc.status, exc.headers, exc.param)


async def _validation_error(request: Request, exc: RequestValidationError):
    message, param = _describe(exc)
    return _error(request.url.path, message, "invalid_request_error", 400, param=param)


async def _http_error(request: Request, exc: HTTPException):
    code = _STATUS_CODES.get(exc.status_code, "invalid_request_error")
    return _error(request.url.path, str(exc.detail), code, exc.status_code, exc.headers)


class _Routes:
    """The OpenAI endpoints and the server's own (health, models, metrics, tokenize), over
    what every API's routes share (`ApiContext`)."""

    def __init__(self, models: SingleModel, metrics):
        self.served, self.metrics = models, metrics

    async def health(self):
        return self.served.health()

    async def root(self):
        """Some clients probe the base URL (`HEAD /`) before they send anything."""
        return {"status": "ok" if self.served.healthy else "starting"}

    async def models(self):
        return {"object": "list", "data": self.served.cards()}

    async def model(self, model_id: str):
        """A model's card, under the asked-for id (an alias's is its model's)."""
        if not model_id:
            raise RequestError("a model id is needed", "model_not_found", 404, param="model")
        return self.served.card(model_id)

    async def metrics_text(self):
        if self.metrics is None:
            return PlainTextResponse("", media_type="text/plain")
        body, content_type = self.metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    async def _check(self, req) -> ApiContext:
        """What a completion request needs before its prompt is looked at: its model's
        context."""
        api = await self.served.context(req.model)
        problem = req.unsupported()
        if problem:
            raise RequestError(problem, "unsupported_parameter")
        return api

    async def tokenize(self, req: TokenizeRequest):
        api = await self.served.context(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("give exactly one of prompt or messages")
        if req.messages is not None:
            ids = api.tok.encode_chat(req.messages)
        else:
            ids = api.tok.encode_text(req.prompt)
        return {"count": len(ids), "max_model_len": api.manager.max_model_len, "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest):
        api = await self.served.context(req.model)
        vocab = len(api.tokenizer)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise RequestError(f"tokens: token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": api.tokenizer.decode(req.tokens)}

    @staticmethod
    def _prompts(api: ApiContext, prompt) -> list[list[int]]:
        """The prompt, or each prompt of a batch, as token ids."""
        if isinstance(prompt, str):
            return [api.tok.encode_text(prompt)]
        if prompt and isinstance(prompt[0], str):
            return [api.tok.encode_text(p) for p in prompt]
        if prompt and isinstance(prompt[0], list):
            return [list(p) for p in prompt]
        return [list(prompt)]

    @staticmethod
    def _choices(api: ApiContext, req, prompts: list[list[int]], sampling, rid: str,
                 render_at) -> list:  # fmt: skip
        """`n` choices per prompt, index i answering prompt i // n; a seeded request's
        j-th sample of a prompt uses seed + j, so the samples differ and reproduce."""
        n = 1 if req.n is None else req.n
        total = n * len(prompts)
        if not 1 <= total <= MAX_CHOICES:
            raise RequestError(
                f"a request makes 1 to {MAX_CHOICES} choices (prompts x n), not {total}",
                param="n",
            )
        choices = []
        for index in range(total):
            ids, j = prompts[index // n], index % n
            nth = sampling
            if j and sampling.seed is not None:
                nth = dataclasses.replace(sampling, seed=(sampling.seed + j) % 2**63)
            sub_rid = rid if total == 1 else f"{rid}-{index}"
            chunks = api.start(req, ids, nth, sub_rid)  # checks the ids first
            render, prefix = render_at(index, ids)  # may decode them (echo)
            choices.append(Choice(chunks, render, index // n, prefix))
        return choices

    async def completions(self, req: CompletionRequest, request: Request):
        api = await self._check(req)
        prompts = self._prompts(api, req.prompt)
        grammar = output_grammar(req.response_format, req.regex, req.ebnf)
        max_new = req.max_tokens if req.max_tokens is not None else 16
        if max_new == 0 and not req.echo:
            raise RequestError(
                "max_tokens 0 needs echo: true (then the prompt is the answer)", param="max_tokens"
            )
        # at least one token is always generated; with max_tokens 0 it is not returned
        sampling = req.sampling(1 if max_new == 0 else max_new, grammar)
        sampling.prompt_logprobs = bool(req.echo) and req.logprobs is not None
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        body = partial(_body, api.names.reported_for(req.model), rid, created)
        logprobs = bool(sampling.logprobs)

        def render_at(index: int, ids: list[int]):
            render = CompletionRenderer(index, ids, logprobs, api.pieces, body)
            return render, api.tokenizer.decode(ids) if req.echo else ""

        choices = self._choices(api, req, prompts, sampling, rid, render_at)
        if max_new == 0:
            for choice in choices:
                choice.chunks = prompt_only(choice.chunks)
        return await _respond(req, request, choices)

    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        api = await self._check(req)
        grammar = output_grammar(req.response_format, req.regex, req.ebnf)
        max_new = req.max_completion_tokens
        if max_new is None:
            max_new = req.max_tokens
        messages, images = await api.take_images(req.messages)
        ids, prompt, grammar = plan_chat(
            api.tok, messages, req.tools, req.tool_choice, req.template_kwargs(), grammar,
            max_new,
        )  # fmt: skip
        ids = api.with_images(ids, images)
        max_new = api.tok.fit(len(ids), max_new)  # None: as much as the context leaves
        sampling = req.sampling(max_new, grammar)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs_of(c: Output) -> dict | None:
            if not sampling.logprobs or not c.token_ids:
                return None
            return chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs, api.pieces)

        body = partial(_body, api.names.reported_for(req.model), rid, created)

        def render_at(index: int, _ids: list[int]):
            return chat_renderer(prompt, index, bool(req.stream), body, logprobs_of), ""

        choices = self._choices(api, req, [ids], sampling, rid, render_at)
        return await _respond(req, request, choices)


def _body(model_name: str, rid: str, created: int, kind: str, choice: dict) -> dict:
    return {"id": rid, "object": kind, "created": created, "model": model_name,
            "choices": [choice]}  # fmt: skip


class _Guard:
    """Pure ASGI middleware (no per-chunk cost on streams): the API key on the API paths
    and the request body limit, checked on Content-Length and again on the bytes received,
    so a chunked upload cannot get around it."""

    def __init__(self, app, api_key: str | None, max_bytes: int):
        self.app = app
        self.bearer = f"Bearer {api_key}".encode() if api_key else None
        self.key = api_key.encode() if api_key else None  # Anthropic's x-api-key header
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.bearer is not None and scope["path"].startswith(_GUARDED):
            if (
                headers.get(b"authorization") != self.bearer
                and headers.get(b"x-api-key") != self.key
            ):
                reply = _error(scope["path"], "invalid or missing API key", "invalid_api_key", 401)
                return await reply(scope, receive, send)
        size = headers.get(b"content-length", b"")
        if size.isdigit() and int(size) > self.max_bytes:
            reply = _error(scope["path"], self._too_large(int(size)), "request_too_large", 413)
            return await reply(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self._too_large(seen))
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self, size: int) -> str:
        return f"request body of {size} bytes exceeds the limit of {self.max_bytes} bytes"


async def _respond(req, request: Request, choices: list[Choice]):
    """One JSON body, or a stream of events if the request asked for one."""
    if not req.stream:
        return await collect(request, choices)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await stream(request, choices, include_usage)


def _describe(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param: the first field at fault, as the request spells it)."""
    parts, params = [], []
    for err in exc.errors():
        loc = field_path([x for x in err.get("loc", ()) if x != "body"])
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error") or err.get("msg")
            return f"malformed JSON body: {detail}", None
        if not loc and err.get("type") == "missing":
            return "the request has no body; send a JSON object", None
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
        params.append(loc or None)
    return "invalid request: " + "; ".join(parts[:5]), params[0] if params else None
