"""A process of its own for the hazard model's fits (``HazardEstimator.fit_in_subprocess``).

On a thread of the service a fit (about a second) shares the interpreter with the queries;
here it does not. The worker is started as ``python -m predictor.estimators._fit_main``, not
through :mod:`multiprocessing`: a spawned child imports the caller's main module, which runs a
script's top-level code again unless it is guarded by ``if __name__ == "__main__"``. Parent and
worker exchange pickled frames (an 8-byte length, then the payload) over the worker's stdin and
stdout: ``(snapshot, edges, params)`` in, ``("ok", fitted)`` or ``("error", text)`` out. The
pipes are private to the two processes, which trust each other (the same code, the same user).
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

FIT_NICE = 10  # the worker yields the CPU to the service's queries while both want to run
FIT_TIMEOUT_S = 300.0
_HEADER = struct.Struct("<Q")


class FitProcessError(RuntimeError):
    """The fit process could not be started, or died, or answered with an error."""


def _send_frame(fd: int, payload: Any, deadline: float | None = None) -> None:
    """Pickle ``payload`` and write it to ``fd`` as a frame (an 8-byte length, then the
    bytes), by ``deadline`` (monotonic; None: no limit). A non-blocking ``fd`` is waited on."""
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        _wait(fd, deadline, write=True)
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue


def _receive_frame(fd: int, deadline: float | None = None) -> Any:
    """Read one frame from ``fd`` by ``deadline`` and unpickle it; EOFError if the other end
    closed the pipe."""
    (size,) = _HEADER.unpack(_receive(fd, _HEADER.size, deadline))
    return pickle.loads(_receive(fd, size, deadline))  # noqa: S301 - our own frames


def _receive(fd: int, size: int, deadline: float | None) -> bytes:
    """Read exactly ``size`` bytes from ``fd`` by ``deadline``."""
    chunks: list[bytes] = []
    while size:
        _wait(fd, deadline, write=False)
        try:
            chunk = os.read(fd, min(size, 1 << 20))
        except BlockingIOError:
            continue
        if not chunk:
            raise EOFError("the other end closed the pipe")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _wait(fd: int, deadline: float | None, write: bool) -> None:
    """Wait until ``fd`` is ready; TimeoutError past ``deadline`` (None: wait as long)."""
    if deadline is None:
        return  # a blocking read or write waits by itself
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("no answer in time")
    ready = select.select([], [fd], [], remaining)[1] if write else \
        select.select([fd], [], [], remaining)[0]
    if not ready:
        raise TimeoutError("no answer in time")


class FitProcess:
    """One worker process, started at the first fit and kept; calls are serialized.

    A call that has not been answered within ``timeout_s`` seconds (a fit takes about one on
    5,000 observations), the request's sending included, stops the worker: a hung worker
    must not hold the service's fits forever. After ``MAX_FAILURES`` failed calls in a row
    (a worker that cannot start, say, where ``sys.executable`` is not a Python) the process
    is given up for good and every call fails at once, so that the estimator fits on its own
    thread without a process started per fit."""

    MAX_FAILURES = 3

    def __init__(self, timeout_s: float = FIT_TIMEOUT_S,
                 command: list[str] | None = None) -> None:
        self.timeout_s = timeout_s
        self.command = command or [sys.executable or "python", "-m",
                                   "predictor.estimators._fit_main"]
        self.failures = 0
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def given_up(self) -> bool:
        return self.failures >= self.MAX_FAILURES

    def call(self, snapshot: Any, edges: Any, params: dict[str, Any]) -> Any:
        """``fit_booster(snapshot, edges, params)`` in the worker; :class:`FitProcessError`
        if that fails (the worker is then stopped, and the next call starts another)."""
        with self._lock:
            if self.given_up:
                raise FitProcessError(f"the fit process was given up after {self.failures} "
                                      "failures in a row")
            try:
                deadline = time.monotonic() + self.timeout_s
                proc = self._started()
                _send_frame(proc.stdin.fileno(), (snapshot, edges, params),  # type: ignore[union-attr]
                            deadline)
                status, value = _receive_frame(proc.stdout.fileno(),  # type: ignore[union-attr]
                                               deadline)
            except TimeoutError:
                self._failed()
                raise FitProcessError(f"the fit process gave no answer within "
                                      f"{self.timeout_s:g} s") from None
            except Exception as error:  # any failure: stop it, and the caller fits itself
                self._failed()
                raise FitProcessError(f"the fit process failed: {error!r}") from error
            self.failures = 0
            if status != "ok":
                raise FitProcessError(f"the fit failed in the fit process: {value}")
            return value

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is not None:
            self._stop()  # died since the last call: its pipes closed, another started
        if self._proc is None:
            # its own session: a Ctrl-C at the service's terminal is the service's to handle
            proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    bufsize=0, start_new_session=True)
            for stream in (proc.stdin, proc.stdout):
                os.set_blocking(stream.fileno(), False)  # type: ignore[union-attr]
            self._proc = proc
        return self._proc

    def _failed(self) -> None:
        self.failures += 1
        self._stop()
        if self.given_up:
            log.warning("the hazard fit process failed %d times in a row: the fits run on "
                        "the service's thread from now on", self.failures)

    def close(self) -> None:
        with self._lock:
            self._stop(graceful=True)

    def _stop(self, graceful: bool = False) -> None:
        """Stop the worker: at its closed stdin (``graceful``, waiting up to 5 s), else at
        once (a worker that failed or hung has nothing to finish)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if not graceful:
            proc.kill()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    """The worker: answer fits until stdin closes (or, mid-fit, stdout: the service has
    stopped, and nobody waits for the answer)."""
    # The frames go to a copy of fd 1; fd 1 itself (and so any print, or a library's C-level
    # write, from the imports on) goes to stderr: nothing else may write into the frames.
    stdout = os.dup(1)
    os.dup2(2, 1)
    stdin = sys.stdin.fileno()
    try:
        os.nice(FIT_NICE)
    except OSError:  # not permitted here: the fits run at the service's priority
        pass
    from predictor.estimators.hazard import fit_booster

    while True:
        try:
            snapshot, edges, params = _receive_frame(stdin)
        except EOFError:
            return
        try:
            reply: tuple[str, Any] = ("ok", fit_booster(snapshot, edges, params))
        except Exception as error:  # reported to the service, which fits on its thread
            reply = ("error", f"{type(error).__name__}: {error}")
        try:
            _send_frame(stdout, reply)
        except BrokenPipeError:
            return
