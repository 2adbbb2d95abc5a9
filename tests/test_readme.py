"""The README's router-client example runs as written (against a live service)."""

import re
from pathlib import Path

from predictor.livesrv import live_server

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_router_client_example_runs(tmp_path, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README lost its Python example"
    with live_server(f"sqlite:///{tmp_path / 'readme.db'}") as url:
        code = blocks[0].replace('"http://127.0.0.1:8000"', repr(url))
        namespace: dict = {}
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
        import httpx

        status = httpx.get(url + "/v1/status").json()
    router = namespace["router"]
    assert router.controller.mode == "brh"
    assert router.fleet.counters.dispatched == 1 and router.fleet.counters.finished == 1
    assert status["observations"] == 1
    assert "brh" in capsys.readouterr().out
