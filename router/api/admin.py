"""The admin routes: with several models (router.serving.model_pool), load a model now
(or load a new version of a loaded one, `reload`, which then takes the new requests while
the old one finishes its own) and unload one; with one or several, load and unload a LoRA
adapter (router.api.lora_control; the body names vLLM's /v1/load_lora_adapter
uses). Behind the API key, as /v1/ is (router.api.http_server's guard)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class LoadModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    # a model directory: served under `model` from now on (a new model, or a new version)
    path: str | None = None
    # load it again even if it is loaded: the new pair takes over, the old one drains
    reload: bool = False


class UnloadModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)  # NAME, or BASE:NAME (the model it adapts)
    lora_path: str = Field(min_length=1)  # what mlx_lm.lora writes


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)


class LoraRoutes:
    def __init__(self, models):
        self.models = models  # SingleModel or ModelPool

    async def load(self, req: LoadLoraRequest):
        """Loads the adapter into its model's worker; the adapter's card."""
        return await self.models.load_lora(req.lora_name, req.lora_path)

    async def unload(self, req: UnloadLoraRequest):
        """Unloads it once its requests in flight are done; its card (`loaded`: false)."""
        return await self.models.unload_lora(req.lora_name)


class AdminRoutes:
    def __init__(self, models):
        self.models = models  # router.serving.model_pool.ModelPool

    async def load(self, req: LoadModelRequest):
        """Loads it (waiting for it, unlike a request, without bound); the model's card."""
        return await self.models.load(req.model, req.path, req.reload)

    async def unload(self, req: UnloadModelRequest):
        """Unloads it once its requests in flight are done; the model's card."""
        return await self.models.unload(req.model)
