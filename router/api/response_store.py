"""The stored responses of the Responses API (`store`, `previous_response_id`,
`GET`/`DELETE /v1/responses/{id}`): in memory, least recently used first out, bounded by
`--responses-store-size` responses. A stored response keeps what continuing its
conversation needs: the chat it answered, its answer as a chat turn, the prompt text the
template made of it and the exact token ids the model saw and wrote, so the next turn
can extend those ids and hit the radix cache for the whole conversation so far."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from router.manager import RequestError


@dataclass
class StoredResponse:
    body: dict  # the Response object as it was returned
    input_items: list[dict]  # this request's own input items, for GET .../input_items
    messages: list[dict]  # the chat it answered (earlier turns included), without instructions
    answer: dict  # its output as one assistant chat message
    rendered: str  # the prompt text the template made of `messages`
    token_ids: list[int]  # prompt and output ids (not a final stop token): the cache's


class ResponseStore:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self.items[response_id] = stored
        self.items.move_to_end(response_id)
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; a 404 naming the id when it was never stored, deleted or
        pushed out by newer ones."""
        stored = self.items.get(response_id)
        if stored is None:
            raise RequestError(
                f"Response with id '{response_id}' not found (never stored, deleted, or "
                f"evicted: this server keeps the last {self.capacity} responses, "
                "--responses-store-size).",
                "not_found", 404, param=param,
            )  # fmt: skip
        self.items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self.items[response_id]
