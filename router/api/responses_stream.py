"""A response's output items and OpenAI's stream events for them, built from the
generation's chunks: the answer's text split (router.chat_output) into a reasoning item
(its thought as summary text), a message item (its text) and function_call items, each
opened, filled and closed with the events OpenAI sends, numbered by `sequence_number`.
The non-streaming route runs the same builder and returns the final Response."""

from __future__ import annotations

import time
import uuid

from common.messages import Output
from router.chat_output import REASONING, OutputSplitter, Parts, ToolCall, ToolDelta
from router.chat_response import ChatPrompt

# an Output's finish reason -> the Response's status
_STATUS = {"stop": "completed", "length": "incomplete", "abort": "failed"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """Feed the chunks in order; every call returns the stream events it made."""

    def __init__(self, head: dict, prompt: ChatPrompt, seal=None, parallel: bool = True):
        self.response = head | {"created_at": time.time(), "status": "in_progress", "output": []}
        self.splitter = OutputSplitter(prompt.fmt, prompt.tools, prompt.thinking)
        self.seal, self.parallel = seal, parallel  # seal: for encrypted reasoning, if asked
        self.seq = 0
        self.item: dict | None = None  # the open output item
        self.space = ""  # whitespace between items, held until a message opens
        self.text = ""  # the open item's text (summary text, message text, arguments)
        self.calls: dict[str, dict] = {}  # call id -> its item
        self.call_at: dict[int, dict] = {}  # the splitter's call index -> its item
        self.token_ids: list[int] = []
        self.reasoning_tokens = 0

    @property
    def output(self) -> list[dict]:
        return self.response["output"]

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        return [
            self.event("response.created", response=dict(self.response)),
            self.event("response.in_progress", response=dict(self.response)),
        ]

    def feed(self, c: Output) -> list[dict]:
        if self.splitter.state == REASONING:  # a token that ends the thought is one of it
            self.reasoning_tokens += len(c.token_ids)
        self.token_ids += c.token_ids
        parts = self.splitter.feed(c.text, final=c.finish_reason is not None)
        return self._items(parts)

    def _items(self, parts: Parts) -> list[dict]:
        out = []
        if parts.reasoning:
            out += self._reasoning(parts.reasoning)
        text = parts.content
        if text and (self.item or {}).get("type") != "message" and not text.strip():
            self.space, text = self.space + text, ""
        if text:
            out += self._message(self.space + text)
            self.space = ""
        for delta in parts.tool_deltas:
            out += self._call_delta(delta)
        for call in parts.tool_calls:
            out += self._call_done(call)
        return out

    # ------------------------------------------------------------ items

    def _open(self, item: dict) -> list[dict]:
        out = self.close()
        self.item, self.text = item, ""
        self.output.append(item)
        return out + [self.event("response.output_item.added", output_index=self.index,
                                 item=dict(item))]  # fmt: skip

    @property
    def index(self) -> int:
        return len(self.output) - 1

    def _reasoning(self, text: str) -> list[dict]:
        out = []
        if (self.item or {}).get("type") != "reasoning":
            out += self._open({"id": new_id("rs"), "type": "reasoning", "summary": []})
            out.append(self._summary_event("response.reasoning_summary_part.added",
                                           part={"type": "summary_text", "text": ""}))  # fmt: skip
        self.text += text
        return out + [self._summary_event("response.reasoning_summary_text.delta", delta=text)]

    def _summary_event(self, kind: str, **fields) -> dict:
        ids = {"item_id": self.item["id"], "output_index": self.index, "summary_index": 0}
        return self.event(kind, **ids, **fields)

    def _message(self, text: str) -> list[dict]:
        out = []
        if (self.item or {}).get("type") != "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}  # fmt: skip
            out += self._open(item)
            out.append(self._part_event("response.content_part.added", part=_text_part("")))
        self.text += text
        return out + [self._part_event("response.output_text.delta", delta=text, logprobs=[])]

    def _part_event(self, kind: str, **fields) -> dict:
        ids = {"item_id": self.item["id"], "output_index": self.index, "content_index": 0}
        return self.event(kind, **ids, **fields)

    def _call_delta(self, delta: ToolDelta) -> list[dict]:
        out = []
        if delta.name is not None and (self.parallel or not self.calls):
            item = {"id": new_id("fc"), "type": "function_call", "call_id": delta.id,
                    "name": delta.name, "arguments": "", "status": "in_progress"}  # fmt: skip
            out += self._open(item)
            self.calls[delta.id] = self.call_at[delta.index] = item
        if self.item is None or self.call_at.get(delta.index) is not self.item:
            return out  # a call left out (parallel_tool_calls false) or already closed
        if delta.arguments:
            self.text += delta.arguments
            out.append(self.event("response.function_call_arguments.delta",
                                  item_id=self.item["id"], output_index=self.index,
                                  delta=delta.arguments))  # fmt: skip
        return out

    def _call_done(self, call: ToolCall) -> list[dict]:
        item = self.calls.get(call.id)
        if item is None or item is not self.item:
            return []
        self.text = call.arguments  # as parsed: the deltas' text unless the format differs
        item["status"] = "completed"
        return self.close()

    def close(self, status: str = "completed") -> list[dict]:
        """Events that close the open item, if any."""
        item, text = self.item, self.text
        if item is None:
            return []
        self.item, self.text = None, ""
        index = self.output.index(item)
        ids = {"item_id": item["id"], "output_index": index}
        out = []
        if item["type"] == "reasoning":
            part = {"type": "summary_text", "text": text}
            out += [
                self.event("response.reasoning_summary_text.done", **ids, summary_index=0,
                           text=text),
                self.event("response.reasoning_summary_part.done", **ids, summary_index=0,
                           part=part),
            ]  # fmt: skip
            item["summary"] = [part]
            if self.seal is not None:
                item["encrypted_content"] = self.seal.seal(text)
        elif item["type"] == "message":
            out += [
                self.event("response.output_text.done", **ids, content_index=0, text=text,
                           logprobs=[]),
                self.event("response.content_part.done", **ids, content_index=0,
                           part=_text_part(text)),
            ]  # fmt: skip
            item["content"], item["status"] = [_text_part(text)], status
        else:  # a call closed before its end (cut short, or unparsable) is incomplete
            out.append(self.event("response.function_call_arguments.done", **ids,
                                  name=item["name"], arguments=text))  # fmt: skip
            item["arguments"] = text
            if item["status"] != "completed":
                item["status"] = "incomplete"
        return out + [self.event("response.output_item.done", output_index=index, item=item)]

    # ------------------------------------------------------------ the end

    def finish(self, last: Output) -> list[dict]:
        """The events that end the response (`last`: the final chunk, with the usage)."""
        status = _STATUS.get(last.finish_reason, "completed")
        out = []
        if not any(item["type"] != "reasoning" for item in self.output):
            out += self._message(self.space)  # an answer of nothing (or space) still has one
            self.space = ""
        out += self.close("incomplete" if status == "incomplete" else "completed")
        self.response["status"] = status
        self.response["usage"] = self.usage(last)
        if status == "incomplete":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        elif status == "failed":
            error = {"code": "server_error", "message": "the request was aborted upstream"}
            self.response["error"] = error
        return out + [self.event(f"response.{status}", response=self.response)]

    def fail(self, message: str, code: str) -> list[dict]:
        """A failure midway: an `error` event, then `response.failed`."""
        self.response["status"] = "failed"
        self.response["error"] = {"code": "server_error", "message": message}
        return [
            self.event("error", code=code, message=message, param=None),
            self.event("response.failed", response=self.response),
        ]

    def usage(self, last: Output) -> dict:
        output = last.completion_tokens
        return {
            "input_tokens": last.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": last.cached_tokens,
                "cache_write_tokens": last.prompt_tokens - last.cached_tokens,  # now cached
            },
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": min(self.reasoning_tokens, output)},
            "total_tokens": last.prompt_tokens + output,
        }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
