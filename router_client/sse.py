"""In-band telemetry from OpenAI-compatible streaming responses (SSE).

:class:`SSEParser` turns raw bytes, in whatever pieces the network delivers them, into events:
``data:`` lines joined per event, comments (``:``) and other fields skipped, ``[DONE]``
recognized. It works on bytes (no decoding: a proxy forwards the payload as it came).
:class:`StreamTelemetry` reads ``completions`` chunks (``choices[].text``) and
``chat.completions`` chunks (``choices[].delta.content``, ``tool_calls``, ``function_call``):
each chunk with generated content advances the request's generated count by one (one delta per
decode step, as engines stream by default); a ``usage`` object, when present, sets the count to
``completion_tokens`` (the engine's own figure wins); a ``finish_reason`` ends the request
(``stop``, ``length``; ``tool_calls`` and ``function_call`` are natural ends and count as
``stop``; others map to ``error``). A malformed chunk is counted and skipped. A stream that
closes without a finish ends the request as ``error`` (right-censored).

A caller that already parsed a chunk (the proxy parses each one once, to relay it) hands it to
:meth:`StreamTelemetry.observe` instead of feeding the bytes again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from .state import MirroredFleet

DONE = "[DONE]"
NATURAL_FINISHES = {"stop": "stop", "length": "length", "tool_calls": "stop",
                    "function_call": "stop"}


class SSEParser:
    """Incremental Server-Sent Events parser yielding each event's data."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []

    def events(self, chunk: bytes) -> list[bytes]:
        """The data of every event completed by ``chunk`` (bytes, as sent)."""
        buffer = self._buffer + chunk if self._buffer else chunk
        out: list[bytes] = []
        start = 0
        find = buffer.find
        while True:
            cut = find(b"\n", start)
            if cut < 0:
                break
            line = buffer[start:cut]
            start = cut + 1
            if line[-1:] == b"\r":
                line = line[:-1]
            if not line:
                if self._data:
                    data = self._data
                    out.append(data[0] if len(data) == 1 else b"\n".join(data))
                    self._data = []
            elif line[:5] == b"data:":
                self._data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif line == b"data":
                self._data.append(b"")
            # comments (":...") and other fields (event, id, retry) are skipped
        self._buffer = buffer[start:]
        return out

    def feed(self, chunk: bytes) -> Iterator[str]:
        for data in self.events(chunk):
            yield data.decode("utf-8", errors="replace")

    def close_events(self) -> list[bytes]:
        """End of stream: a last event without its blank line still counts."""
        out = self.events(b"\n") if self._buffer else []
        if self._data:
            out.append(b"\n".join(self._data))
            self._data = []
        return out

    def close(self) -> Iterator[str]:
        for data in self.close_events():
            yield data.decode("utf-8", errors="replace")


def is_done(data: bytes) -> bool:
    return data[:6] == b"[DONE]" or data.strip() == b"[DONE]"


@dataclass
class StreamTelemetry:
    """Feeds one request's stream into the mirrored fleet state."""

    fleet: MirroredFleet
    request_id: str
    generated: int = 0
    finished: str | None = None
    reason: str | None = None  # the engine's own finish_reason
    malformed: int = 0
    done: bool = False
    # the client asked for exactly max_tokens tokens (``ignore_eos``, a benchmark's replay): a
    # ``length`` finish is the end it chose, not a cut, so the fleet (and the prediction
    # service, which learns from it) records it as a complete output, not a censored one;
    # ``finished`` and ``reason`` keep the engine's word
    fixed_length: bool = False
    prompt_tokens: int | None = None  # the engine's own count, from ``usage`` where it comes

    def __post_init__(self) -> None:
        self.parser = SSEParser()

    def feed(self, chunk: bytes, now: float) -> None:
        for data in self.parser.events(chunk):
            self.event(data, now)

    def close(self, now: float) -> str:
        """The stream ended (normally or not); returns how the request ended."""
        for data in self.parser.close_events():
            self.event(data, now)
        if self.finished is None:
            self.finished = "error"  # cut mid-way: censored, and the slot is freed
            self.fleet.finish(self.request_id, "error", now, self.generated)
        return self.finished

    def event(self, data: bytes, now: float) -> dict[str, Any] | None:
        """One event's data; returns the parsed chunk (None for [DONE] or malformed)."""
        if is_done(data):
            self.done = True
            return None
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.malformed += 1
            return None
        return chunk if self.observe(chunk, now) else None

    def observe(self, chunk: Any, now: float) -> bool:
        """One parsed chunk; False (and counted) if it is not a chunk object."""
        if not isinstance(chunk, dict):
            self.malformed += 1
            return False
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            self.malformed += 1
            return False
        finish = None
        for choice in choices:
            if not isinstance(choice, dict):
                self.malformed += 1
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if (delta.get("content") or delta.get("tool_calls")
                        or delta.get("function_call")):
                    self.generated += 1
            elif choice.get("text"):
                self.generated += 1
            finish = choice.get("finish_reason") or finish
        usage = chunk.get("usage")
        if isinstance(usage, dict) and type(usage.get("prompt_tokens")) is int:
            self.prompt_tokens = usage["prompt_tokens"]
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.generated = usage["completion_tokens"]
            if self.finished is not None:  # usage comes in its own chunk after the finish
                self.fleet.amend_outcome(self.request_id, self.generated)
        if self.finished is not None:
            return True
        self.fleet.progress(self.request_id, self.generated, now)
        if finish:
            self.reason = str(finish)
            self.finished = NATURAL_FINISHES.get(self.reason, "error")
            recorded = ("stop" if self.fixed_length and self.finished == "length"
                        else self.finished)
            self.fleet.finish(self.request_id, recorded, now, self.generated)
        return True
