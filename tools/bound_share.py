"""Split a throughput ratio into the work the window held and the routing's share of the bound.

    python tools/bound_share.py FILE.jsonl [FILE.jsonl ...] [--lowest N]

``ab``'s throughput counts output tokens over the routing window (first step to the last
admission). Over a whole run the KV-token steps are fixed by the requests, but over the window
they are not: a policy that admits lighter requests (shorter prompts) first and leaves heavier
ones for the drain holds less KV in the window, so its steps are cheaper and its tok/s is
higher with no better balance. The balanced bound of the same run (every step at the mean
load instead of the maximum) moves with that work and not with balance, so

    throughput ratio = bound ratio (the work the window held) x share ratio (the routing)

where the share is throughput over the run's own bound. The fourth column, "whole run", is
BR-0's makespan over the policy's: every output token over the whole run, drain included,
the same work for both, so what a policy left for the drain is paid for there (a finite
replay's drain runs short of requests, so it weighs the end of the run more than a steady
stream would). For each cell (trace and load, G, policy against BR-0 in the same replay) this
prints the mean over replicates of the four.
Reads the rows of ``tools/learned_eval.py`` (``{"cell", "rows": [...]}``) and of
``tools/oracle_eval.py matrix`` (``{"trace", "load", "workers", "br0", "oracle"}``).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

Pair = tuple[dict[str, Any], dict[str, Any]]  # (policy's row, BR-0's row in the same replay)


def pairs(line: dict[str, Any]) -> Iterator[tuple[tuple[str, int, str], Pair]]:
    """((cell, G, policy), (row, BR-0's row)) for each non-BR-0 policy of one replay."""
    if "rows" in line:
        by_key = {(row["workers"], row["policy"]): row for row in line["rows"]}
        for (workers, policy), row in by_key.items():
            reference = by_key.get((workers, "br0"))
            if policy != "br0" and reference is not None:
                yield (line["cell"], int(workers), policy), (row, reference)
    elif "oracle" in line:
        cell = f"{line['trace']}:{line['load']}"
        yield (cell, int(line["workers"]), f"brh-oracle:{line['variant']}"), (
            line["oracle"], line["br0"])


def ratios(pair: Pair) -> tuple[float, float, float, float]:
    row, reference = pair
    throughput = row["throughput_tok_s"] / reference["throughput_tok_s"]
    bound = row["balanced_bound_tok_s"] / reference["balanced_bound_tok_s"]
    whole = (reference["makespan_s"] / row["makespan_s"]
             if row.get("makespan_s") and reference.get("makespan_s") else float("nan"))
    return throughput, bound, throughput / bound, whole


def table(paths: list[Path]) -> dict[tuple[str, int, str], np.ndarray]:
    """Per cell, the (replicates, 4) ratios: throughput, bound, share, whole run."""
    cells: dict[tuple[str, int, str], list[tuple[float, ...]]] = defaultdict(list)
    for path in paths:
        for text in path.read_text().splitlines():
            if text.strip():
                for key, pair in pairs(json.loads(text)):
                    cells[key].append(ratios(pair))
    return {key: np.asarray(values) for key, values in cells.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--lowest", type=int, default=0,
                        help="only the N cells with the lowest share ratio (default: all)")
    args = parser.parse_args(argv)
    cells = table(args.files)
    means = {key: values.mean(axis=0) for key, values in cells.items()}
    order = sorted(means, key=lambda key: means[key][2] if args.lowest else key)
    print(f"{'cell':<24} {'G':>3} {'policy':<22} {'n':>2} {'x br0 tok/s':>11} "
          f"{'bound':>7} {'share':>7} {'whole run':>9}")
    for key in order[: args.lowest] if args.lowest else order:
        cell, workers, policy = key
        thr, bound, share, whole = means[key]
        print(f"{cell:<24} {workers:>3} {policy:<22} {len(cells[key]):>2} {thr:11.4f} "
              f"{bound:7.4f} {share:7.4f} {whole:9.4f}")
    shares = np.asarray([m[2] for m in means.values()])
    wholes = np.asarray([m[3] for m in means.values()])
    wholes = wholes[~np.isnan(wholes)]
    whole = (f"whole run below 0.999 in {int((wholes < 0.999).sum())}, lowest {wholes.min():.4f}"
             if wholes.size else "no makespan in these rows")
    print(f"{len(means)} cells; share ratio below 0.999 in {int((shares < 0.999).sum())}, "
          f"lowest {shares.min():.4f}; {whole}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
