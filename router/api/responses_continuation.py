"""The prompt of a response that continues a stored one (`previous_response_id`) as the
token ids the radix cache already holds, extended.

Re-rendering the whole conversation with the chat template would not give them: templates
write an earlier assistant turn otherwise than the model saw it (Qwen3's drops the empty
thinking block its generation prompt opened), and a text re-encoded can split into other
tokens, so the cached prefix would end at the previous answer, or before it. Instead the
new prompt is the previous prompt's ids and the ids the model wrote (but a final stop
token), then the template's text for everything after the answer: the end of the
assistant's turn, the new input and the generation prompt.

That holds only when the earlier part renders now as it did then (same instructions,
tools, thinking switch) and the template writes the conversation as the earlier text
followed by more; when it does not, the whole conversation is rendered and encoded as a
chat completion would be.
"""

from __future__ import annotations

from router.api.response_store import StoredResponse
from router.generation import Tokenization

# the answer's stand-in, to find where the template ends an assistant's turn
_ANSWER_MARK = "\u27e6radix-mlx:answer\u27e7"


class Continuation:
    def __init__(self, tok: Tokenization, prev: StoredResponse, system: list[dict], tools,
                 template_kwargs: dict):  # fmt: skip
        self.tok, self.prev, self.system = tok, prev, system
        self.tools, self.kwargs = tools, template_kwargs

    def encode(self, full: str) -> list[int]:
        """The ids of `full`, the conversation's text as the template renders it."""
        tail = self.tail(full)
        if tail is None:
            return self.tok.encode_rendered(full)
        return self.prev.token_ids + self.tok.encode_rendered(tail)

    def tail(self, full: str) -> str | None:
        """The text after the previous answer: the end of its turn, and what follows."""
        prev = self.prev
        if not prev.token_ids:
            return None
        earlier = self.system + prev.messages
        if self._render(earlier, True) != prev.rendered:
            return None  # instructions, tools or the thinking switch changed its prompt
        done = self._render([*earlier, prev.answer], False)
        marked = self._render([*earlier, {"role": "assistant", "content": _ANSWER_MARK}], False)
        at = marked.rfind(_ANSWER_MARK)
        if at < 0:
            return None
        closing = marked[at + len(_ANSWER_MARK) :]
        if not full.startswith(done) or not done.endswith(closing):
            return None
        return closing + full[len(done) :]

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tok.render_chat(messages, self.tools, self.kwargs, generation_prompt)
