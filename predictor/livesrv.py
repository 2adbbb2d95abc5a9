"""Start ``balanceroute serve`` as a real uvicorn process on 127.0.0.1 (benchmarks, tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

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
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                output = process.stderr.read().decode() if process.stderr else ""
                raise RuntimeError("the service exited: " + output[-2000:])
            try:
                if httpx.get(url + "/readyz", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the service did not become ready within {timeout_s}s")
            time.sleep(0.1)
        yield url, process
    finally:
        stop_process(process)


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
