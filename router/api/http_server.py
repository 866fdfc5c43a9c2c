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
from router.api.anthropic_api import anthropic_error_body
from router.api.anthropic_messages import AnthropicRoutes
from router.api.api_context import ApiContext
from router.api.cache_salt_header import SaltHeader
from router.api.chat_response import chat_renderer, plan_chat
from router.api.completion_response import CompletionRenderer
from router.api.constraints import output_grammar
from router.api.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    TokenPieces,
    chat_logprobs,
    error_body,
    prompt_only,
)
from router.api.openai_responses import ResponsesRoutes
from router.api.request_body import field_path
from router.api.response_assembly import Choice, collect, stream
from router.replicas.manager import RouterManager
from router.request_error import RequestError

_GUARDED = ("/v1/", "/tokenize", "/detokenize")  # paths that need the API key, if one is set
_ANTHROPIC = "/v1/messages"  # paths of the Anthropic API (its error bodies)
MAX_CHOICES = 64  # prompts x n in one request; each is a request of its own upstream

_STATUS_CODES = {
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
}


def create_app(manager: RouterManager, tokenizer, args, metrics=None) -> FastAPI:
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
    api = ApiContext(manager, tokenizer, args, metrics)
    routes = _Routes(api)
    app.api_route("/", methods=["GET", "HEAD"])(routes.root)
    app.api_route("/health", methods=["GET", "HEAD"])(routes.health)
    app.get("/v1/models")(routes.models)
    app.get("/v1/models/{model_id:path}")(routes.model)
    app.get("/metrics")(routes.metrics_text)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    anthropic = AnthropicRoutes(api)
    app.post("/v1/messages")(anthropic.messages)
    app.post("/v1/messages/count_tokens")(anthropic.count_tokens)
    responses = ResponsesRoutes(api, args.responses_store_size)
    app.post("/v1/responses")(responses.create)
    app.get("/v1/responses/{response_id}")(responses.retrieve)
    app.delete("/v1/responses/{response_id}")(responses.delete)
    app.get("/v1/responses/{response_id}/input_items")(responses.input_items)
    app.post("/tokenize")(routes.tokenize)
    app.post("/detokenize")(routes.detokenize)
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

    def __init__(self, api: ApiContext):
        self.api, self.manager, self.tok = api, api.manager, api.tok
        self.pieces = TokenPieces(api.tokenizer)

    async def health(self):
        """200 while a replica serves; the body says why not, and lists every replica."""
        replicas = [r.describe() for r in self.manager.replicas]
        if self.manager.healthy and self.manager.ready is not None:
            return JSONResponse({"status": "ok", "replicas": replicas})
        reason = self.manager.unhealthy_reason or "starting"
        return JSONResponse({"status": reason, "replicas": replicas}, status_code=503)

    async def root(self):
        """Some clients probe the base URL (`HEAD /`) before they send anything."""
        return {"status": "ok" if self.manager.healthy else "starting"}

    def _card(self, model_id: str) -> dict:
        return {
            "id": model_id,
            "object": "model",
            "created": 0,
            "owned_by": "radix-mlx",
            "max_model_len": self.manager.max_model_len,
        }

    async def models(self):
        return {"object": "list", "data": [self._card(name) for name in self.api.names.served]}

    async def model(self, model_id: str):
        """A served name's card; an alias's is the same model's under the asked-for id."""
        if not model_id:
            raise RequestError("a model id is needed", "model_not_found", 404, param="model")
        self.api.names.check(model_id)
        return self._card(model_id)

    async def metrics_text(self):
        if self.api.metrics is None:
            return PlainTextResponse("", media_type="text/plain")
        body, content_type = self.api.metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    def _check(self, req) -> None:
        """What a completion request needs before its prompt is looked at."""
        self.api.check_model(req)
        problem = req.unsupported()
        if problem:
            raise RequestError(problem, "unsupported_parameter")

    async def tokenize(self, req: TokenizeRequest):
        self.api.check_model(req)
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("give exactly one of prompt or messages")
        if req.messages is not None:
            ids = self.tok.encode_chat(req.messages)
        else:
            ids = self.tok.encode_text(req.prompt)
        return {"count": len(ids), "max_model_len": self.manager.max_model_len, "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest):
        self.api.check_model(req)
        vocab = len(self.api.tokenizer)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise RequestError(f"tokens: token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": self.api.tokenizer.decode(req.tokens)}

    def _prompts(self, prompt) -> list[list[int]]:
        """The prompt, or each prompt of a batch, as token ids."""
        if isinstance(prompt, str):
            return [self.tok.encode_text(prompt)]
        if prompt and isinstance(prompt[0], str):
            return [self.tok.encode_text(p) for p in prompt]
        if prompt and isinstance(prompt[0], list):
            return [list(p) for p in prompt]
        return [list(prompt)]

    def _choices(self, req, prompts: list[list[int]], sampling, rid: str, render_at) -> list:
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
            chunks = self.api.start(req, ids, nth, sub_rid)  # checks the ids first
            render, prefix = render_at(index, ids)  # may decode them (echo)
            choices.append(Choice(chunks, render, index // n, prefix))
        return choices

    async def completions(self, req: CompletionRequest, request: Request):
        self._check(req)
        prompts = self._prompts(req.prompt)
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

        body = partial(self._body, rid, created)
        logprobs = bool(sampling.logprobs)

        def render_at(index: int, ids: list[int]):
            render = CompletionRenderer(index, ids, logprobs, self.pieces, body)
            return render, self.api.tokenizer.decode(ids) if req.echo else ""

        choices = self._choices(req, prompts, sampling, rid, render_at)
        if max_new == 0:
            for choice in choices:
                choice.chunks = prompt_only(choice.chunks)
        return await _respond(req, request, choices)

    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        self._check(req)
        grammar = output_grammar(req.response_format, req.regex, req.ebnf)
        max_new = req.max_completion_tokens
        if max_new is None:
            max_new = req.max_tokens
        messages, images = await self.api.take_images(req.messages)
        ids, prompt, grammar = plan_chat(
            self.tok, messages, req.tools, req.tool_choice, req.template_kwargs(), grammar,
            max_new,
        )  # fmt: skip
        ids = self.api.with_images(ids, images)
        max_new = self.tok.fit(len(ids), max_new)  # None: as much as the context leaves
        sampling = req.sampling(max_new, grammar)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs_of(c: Output) -> dict | None:
            if not sampling.logprobs or not c.token_ids:
                return None
            return chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs, self.pieces)

        body = partial(self._body, rid, created)

        def render_at(index: int, _ids: list[int]):
            return chat_renderer(prompt, index, bool(req.stream), body, logprobs_of), ""

        return await _respond(req, request, self._choices(req, [ids], sampling, rid, render_at))

    def _body(self, rid: str, created: int, kind: str, choice: dict) -> dict:
        return {
            "id": rid,
            "object": kind,
            "created": created,
            "model": self.api.model_name,
            "choices": [choice],
        }


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
