"""In-band telemetry from OpenAI-compatible streaming responses (SSE).

:class:`SSEParser` turns raw bytes, in whatever pieces the network delivers them, into events:
``data:`` lines joined per event, comments (``:``) and other fields skipped, ``[DONE]``
recognized. :class:`StreamTelemetry` reads ``completions`` chunks (``choices[].text``) and
``chat.completions`` chunks (``choices[].delta.content``): each chunk with content advances the
request's generated count by one (one content delta per decode step, as engines stream by
default); a ``usage`` object, when present, sets the count to ``completion_tokens`` (the
engine's own figure wins); a ``finish_reason`` ends the request (``stop``, ``length``; others
map to ``error``). A malformed chunk is counted and skipped. A stream that closes without a
finish ends the request as ``error`` (right-censored).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from .state import MirroredFleet

DONE = "[DONE]"


class SSEParser:
    """Incremental Server-Sent Events parser yielding each event's data string."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> Iterator[str]:
        self._buffer += chunk
        while True:
            cut = self._buffer.find(b"\n")
            if cut < 0:
                return
            raw, self._buffer = self._buffer[:cut], self._buffer[cut + 1:]
            line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
            if line == "":
                if self._data:
                    yield "\n".join(self._data)
                    self._data = []
                continue
            if line.startswith(":"):
                continue  # comment / keep-alive
            name, _, value = line.partition(":")
            if name == "data":
                self._data.append(value[1:] if value.startswith(" ") else value)

    def close(self) -> Iterator[str]:
        """End of stream: a last event without its blank line still counts."""
        if self._buffer:
            yield from self.feed(b"\n")
        if self._data:
            yield "\n".join(self._data)
            self._data = []


@dataclass
class StreamTelemetry:
    """Feeds one request's stream into the mirrored fleet state."""

    fleet: MirroredFleet
    request_id: str
    generated: int = 0
    finished: str | None = None
    malformed: int = 0
    done: bool = False

    def __post_init__(self) -> None:
        self.parser = SSEParser()

    def feed(self, chunk: bytes, now: float) -> None:
        for data in self.parser.feed(chunk):
            self._event(data, now)

    def close(self, now: float) -> str:
        """The stream ended (normally or not); returns how the request ended."""
        for data in self.parser.close():
            self._event(data, now)
        if self.finished is None:
            self.finished = "error"  # cut mid-way: censored, and the slot is freed
            self.fleet.finish(self.request_id, "error", now, self.generated)
        return self.finished

    def _event(self, data: str, now: float) -> None:
        if data.strip() == DONE:
            self.done = True
            return
        try:
            chunk = json.loads(data)
            choices = chunk.get("choices") or []
            usage = chunk.get("usage")
        except (json.JSONDecodeError, AttributeError):
            self.malformed += 1
            return
        if not isinstance(choices, list):
            self.malformed += 1
            return
        finish = None
        for choice in choices:
            if not isinstance(choice, dict):
                self.malformed += 1
                continue
            delta = choice.get("delta")
            text = choice.get("text")
            content = delta.get("content") if isinstance(delta, dict) else text
            if content:
                self.generated += 1
            finish = choice.get("finish_reason") or finish
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.generated = usage["completion_tokens"]
            if self.finished is not None:  # usage comes in its own chunk after the finish
                self.fleet.amend_outcome(self.request_id, self.generated)
        if self.finished is not None:
            return
        self.fleet.progress(self.request_id, self.generated, now)
        if finish:
            self.finished = finish if finish in ("stop", "length") else "error"
            self.fleet.finish(self.request_id, self.finished, now, self.generated)
