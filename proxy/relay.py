"""SSE relay helpers: what the proxy does to each upstream event.

The proxy always asks the decode rank for a stream with ``stream_options.include_usage`` (so
the engine's token count is authoritative and the router sees progress in-band), and

- for a streaming client relays every event, dropping the usage-only chunk if the client did
  not ask for usage;
- for a non-streaming client folds the events into one ``text_completion`` or
  ``chat.completion`` object (:class:`Aggregate`), tool calls included.

``tool_calls`` (and the legacy ``function_call``) finishes are natural ends, which
:class:`~router_client.sse.StreamTelemetry` reports to the mirrored state as ``stop``; their
argument deltas count as generated tokens. Each event is parsed once (the telemetry's parse is
the relay's) and relayed as the bytes the engine sent.
"""

from __future__ import annotations

from typing import Any

NATURAL_TOOL_FINISHES = ("tool_calls", "function_call")


def is_usage_only(chunk: dict[str, Any]) -> bool:
    return not chunk.get("choices") and chunk.get("usage") is not None


class Aggregate:
    """Folds ``completions`` or ``chat.completions`` stream chunks into one response."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if not self.head:
            self.head = {k: chunk.get(k) for k in ("id", "created", "model")}
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            index = int(choice.get("index", 0))
            slot = self.choices.setdefault(index, {"text": [], "tools": {}, "role": "assistant",
                                                   "finish_reason": None, "logprobs": None})
            if choice.get("finish_reason"):
                slot["finish_reason"] = choice["finish_reason"]
            if not self.chat:
                slot["text"].append(choice.get("text") or "")
                continue
            delta = choice.get("delta") or {}
            if delta.get("role"):
                slot["role"] = delta["role"]
            if delta.get("content"):
                slot["text"].append(delta["content"])
            for call in delta.get("tool_calls") or []:
                entry = slot["tools"].setdefault(int(call.get("index", 0)), {
                    "id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                if call.get("id"):
                    entry["id"] = call["id"]
                if call.get("type"):
                    entry["type"] = call["type"]
                function = call.get("function") or {}
                entry["function"]["name"] += function.get("name") or ""
                entry["function"]["arguments"] += function.get("arguments") or ""

    def result(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            slot = self.choices[index]
            text = "".join(slot["text"])
            if self.chat:
                message: dict[str, Any] = {"role": slot["role"],
                                           "content": text if text or not slot["tools"] else None}
                if slot["tools"]:
                    message["tool_calls"] = [slot["tools"][i] for i in sorted(slot["tools"])]
                choices.append({"index": index, "message": message,
                                "finish_reason": slot["finish_reason"], "logprobs": None})
            else:
                choices.append({"index": index, "text": text,
                                "finish_reason": slot["finish_reason"], "logprobs": None})
        return {**self.head, "object": "chat.completion" if self.chat else "text_completion",
                "choices": choices, "usage": self.usage}
