"""What every API's routes share over one model's router manager and tokenizer (the
OpenAI routes in router.api.http_server, the Anthropic ones in
router.api.anthropic_messages, the SDK's front door): the tokenization, the model names
it answers to, and a request's start: its generation, counted in the metrics and the
access log. A request gets its model's context from router.api.served_models, which
checks its `model` first."""

from __future__ import annotations

from collections.abc import AsyncIterator

from common.messages import Output, SamplingParams
from router.api.access_log import count_usage
from router.api.cache_salt_header import request_salt
from router.api.generation import Tokenization, generate_text
from router.api.image_inputs import Limits, Prepared, VisionInputs
from router.api.model_names import ModelNames
from router.api.openai_api import TokenPieces
from router.metrics import track_finish
from router.replicas.manager import RouterManager


class ApiContext:
    """One model's manager, tokenizer, arguments and metrics, and what the routes of
    every API do alike with them."""

    def __init__(self, manager: RouterManager, tokenizer, args, metrics,
                 names: ModelNames | None = None):  # fmt: skip
        self.manager, self.tokenizer, self.args, self.metrics = manager, tokenizer, args, metrics
        self.tok = Tokenization(tokenizer, manager, clamp=not args.strict_max_tokens)
        # the SDK's: a max_tokens beyond what the context leaves is refused, never cut
        self.strict_tok = Tokenization(tokenizer, manager)
        # the names this model answers to: the server's flags, or its entry's among several
        self.names = names or ModelNames(
            args.served_model_names,
            args.model_alias or [],
            args.model_path,
            [spec.name for spec in args.loras],
        )
        self.model_name = self.names.reported  # the name responses report
        self.pieces = TokenPieces(tokenizer)  # token texts and bytes for logprobs
        limits = Limits(args.max_image_bytes, args.max_images_per_request, args.allow_image_urls)
        # a vision model's image handling; None: image parts are refused as any non-text
        # (the tokenizer was loaded from the resolved model directory; --model-path may be
        # a Hugging Face id)
        model_dir = getattr(tokenizer, "name_or_path", None) or args.model_path
        self.vision = VisionInputs.of(model_dir, tokenizer, limits)
        if self.vision is not None:
            self.tok.expand_text = self.strict_tok.expand_text = self.vision.expand_text

    async def take_images(self, messages: list) -> tuple[list, list[Prepared]]:
        """The chat with its images taken out (a vision model's; else as it is)."""
        if self.vision is None or not isinstance(messages, list):
            return messages, []
        return await self.vision.take(messages)

    def with_images(self, ids: list[int], images: list[Prepared]) -> list[int]:
        """The rendered prompt's ids with its images' runs (PromptIds), if it has any."""
        return self.vision.expand(ids, images) if images else ids

    def start(
        self,
        req,
        ids: list[int],
        sampling: SamplingParams,
        rid: str,
        priority_len: int = 0,
        route_key: str | None = None,
    ) -> AsyncIterator[Output]:
        """The request's chunks of generated text; the prompt's ids are checked first. It
        shares cached prefixes only under its cache salt, and keeps its first
        `priority_len` tokens cached ahead of others; `route_key` (a client's
        prompt_cache_key) picks its replica (router.replicas.routing.by_key)."""
        sampling = self.tok.check_ids(ids, sampling, req.invalid)
        stops = req.stop_strings()
        salt = request_salt(req.cache_salt)
        lora = self.names.adapter(req.model)  # its LoRA adapter's id (0: the base model)
        chunks = generate_text(
            self.manager, self.tokenizer, ids, sampling, stops, rid, salt, priority_len,
            route_key, lora,
        )  # fmt: skip
        return count_usage(track_finish(chunks, self.metrics, rid))
