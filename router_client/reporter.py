"""Reporting finished requests to the prediction service, never in the router's way.

Outcomes go into a bounded buffer (``max_buffer``); when it is full the oldest outcome is
dropped, counted in ``dropped`` and logged, never silently. ``flush_due`` posts batches of at
most ``batch_size`` to ``POST /v1/observations`` if no back-off is pending; a failure keeps the
batch and backs off exponentially (``backoff_initial_s`` doubling up to ``backoff_max_s``).
A serving proxy runs it on its own thread (:meth:`start`); the simulator calls ``flush_due``
at each prediction refresh so that replays stay reproducible.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import httpx

log = logging.getLogger("balanceroute.reporter")


class ObservationReporter:
    def __init__(self, client: httpx.Client, max_buffer: int = 100_000, batch_size: int = 1000,
                 backoff_initial_s: float = 0.25, backoff_max_s: float = 10.0,
                 token: str | None = None) -> None:
        self.client = client
        self.buffer: deque[dict] = deque()
        self.max_buffer = max_buffer
        self.batch_size = batch_size
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.backoff_s = 0.0
        self.next_attempt = 0.0
        self.sent = 0
        self.dropped = 0
        self.failures = 0
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, outcomes: list[dict]) -> None:
        """Queue outcomes; never blocks on the network."""
        with self.lock:
            for outcome in outcomes:
                if len(self.buffer) >= self.max_buffer:
                    self.buffer.popleft()
                    self.dropped += 1
                    if self.dropped == 1 or self.dropped % 1000 == 0:
                        log.warning("observation buffer full: %d outcomes dropped so far",
                                    self.dropped)
                self.buffer.append(outcome)

    def pending(self) -> int:
        return len(self.buffer)

    def flush_due(self, force: bool = False) -> int:
        """Send what is queued unless backing off; returns how many were accepted."""
        if not force and time.monotonic() < self.next_attempt:
            return 0
        sent = 0
        while True:
            with self.lock:
                batch = [self.buffer[i] for i in range(min(self.batch_size, len(self.buffer)))]
            if not batch:
                return sent
            try:
                response = self.client.post("/v1/observations", json={"observations": batch},
                                            headers=self.headers)
                if response.status_code == 422:
                    # the service rejects this batch as invalid: retrying cannot help
                    log.error("observations rejected (422), %d dropped: %s", len(batch),
                              response.text[:300])
                    with self.lock:
                        for _ in batch:
                            self.buffer.popleft()
                        self.dropped += len(batch)
                    continue
                response.raise_for_status()
            except httpx.HTTPError as exc:
                self.failures += 1
                self.backoff_s = min(self.backoff_max_s,
                                     max(self.backoff_initial_s, self.backoff_s * 2))
                self.next_attempt = time.monotonic() + self.backoff_s
                log.info("observation report failed (%s); retry in %.2fs", exc, self.backoff_s)
                return sent
            with self.lock:
                for _ in batch:
                    self.buffer.popleft()
            self.sent += len(batch)
            sent += len(batch)
            self.backoff_s = 0.0
            self.next_attempt = 0.0

    def start(self, interval_s: float = 0.5) -> None:
        """Flush from a daemon thread every ``interval_s`` until :meth:`stop`."""
        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.flush_due()

        self._thread = threading.Thread(target=loop, name="observation-reporter", daemon=True)
        self._thread.start()

    def stop(self, final_flush: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if final_flush:
            self.flush_due(force=True)
