"""A regular (non-editable) ``pip install .`` can migrate a new database and serve.

The project is copied out of the work tree, built and installed into a fresh virtual
environment; the service is then started from a directory that holds no source, so every
import, the Alembic migrations and the bundled trace come from the installed package.
Dependencies are not downloaded again: a ``.pth`` line puts the test environment's
site-packages behind the fresh one (its editable-install hook is not loaded that way).
"""

import shutil
import subprocess
import sysconfig
import time
import tomllib
import venv
from pathlib import Path

import httpx
import pytest

from predictor.livesrv import free_port

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = [pattern.rstrip("*") for pattern in tomllib.loads(
    (ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]]
SOURCES = ("pyproject.toml", "README.md", *PACKAGES)


def _copy_project(target: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    target.mkdir()
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, target / name, ignore=ignore)
        else:
            shutil.copy2(source, target / name)


@pytest.mark.slow
def test_regular_install_migrates_and_serves(tmp_path):
    source = tmp_path / "src"
    _copy_project(source)
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", str(source)],
                   check=True, cwd=tmp_path, timeout=240)
    shutil.rmtree(source)  # nothing may come from the copy: only the installed package

    where = subprocess.run(
        [python, "-c", "import predictor, migrations, router_client.data as d; "
         "print(predictor.__file__); print(migrations.__file__)"],
        check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    assert all(line.startswith(site) for line in where.split())

    port = free_port()
    database = tmp_path / "fresh.db"
    server = subprocess.Popen(
        [env_dir / "bin" / "balanceroute", "serve", "--port", str(port),
         "--database-url", f"sqlite:///{database}"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        ready = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and server.poll() is None:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1.0)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert ready is not None, server.stderr.read().decode()[-2000:] if server.stderr else ""
        assert ready.status_code == 200
        assert ready.json() == {"status": "ready", "learner_loaded": True, "database": True}
        stored = httpx.post(f"http://127.0.0.1:{port}/v1/observations", json={
            "observations": [{"request_id": "r1", "output_tokens": 10}]})
        assert stored.json() == {"accepted": 1, "duplicates": 0}
    finally:
        server.terminate()
        server.wait(timeout=10)
        if server.stderr is not None:
            server.stderr.close()
