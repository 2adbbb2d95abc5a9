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
from typing import IO, Any

log = logging.getLogger(__name__)

FIT_NICE = 10  # the worker yields the CPU to the service's queries while both want to run
FIT_TIMEOUT_S = 300.0
_HEADER = struct.Struct("<Q")


class FitProcessError(RuntimeError):
    """The fit process could not be started, or died, or answered with an error."""


def _write(stream: IO[bytes], payload: Any) -> None:
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read(stream: IO[bytes]) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the other end closed the pipe")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the other end closed the pipe mid-frame")
    return pickle.loads(data)  # noqa: S301 - our own worker's frames, over a private pipe


class FitProcess:
    """One worker process, started at the first fit and kept; calls are serialized. A call
    the worker has not answered within ``timeout_s`` seconds (a fit takes about one on 5,000
    observations) stops it: a hung worker must not hold the service's fits forever."""

    def __init__(self, timeout_s: float = FIT_TIMEOUT_S,
                 command: list[str] | None = None) -> None:
        self.timeout_s = timeout_s
        self.command = command or [sys.executable, "-m", "predictor.estimators._fit_main"]
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def call(self, snapshot: Any, edges: Any, params: dict[str, Any]) -> Any:
        """``fit_booster(snapshot, edges, params)`` in the worker; :class:`FitProcessError`
        if that fails (the worker is then stopped, and the next call starts another)."""
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE,
                                                  stdout=subprocess.PIPE)
                stdin, stdout = self._proc.stdin, self._proc.stdout
                if stdin is None or stdout is None:  # not reached: both are pipes
                    raise OSError("the fit process has no pipes")
                _write(stdin, (snapshot, edges, params))
                ready, _, _ = select.select([stdout], [], [], self.timeout_s)
                if not ready:
                    raise TimeoutError(f"no answer within {self.timeout_s:g} s")
                status, value = _read(stdout)
            except (OSError, EOFError, pickle.PickleError) as error:
                self._stop()
                raise FitProcessError(f"the fit process failed: {error}") from error
            if status != "ok":
                raise FitProcessError(f"the fit failed in the fit process: {value}")
            return value

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
    try:
        os.nice(FIT_NICE)
    except OSError:  # not permitted here: the fits run at the service's priority
        pass
    from predictor.estimators.hazard import fit_booster

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the frames
    while True:
        try:
            snapshot, edges, params = _read(stdin)
        except EOFError:
            return
        try:
            reply: tuple[str, Any] = ("ok", fit_booster(snapshot, edges, params))
        except Exception as error:  # reported to the service, which fits on its thread
            reply = ("error", f"{type(error).__name__}: {error}")
        try:
            _write(stdout, reply)
        except BrokenPipeError:  # no flush at exit into the closed pipe either
            os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
            return
