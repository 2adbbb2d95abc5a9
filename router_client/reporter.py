"""Reporting finished requests to the prediction service, never in the router's way.

Outcomes go into a bounded buffer (``max_buffer``); when it is full the oldest outcome is
dropped, counted in ``dropped`` and logged, never silently. Each outcome is checked before it
is queued (:func:`invalid_reason`, the rules of ``POST /v1/observations``): a bad one is
rejected alone (``rejected``, logged) instead of making its whole batch fail.

:meth:`ObservationReporter.flush_due` posts batches of at most ``batch_size``. One flush runs
at a time: a batch is taken out of the buffer before it is sent, so a concurrent flush (the
reporter's thread and a caller) can neither send it twice nor pop what is not there, and a
second caller returns at once instead of waiting. Answers:

- 2xx: delivered (``sent``; ``duplicates`` counts ids the service already had).
- 422 or 400 (the service rejects the batch, which stores nothing): the batch is split in
  halves until the bad outcomes are isolated; they are dropped (``rejected``), the rest is
  delivered. 413 (too large) is split the same way.
- 401, 403, 404: a configuration error (wrong token, wrong URL). Logged at ERROR, counted
  (``config_errors``), exposed as ``config_error``; what is buffered is dropped and later
  outcomes are not queued, so nothing is retried forever. The caller decides (``balanceroute
  ab`` exits non-zero).
- anything else (5xx, 429, timeout, connection refused): the batch goes back to the front of
  the buffer and the reporter backs off exponentially (``backoff_initial_s`` doubling up to
  ``backoff_max_s``).

Two ways to run it. A serving proxy runs it on its own thread (:meth:`start`, which
:class:`~router_client.http_predictor.HttpPredictor` does lazily by default), woken every
``interval_s`` or as soon as a full batch waits: routing never waits on it. A replay calls
``flush_due`` itself at each prediction refresh, so that what the service has learned at each
refresh, and so the run, is reproducible. :meth:`stop` makes one final, time-bounded flush and
reports what was delivered and what was lost (a log line and :meth:`stats`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import httpx

log = logging.getLogger("balanceroute.reporter")

MAX_TOKENS = 1_048_576  # the service's bound on token counts
MAX_REQUEST_ID = 128
MAX_PROMPT_KEY = 256
FINISH_REASONS = frozenset({"stop", "length", "cancelled", "error"})
CONFIG_ERROR_STATUS = frozenset({401, 403, 404})
SPLIT_STATUS = frozenset({400, 413, 422})


def _bad_text(value: str) -> str | None:
    if "\x00" in value:
        return "contains NUL"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate"
    return None


def invalid_reason(outcome: Any) -> str | None:
    """Why the service would refuse this outcome (None if it would not)."""
    if not isinstance(outcome, dict):
        return "not an object"
    request_id = outcome.get("request_id")
    if not isinstance(request_id, str) or not 1 <= len(request_id) <= MAX_REQUEST_ID:
        return f"request_id must be a string of 1-{MAX_REQUEST_ID} characters"
    problem = _bad_text(request_id)
    if problem:
        return "request_id " + problem
    key = outcome.get("prompt_key")
    if key is not None:
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_PROMPT_KEY:
            return f"prompt_key must be a string of 1-{MAX_PROMPT_KEY} characters"
        problem = _bad_text(key)
        if problem:
            return "prompt_key " + problem
    prompt = outcome.get("prompt")
    if prompt is not None:
        if not isinstance(prompt, str):
            return "prompt must be a string"
        problem = _bad_text(prompt)
        if problem:
            return "prompt " + problem
    for field, required in (("output_tokens", True), ("prompt_tokens", False)):
        value = outcome.get(field)
        if value is None and not required:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not (
                0 <= value <= MAX_TOKENS):
            return f"{field} must be an integer in 0..{MAX_TOKENS}"
    reason = outcome.get("finish_reason", "stop")
    if reason not in FINISH_REASONS:
        return f"finish_reason must be one of {sorted(FINISH_REASONS)}"
    return None


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
        self.sent = 0  # delivered: answered 2xx (duplicates included)
        self.duplicates = 0  # of those, ids the service already had
        self.dropped = 0  # lost: buffer overflow, configuration error, left at stop
        self.rejected = 0  # invalid outcomes, refused locally or isolated from a 422
        self.failures = 0  # failed attempts (retried)
        self.config_errors = 0
        self.config_error: str | None = None  # set on 401/403/404; nothing is retried then
        self.lock = threading.Lock()  # guards the buffer and the counters
        self._flushing = threading.Lock()  # one flush at a time
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # -- queueing (the routing path: never blocks on the network) --------------------------
    def add(self, outcomes: list[dict]) -> None:
        """Queue outcomes; invalid ones are rejected here, one by one."""
        full = False
        with self.lock:
            for outcome in outcomes:
                problem = invalid_reason(outcome)
                if problem is not None:
                    self.rejected += 1
                    if self.rejected <= 10 or self.rejected % 1000 == 0:
                        rid = outcome.get("request_id") if isinstance(outcome, dict) else None
                        log.error("outcome %r rejected (%s); %d rejected so far",
                                  str(rid)[:40], problem, self.rejected)
                    continue
                if self.config_error is not None:
                    self.dropped += 1
                    continue
                if len(self.buffer) >= self.max_buffer:
                    self.buffer.popleft()
                    self._count_overflow(1)
                self.buffer.append(outcome)
            full = len(self.buffer) >= self.batch_size
        if full and self._thread is not None:
            self._wake.set()

    def _count_overflow(self, n: int) -> None:  # caller holds self.lock
        before = self.dropped
        self.dropped += n
        if before == 0 or self.dropped // 1000 > before // 1000:
            log.warning("observation buffer full: %d outcomes dropped so far", self.dropped)

    def pending(self) -> int:
        with self.lock:
            return len(self.buffer)

    # -- sending ---------------------------------------------------------------------------
    def flush_due(self, force: bool = False, deadline: float | None = None) -> int:
        """Send what is queued unless backing off; returns how many were delivered.

        Returns 0 at once if another flush is in progress (it will send what is queued).
        ``deadline`` (``time.monotonic()``) stops sending further batches after it."""
        if not self._flushing.acquire(blocking=False):
            return 0
        try:
            return self._flush(force, deadline)
        finally:
            self._flushing.release()

    def _flush(self, force: bool, deadline: float | None) -> int:
        if self.config_error is not None:
            return 0
        if not force and time.monotonic() < self.next_attempt:
            return 0
        delivered = 0
        while deadline is None or time.monotonic() < deadline:
            with self.lock:
                n = min(self.batch_size, len(self.buffer))
                batch = [self.buffer.popleft() for _ in range(n)]
            if not batch:
                break
            ok, count = self._send(batch)
            delivered += count
            if not ok:
                break
        return delivered

    def _send(self, batch: list[dict]) -> tuple[bool, int]:
        """Post one batch (taken out of the buffer). Returns (go on, delivered)."""
        try:
            response = self.client.post("/v1/observations", json={"observations": batch},
                                        headers=self.headers)
        except httpx.HTTPError as exc:
            self._retry_later(batch, f"{type(exc).__name__}: {exc}")
            return False, 0
        status = response.status_code
        if 200 <= status < 300:
            duplicates = 0
            try:
                duplicates = int(response.json().get("duplicates", 0))
            except (ValueError, AttributeError, TypeError):
                pass
            with self.lock:
                self.sent += len(batch)
                self.duplicates += duplicates
                self.backoff_s = 0.0
                self.next_attempt = 0.0
            return True, len(batch)
        if status in CONFIG_ERROR_STATUS:
            self._configuration_error(batch, status, response.text[:200])
            return False, 0
        if status in SPLIT_STATUS:
            if len(batch) == 1:
                with self.lock:
                    self.rejected += 1
                log.error("outcome %r rejected by the service (%d): %s",
                          str(batch[0].get("request_id"))[:40], status, response.text[:300])
                return True, 0
            half = len(batch) // 2
            parts = (batch[:half], batch[half:])
            delivered = 0
            for i, part in enumerate(parts):
                ok, count = self._send(part)
                delivered += count
                if not ok:  # the failed part is back in the buffer (or dropped): so is the rest
                    if i == 0:
                        self._requeue(parts[1])
                    return False, delivered
            return True, delivered
        self._retry_later(batch, f"HTTP {status}: {response.text[:200]}")
        return False, 0

    def _requeue(self, batch: list[dict]) -> None:
        with self.lock:
            if self.config_error is not None:
                self.dropped += len(batch)
                return
            self.buffer.extendleft(reversed(batch))
            excess = len(self.buffer) - self.max_buffer
            if excess > 0:
                for _ in range(excess):
                    self.buffer.popleft()  # the oldest go first, as in add()
                self._count_overflow(excess)

    def _retry_later(self, batch: list[dict], error: str) -> None:
        self._requeue(batch)
        with self.lock:
            self.failures += 1
            self.backoff_s = min(self.backoff_max_s,
                                 max(self.backoff_initial_s, self.backoff_s * 2))
            self.next_attempt = time.monotonic() + self.backoff_s
            failures, backoff = self.failures, self.backoff_s
        logger = log.warning if failures == 1 or failures % 20 == 0 else log.info
        logger("observation report failed (%s); retry in %.2fs (%d failures)", error, backoff,
               failures)

    def _configuration_error(self, batch: list[dict], status: int, body: str) -> None:
        with self.lock:
            self.config_errors += 1
            self.config_error = f"HTTP {status} from POST /v1/observations: {body}"
            lost = len(batch) + len(self.buffer)
            self.buffer.clear()
            self.dropped += lost
        hint = {401: "wrong or missing token (BALANCEROUTE_API_TOKEN)",
                403: "token refused", 404: "wrong predictor URL"}[status]
        log.error("observation reporting disabled: %s (%s); %d outcomes dropped, later ones "
                  "will not be sent", self.config_error, hint, lost)

    # -- the reporter's thread -------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, interval_s: float = 0.5) -> None:
        """Flush from a daemon thread every ``interval_s`` (or as soon as a full batch waits)
        until :meth:`stop`. Calling it again while it runs does nothing."""
        with self.lock:
            if self.running:
                return
            self._stop.clear()

            def loop() -> None:
                while not self._stop.is_set():
                    self._wake.wait(interval_s)
                    self._wake.clear()
                    if self._stop.is_set():
                        break
                    try:
                        self.flush_due()
                    except Exception:  # pragma: no cover - keep reporting whatever happens
                        log.exception("observation reporter: unexpected error")

            self._thread = threading.Thread(target=loop, name="observation-reporter",
                                            daemon=True)
            self._thread.start()

    def stop(self, final_flush: bool = True, timeout_s: float = 10.0) -> dict:
        """Stop the thread, make one last flush (at most ``timeout_s``, ignoring back-off),
        and report: what is still buffered after it counts as dropped. Returns :meth:`stats`."""
        self._stop.set()
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        thread = self._thread
        if thread is not None:
            thread.join(timeout=timeout_s)
        self._thread = None
        if final_flush:
            # wait for a flush still in progress (a caller's), then flush what is left
            if self._flushing.acquire(timeout=max(0.0, deadline - time.monotonic())):
                try:
                    self._flush(True, deadline)
                finally:
                    self._flushing.release()
        with self.lock:
            left = len(self.buffer)
            self.buffer.clear()
            self.dropped += left
        stats = self.stats()
        lost = stats["dropped"] + stats["rejected"]
        logger = log.error if self.config_error else log.warning if lost else log.info
        logger("observation reporter stopped: %d delivered (%d duplicates), %d dropped "
               "(%d left unsent at stop), %d rejected as invalid, %d failed attempts%s",
               stats["sent"], stats["duplicates"], stats["dropped"], left, stats["rejected"],
               stats["failures"],
               f"; configuration error: {self.config_error}" if self.config_error else "")
        return stats

    def stats(self) -> dict:
        with self.lock:
            return {"sent": self.sent, "duplicates": self.duplicates, "dropped": self.dropped,
                    "rejected": self.rejected, "failures": self.failures,
                    "config_errors": self.config_errors, "config_error": self.config_error,
                    "pending": len(self.buffer)}
