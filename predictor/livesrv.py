"""Start ``balanceroute serve`` as a real uvicorn process on 127.0.0.1 (benchmarks, tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def live_server(database_url: str, port: int | None = None, env: dict[str, str] | None = None,
                timeout_s: float = 30.0) -> Iterator[str]:
    """Run the service in a subprocess; yields its base URL; stops it on exit."""
    with live_process(database_url, port, env, timeout_s) as (url, _process):
        yield url


@contextmanager
def live_process(database_url: str, port: int | None = None, env: dict[str, str] | None = None,
                 timeout_s: float = 30.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """:func:`live_server` that also yields the process (its pid, to measure its memory)."""
    port = port or free_port()
    environment = {**os.environ, **(env or {})}
    process = subprocess.Popen(
        [sys.executable, "-m", "predictor.cli", "serve", "--host", "127.0.0.1", "--port",
         str(port), "--database-url", database_url],
        env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        state = wait_ready(process, url + "/readyz", timeout_s)
        if state == "exited":
            output = process.stderr.read().decode() if process.stderr else ""
            raise RuntimeError("the service exited: " + output[-2000:])
        if state == "timeout":
            raise RuntimeError(f"the service did not become ready within {timeout_s}s")
        yield url, process
    finally:
        stop_process(process)


def wait_ready(process: subprocess.Popen, ready_url: str, timeout_s: float,
               interval_s: float = 0.1, request_timeout_s: float = 1.0
               ) -> Literal["ready", "exited", "timeout"]:
    """Poll ``ready_url`` until it answers 200 (``"ready"``), the process exits (``"exited"``)
    or ``timeout_s`` passes (``"timeout"``); the caller says what went wrong."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            return "exited"
        try:
            if httpx.get(ready_url, timeout=request_timeout_s).status_code == 200:
                return "ready"
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(interval_s)


def stop_process(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Terminate, wait up to ``timeout_s``, kill if it did not exit; close its stderr pipe."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:  # pragma: no cover
        process.kill()
        process.wait()
    if process.stderr is not None:
        process.stderr.close()
