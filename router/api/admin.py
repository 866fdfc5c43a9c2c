"""The admin routes of a server with several models (router.serving.model_pool): load a
model now (or load a new version of a loaded one, `reload`, which then takes the new
requests while the old one finishes its own) and unload one. Behind the API key, as /v1/
is (router.api.http_server's guard)."""

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


class AdminRoutes:
    def __init__(self, models):
        self.models = models  # router.serving.model_pool.ModelPool

    async def load(self, req: LoadModelRequest):
        """Loads it (waiting for it, unlike a request, without bound); the model's card."""
        return await self.models.load(req.model, req.path, req.reload)

    async def unload(self, req: UnloadModelRequest):
        """Unloads it once its requests in flight are done; the model's card."""
        return await self.models.unload(req.model)
