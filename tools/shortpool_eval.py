"""Multi-seed evaluation of BR-0's Stage-1 short-pool rule against least-token-load (ltl).

    python tools/shortpool_eval.py run --json out.jsonl [--quick]
    python tools/shortpool_eval.py table --json out.jsonl

Cells: load 0.8 and 1.0, G = 4, 8, 16 on synth:long, ShareGPT, Azure conversation and
Mooncake conversation (``--requests`` per run), and the G sweep on synth:long at load 1.0,
G = 32, 64, 128 (150 requests per worker, per-worker load fixed as in ``tools/g_sweep.py``).

What a seed changes ("replicate" k = 0, 1, 2, ...):
  - synth:long: the synthesized trace (``synth:long:n=N,seed=k``: sizes and Poisson arrivals).
  - ShareGPT (no timestamps): the simulator's seed (its Poisson arrivals) and a disjoint window
    of the trace (requests ``k*N .. (k+1)*N``).
  - Azure and Mooncake (timestamped): the simulator's seed changes nothing (arrivals are the
    trace's own times, rescaled to the load), so replicate k is the disjoint window
    ``k*N .. (k+1)*N`` of the trace (its own arrivals, another stretch of the hour).

Every variant of a cell runs on the same requests and arrivals, so ratios to ltl are paired
per replicate; ``table`` reports their mean and spread (min..max) over replicates
(``--baseline pair``: ratios to another variant). One JSON
line per run is appended as it finishes; ``run`` skips runs already in the file (resumable).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from statistics import mean

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tracepaths import trace_file  # noqa: E402  (tools/ beside this script)

from router_client.admission import BalanceRouteParams  # noqa: E402
from router_client.policies import make_policy  # noqa: E402
from router_client.simulator import SimConfig, simulate  # noqa: E402
from router_client.synth import synthesize  # noqa: E402
from router_client.traces import Trace, load_trace  # noqa: E402

TRACES = {
    "synth:long": "synth:long",
    "sharegpt": trace_file("sharegpt"),
    "azure": trace_file("azure"),
    "mooncake": trace_file("mooncake"),
}
# variant label -> BR-0 parameters (None: least-token-load)
VARIANTS: dict[str, dict[str, object] | None] = {
    "ltl": None,
    "pair": {"stage1": "auto-pair"},
    "lpt": {"stage1": "lpt"},
    "lpt-h16": {"stage1": "lpt", "lpt_count_weight": 16.0},
    "lpt-h64": {"stage1": "lpt", "lpt_count_weight": 64.0},
}


def cells(requests: int, quick: bool) -> list[tuple[str, float, int, int]]:
    """(trace, load, G, requests per run)."""
    out = [(trace, load, g, requests) for load in (0.8, 1.0) for trace in TRACES
           for g in (4, 8, 16)]
    out += [("synth:long", 1.0, g, 150 * g) for g in (32, 64, 128)]
    return out[:2] if quick else out


_loaded: dict[str, Trace] = {}


def replicate(trace: str, n: int, k: int, seeds: int) -> Trace:
    """Replicate ``k`` of ``n`` requests (see the module docstring)."""
    if trace.startswith("synth:"):
        return synthesize(f"{trace}:n={n},seed={k}")
    if trace not in _loaded:
        _loaded[trace] = load_trace(TRACES[trace], "auto", None)
    whole = _loaded[trace]
    n = min(n, len(whole) // seeds)  # disjoint windows (Mooncake: 12,031 requests)
    return whole.take(np.arange(k * n, (k + 1) * n))


def run(args: argparse.Namespace) -> None:
    done = set()
    if args.json.exists():
        for line in args.json.read_text().splitlines():
            r = json.loads(line)
            done.add((r["trace"], r["load"], r["workers"], r["rep"], r["variant"]))
    variants = args.variants.split(",")
    for trace, load, g, n in cells(args.requests, args.quick):
        if ((args.workers and g not in args.workers) or (args.traces and trace not in args.traces)
                or (args.loads and load not in args.loads)):
            continue
        for k in range(args.seeds):
            reqs = replicate(trace, n, k, args.seeds)
            config = SimConfig(workers=g, batch=64, load=load, seed=k)
            for label in variants:
                if (trace, load, g, k, label) in done:
                    continue
                extra = VARIANTS[label]
                policy = (make_policy("ltl", k) if extra is None else
                          make_policy("br0", k, BalanceRouteParams.br0(**extra)))  # type: ignore[arg-type]
                started = time.time()
                row = simulate(reqs, policy, config).row
                row.update(trace=trace, load=load, rep=k, variant=label, n=len(reqs),
                           wall_s=round(time.time() - started, 1))
                with args.json.open("a") as out:
                    out.write(json.dumps(row) + "\n")
                print(trace, load, g, k, label, round(row["imbalance_total_mean"]),
                      round(row["throughput_tok_s"]), row["wall_s"], flush=True)


def table(args: argparse.Namespace) -> None:
    rows = [json.loads(line) for line in args.json.read_text().splitlines() if line]
    by = {(r["trace"], r["load"], r["workers"], r["rep"], r["variant"]): r for r in rows}
    base = args.baseline
    variants = [v for v in args.variants.split(",") if v != base]
    groups: dict[tuple[str, float, int], list[int]] = defaultdict(list)
    for trace, load, g, k, label in by:
        if label == base:
            groups[(trace, load, g)].append(k)
    head = " | ".join(f"{v} I(k) / {base} | {v} tok/s / {base}" for v in variants)
    print(f"| trace | load | G | reps | {head} |")
    print("|---|---|---|---|" + "---|---|" * len(variants))
    order = {t: i for i, t in enumerate(TRACES)}
    for (trace, load, g) in sorted(groups, key=lambda c: (c[1], order[c[0]], c[2])):
        cols = []
        reps = sorted(groups[(trace, load, g)])
        for v in variants:
            pairs = [(by[(trace, load, g, k, v)], by[(trace, load, g, k, base)])
                     for k in reps if (trace, load, g, k, v) in by]
            if not pairs:
                cols += ["", ""]
                continue
            imb = [a["imbalance_total_mean"] / b["imbalance_total_mean"] for a, b in pairs]
            tok = [a["throughput_tok_s"] / b["throughput_tok_s"] for a, b in pairs]
            short = f" [{len(pairs)} reps]" if len(pairs) != len(reps) else ""  # partly run
            cols.append(f"{mean(imb):.3f} ({min(imb):.3f}..{max(imb):.3f}){short}")
            cols.append(f"{mean(tok):.4f} ({min(tok):.4f}..{max(tok):.4f})")
        print(f"| {trace} | {load} | {g} | {len(reps)} | " + " | ".join(cols) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["run", "table"])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--baseline", default="ltl", help="table: ratios to this variant")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--workers", type=lambda s: {int(w) for w in s.split(",")}, default=None)
    ap.add_argument("--traces", type=lambda s: set(s.split(",")), default=None)
    ap.add_argument("--loads", type=lambda s: {float(x) for x in s.split(",")}, default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    run(args) if args.mode == "run" else table(args)


if __name__ == "__main__":
    main()
