"""The command line the replicated evaluation tools share: ``run`` appends rows to one JSON
lines file (resumable), ``table`` pools one or more such files."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def parser(doc: str) -> argparse.ArgumentParser:
    """A parser with ``mode`` (``run`` or ``table``) and ``--json``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("mode", choices=["run", "table"])
    ap.add_argument("--json", type=Path, nargs="+", required=True,
                    help="run: the file to append to (one); table: one or more, pooled")
    return ap


def dispatch(ap: argparse.ArgumentParser, run: Callable[[argparse.Namespace], None],
             table: Callable[[argparse.Namespace], None]) -> None:
    """Parse the command line and call ``run`` (``args.json`` one path) or ``table``."""
    args = ap.parse_args()
    if args.mode == "run":
        if len(args.json) != 1:
            ap.error("run appends to one --json file")
        args.json = args.json[0]
        run(args)
    else:
        table(args)
