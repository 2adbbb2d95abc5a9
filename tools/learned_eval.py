"""Replicated evaluation of learned BR-H against BR-0 and the oracle (issue 10's rows).

    python tools/learned_eval.py run --json out.jsonl [--cells mooncake:backlog,tpl:1.0]
    python tools/learned_eval.py table --json out.jsonl

One ``balanceroute ab`` run per (trace, load, replicate) at G = 8 (``--workers 4,8,16``: each
G in that run, a row per G), B = 64, policies br0, brh-survival, brh-exactmatch, brh-hazard,
brh-oracle (in-process learners, each learning only from requests finished earlier);
``--ab-args`` passes more ``ab`` arguments (a variant of the method). A single replay's
ratios move by about +-0.5% (Mooncake: more) from chaotic divergence alone, so the rows are
replicated:
  - Azure, Mooncake, ShareGPT (real traces): ``--sample N --seed k``, N requests drawn at random
    (seeded by k) from the trace, in their order, with their own arrivals (ShareGPT has none:
    Poisson arrivals seeded by k);
  - synth:long and synth:templated: the trace of N requests synthesized with ``seed=k``
    (``--requests N``; the draws depend on N, so it is not the first N of a larger one).
``table`` (one or more ``--json`` files, pooled) reports per cell and policy the mean and
range over replicates of the imbalance and throughput ratios to BR-0 in the same run, and the
share of the BR-0-to-oracle imbalance gap closed: the mean of each replicate's share, and the
ratio of the mean imbalance ratios, ``(1 - mean I/I_br0) / (1 - mean I_oracle/I_br0)`` with its
standard error (a replicate whose own gap is small does not blow that one up). One JSON line
per run is appended as it finishes; ``run`` skips runs already there.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import evalcli  # noqa: E402  (tools/ beside this script)
from tracepaths import synth_spec, trace_file  # noqa: E402

from predictor.cli import main as balanceroute  # noqa: E402

POLICIES = "br0,brh-survival,brh-exactmatch,brh-hazard,brh-oracle"
CELLS = [f"{t}:{load}" for t in ("mooncake", "tpl", "azure", "sharegpt", "long")
         for load in ("backlog", "1.0")]


def trace_args(trace: str, seed: int, requests: int) -> list[str]:
    """The ``ab`` arguments that pick replicate ``seed`` of ``trace``."""
    spec = synth_spec(trace, seed)
    if spec is not None:
        return ["--trace", spec, "--requests", str(requests)]
    return ["--trace", trace_file(trace), "--sample", str(requests)]


def run(args: argparse.Namespace) -> None:
    done = set()
    if args.json.exists():
        for line in args.json.read_text().splitlines():
            row = json.loads(line)
            done.add((row["cell"], row["seed"]))
    for cell in args.cells:
        trace, load = cell.split(":")
        for seed in range(1, args.seeds + 1):
            if (cell, seed) in done:
                continue
            started = time.monotonic()
            with tempfile.TemporaryDirectory() as tmp, \
                    contextlib.redirect_stdout(io.StringIO()):
                out = Path(tmp) / "rows.json"
                code = balanceroute(["ab", *trace_args(trace, seed, args.requests),
                                     "--seed", str(seed), "--workers", args.workers,
                                     "--load", load, "--policies", args.policies, "--quiet",
                                     "--json", str(out), *args.ab_args])
                if code != 0:
                    raise SystemExit(f"ab failed on {cell} seed {seed}")
                rows = json.loads(out.read_text())
            with args.json.open("a") as f:
                f.write(json.dumps({"cell": cell, "seed": seed, "requests": args.requests,
                                    "workers": args.workers, "ab_args": args.ab_args,
                                    "rows": rows}) + "\n")
            print(f"{cell} seed {seed}: {time.monotonic() - started:.0f} s", file=sys.stderr)


def ratios(rows: list[dict]) -> dict[str, tuple[float, float, float]]:
    """Per policy: imbalance / BR-0's, throughput / BR-0's, share of the gap to the oracle."""
    by = {r["policy"]: r for r in rows}
    base, oracle = by["br0"], by["brh-oracle"]
    gap = base["imbalance_maxmin_mean"] - oracle["imbalance_maxmin_mean"]
    out = {}
    for name, r in by.items():
        if name == "br0":
            continue
        closed = ((base["imbalance_maxmin_mean"] - r["imbalance_maxmin_mean"]) / gap
                  if gap > 0 else float("nan"))
        out[name] = (r["imbalance_maxmin_mean"] / base["imbalance_maxmin_mean"],
                     r["throughput_tok_s"] / base["throughput_tok_s"], closed)
    return out


def table(args: argparse.Namespace) -> None:
    cells: dict[str, list[dict]] = defaultdict(list)
    lines = [line for path in args.json for line in path.read_text().splitlines()]
    for line in lines:
        row = json.loads(line)
        by_workers: dict[int, list[dict]] = defaultdict(list)
        for r in row["rows"]:
            by_workers[r["workers"]].append(r)
        for workers, rows in sorted(by_workers.items()):
            cell = row["cell"] if len(by_workers) == 1 else f"{row['cell']}:G{workers}"
            cells[cell].append(ratios(rows))
    print("| cell | n | policy | imbalance x BR-0 (min..max) | throughput x BR-0 (min..max) "
          "| gap closed (min..max) | gap closed, ratio of means (+- s.e.) |")
    print("|---|---:|---|---|---|---|---|")
    for cell, runs in cells.items():
        oracle_mean = float(np.mean([r["brh-oracle"][0] for r in runs]))
        for policy in runs[0]:
            a = np.array([r[policy] for r in runs])
            # the mean imbalance ratio's distance from BR-0 over the oracle's: a replicate
            # whose own gap is small cannot blow it up, as it does the mean of the shares
            pooled = "n/a (oracle not below BR-0)" if oracle_mean >= 1.0 else (
                f"{(1.0 - a[:, 0].mean()) / (1.0 - oracle_mean):.2f}"
                + (f" (+- {a[:, 0].std(ddof=1) / np.sqrt(len(runs)) / (1.0 - oracle_mean):.2f})"
                   if len(runs) > 1 and policy != "brh-oracle" else ""))
            gaps = a[:, 2][~np.isnan(a[:, 2])]
            # a replicate where the oracle is not below BR-0 has no gap to close: left out,
            # and the count says how many replicates the figure rests on
            part = f"; {gaps.size} of {len(runs)}" if 0 < gaps.size < len(runs) else ""
            closed = ("1" if policy == "brh-oracle" else "n/a (oracle not below BR-0)"
                      if gaps.size == 0 else
                      f"{gaps.mean():.2f} ({gaps.min():.2f}..{gaps.max():.2f}{part})")
            print(f"| {cell} | {len(runs)} | {policy} | {a[:, 0].mean():.3f} "
                  f"({a[:, 0].min():.3f}..{a[:, 0].max():.3f}) | {a[:, 1].mean():.4f} "
                  f"({a[:, 1].min():.4f}..{a[:, 1].max():.4f}) | {closed} | {pooled} |")


def main() -> None:
    ap = evalcli.parser(__doc__)
    ap.add_argument("--cells", type=lambda s: s.split(","), default=CELLS)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--workers", default="8", help="G, or a list like 4,8,16 (one run each)")
    ap.add_argument("--policies", default=POLICIES, help="must include br0 and brh-oracle")
    ap.add_argument("--ab-args", type=lambda s: s.split(), default=[],
                    help="more `balanceroute ab` arguments, e.g. '--stage1 lpt'")
    evalcli.dispatch(ap, run, table)


if __name__ == "__main__":
    main()
