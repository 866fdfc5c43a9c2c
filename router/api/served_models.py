"""The models the HTTP API serves, by the name a request gives: one model, started with
the server (`SingleModel`), or several loaded on demand (router.serving.model_pool's
`ModelPool`, which has the same methods). Each model's routes run over its own
`ApiContext` (manager, tokenizer, names)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from router.api.api_context import ApiContext
from router.api.lora_control import LoraControl


def model_card(model_id: str, max_model_len: int, **extra) -> dict:
    """A `/v1/models` entry (OpenAI's Model object, plus the context it serves)."""
    card = {"id": model_id, "object": "model", "created": 0, "owned_by": "radix-mlx"}
    return {**card, "max_model_len": max_model_len, **extra}


class SingleModel:
    """The one model of `--model-path`: its names (`--served-model-name`, `--model-alias`)
    all reach the same context."""

    def __init__(self, api: ApiContext):
        self.api = api
        self.metrics = api.metrics
        self.loras = LoraControl(api.manager, api.names, api.args)  # /admin/loras/*

    async def context(self, name: str | None) -> ApiContext:
        """The context a request naming `name` runs over: a replica serves (else 503),
        and the name is one this server answers to (else 404)."""
        self.api.manager.check_ready()
        self.api.names.check(name)
        return self.api

    def cards(self) -> list[dict]:
        names = self.api.names
        return [self.card(name) for name in [*names.served, *names.loras]]

    def card(self, model_id: str) -> dict:
        """A served name's card; an alias's is the same model's under the asked-for id; a
        LoRA adapter's names the model it adapts as its `parent`."""
        names = self.api.names
        names.check(model_id)
        extra = {"parent": names.reported} if names.adapter(model_id) else {}
        return model_card(model_id, self.api.manager.max_model_len, **extra)

    async def load_lora(self, name: str, path: str) -> dict:
        """Serve the adapter at `path` as `name` (`NAME` or `BASE:NAME`); its card."""
        base, _, lora = name.rpartition(":")
        if base:
            self.api.names.check(base)
        await self.loras.load(lora, path)
        return self.card(lora)

    async def unload_lora(self, name: str) -> dict:
        lora = self.api.names.adapter_name(name) or name
        await self.loras.unload(lora)
        return model_card(lora, self.api.manager.max_model_len, parent=self.api.names.reported,
                          loaded=False)  # fmt: skip

    def health(self) -> JSONResponse:
        """200 while a replica serves; the body says why not, and lists every replica."""
        manager = self.api.manager
        replicas = [r.describe() for r in manager.replicas]
        if manager.healthy and manager.ready is not None:
            return JSONResponse({"status": "ok", "replicas": replicas})
        reason = manager.unhealthy_reason or "starting"
        return JSONResponse({"status": reason, "replicas": replicas}, status_code=503)

    @property
    def healthy(self) -> bool:
        return self.api.manager.healthy
