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


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (hyphens and
    underscores kept), each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_within_the_page_reach_a_heading():
    text = README.read_text()
    headings = {github_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links, "the README lost its links within the page"
    assert github_slug("The peer's setting: `balanceroute ab --peer`") == \
        "the-peers-setting-balanceroute-ab---peer"
    assert [link for link in links if link not in headings] == []
