"""Prompt token counts without a tokenizer.

The proxy needs ``s_i`` (the KV tokens a request adds to a rank) before the engine has seen the
request. Exact when the request carries token ids (``prompt`` as a list of ints, as
``vllm bench serve`` sends with ``--tokenize-on-client``, or a list of such lists); otherwise
estimated as ``ceil(chars / 4)`` (about four characters per token for English BPE
vocabularies), plus ``CHAT_OVERHEAD_PER_MESSAGE`` tokens per chat message for the template.
With prefill instances (``--prefill``) the proxy uses the prefill engine's exact count instead.
The emulator uses the same rules, so proxy and emulator agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

CHARS_PER_TOKEN = 4
CHAT_OVERHEAD_PER_MESSAGE = 4


def text_tokens(text: str) -> int:
    """The estimate for one text: ``ceil(chars / CHARS_PER_TOKEN)``."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def message_texts(messages: list[Any]) -> Iterator[str]:
    """The texts of chat messages: each string content, and each content part's ``text``
    (``[{"type": "text", "text": ...}, ...]``)."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            yield from (part.get("text") or "" for part in content if isinstance(part, dict))


def completion_tokens(prompt: Any, count_text: Callable[[str], int]) -> int:
    """``s_i`` of a completions ``prompt`` (at least 1): token ids as they are, each text by
    ``count_text``, a list of prompts summed."""
    if isinstance(prompt, str):
        return max(1, count_text(prompt))
    if isinstance(prompt, list):
        if not prompt or isinstance(prompt[0], int):  # token ids (not checked one by one)
            return max(1, len(prompt))
        total = 0
        for item in prompt:
            if isinstance(item, str):
                total += count_text(item)
            elif isinstance(item, list):
                total += len(item)
        return max(1, total)
    return 1


def prompt_tokens(body: dict[str, Any]) -> int:
    """``s_i`` for a completions or chat body (at least 1)."""
    if "messages" in body:
        messages = body.get("messages") or []
        chars = sum(map(len, message_texts(messages)))
        return max(1, math.ceil(chars / CHARS_PER_TOKEN)
                   + CHAT_OVERHEAD_PER_MESSAGE * len(messages))
    return completion_tokens(body.get("prompt", ""), text_tokens)


def calibratable(body: dict[str, Any]) -> bool:
    """Whether the engine's count of this body can teach :class:`PromptCalibration` the
    estimate's bias: text :func:`prompt_tokens` reads all of (a text prompt, or a chat of
    text messages), nothing it leaves out (``tools``, tool calls, images and other parts)."""
    if "messages" in body:
        if body.get("tools") or body.get("functions"):
            return False
        for message in body.get("messages") or []:
            if not isinstance(message, dict) or message.get("tool_calls") \
                    or message.get("function_call"):
                return False
            content = message.get("content")
            if isinstance(content, list) and not all(
                    isinstance(part, dict) and part.get("type", "text") == "text"
                    for part in content):
                return False
        return True
    prompt = body.get("prompt", "")
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt)
                                       and all(isinstance(item, str) for item in prompt))


class PromptCalibration:
    """The estimate's bias, learned from the engines' own counts: ``usage.prompt_tokens`` of
    finished requests against what :func:`prompt_tokens` estimated for them (only bodies it
    estimates whole: :func:`calibratable`). Each request's ratio, clipped to ``bounds``,
    counts once whatever its length (the mean of the log ratios, decayed with a half-life of
    ``half_life`` requests, so it follows a change of traffic): one huge prompt cannot swing
    it, and a client sending odd bodies moves it by no more than its share of requests. Its
    exponential scales later estimates once ``min_samples`` requests have been seen. English
    text keeps it near 1; Chinese text, one to two characters a token with the tokenizers of
    Chinese-trained models, moves it to about 2-3. A per-request error remains where
    languages mix: give the proxy ``--tokenizer`` for exact counts."""

    def __init__(self, min_samples: int = 20, half_life: float = 500.0,
                 bounds: tuple[float, float] = (0.25, 8.0)) -> None:
        self.min_samples = min_samples
        self.decay = 0.5 ** (1.0 / half_life)
        self.bounds = bounds
        self.log_sum = 0.0
        self.weight = 0.0
        self.samples = 0

    def observe(self, estimated: int, reported: int) -> None:
        if estimated <= 0 or reported <= 0:
            return
        low, high = self.bounds
        ratio = min(max(reported / estimated, low), high)
        self.log_sum = self.log_sum * self.decay + math.log(ratio)
        self.weight = self.weight * self.decay + 1.0
        self.samples += 1

    @property
    def factor(self) -> float:
        """Engine tokens per estimated token (1 until ``min_samples`` requests)."""
        if self.samples < self.min_samples:
            return 1.0
        return math.exp(self.log_sum / self.weight)

    def apply(self, estimate: int) -> int:
        return max(1, math.ceil(round(estimate * self.factor, 6)))  # (no 351 for 3.5 x 100)


def body_problem(body: dict[str, Any], chat: bool) -> str | None:
    """What is wrong, naming the field, with the fields the proxy itself reads (None: nothing);
    the rest is the engine's to judge."""
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        return "'stream' must be true or false"
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        return "'stream_options' must be an object"
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            return f"'{field}' must be a whole number >= 1"
    if "messages" in body or chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list of messages"
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                return f"'messages[{i}]' must be an object"
            content = message.get("content")
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if isinstance(part, dict) and not isinstance(part.get("text") or "", str):
                        return f"'messages[{i}].content[{j}].text' must be a string"
            elif content is not None and not isinstance(content, str):
                return f"'messages[{i}].content' must be a string or a list of parts"
    return None


def max_tokens(body: dict[str, Any], default: int = 256) -> int:
    """The requested output cap (``max_completion_tokens`` wins for chat, as in OpenAI's API)."""
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return int(value) if isinstance(value, int) and value > 0 else default
