"""G sweep with per-worker load fixed: throughput over least-token-load and share of the
balanced bound by G, for BR-0 and BR-H (default parameters; ``--policies``, with
``brh-oracle`` for true lengths and ``brh-<estimator>`` for a learned one); one JSON line per
run, then a PNG.

    python tools/g_sweep.py --trace synth:long --workers 4,8,16,32,64,128,256 \
        --per-worker 150 --policies ltl,br0,brh-oracle --json out.jsonl --png docs/g-sweep.png

``synth:*`` traces are synthesized with ``per-worker * G`` requests; a file trace is replayed
whole at every G (load 1.0 rescales its arrivals to the fleet), or with ``--tile`` cut or
replayed back to back to ``per-worker * G`` requests, so that large fleets reach a steady state
(a 12,000-request trace never fills G = 256 workers of 64 slots). ``--plot-only`` redraws.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from predictor.abtest import make_predictor  # noqa: E402
from router_client.policies import make_policy  # noqa: E402
from router_client.simulator import SimConfig, simulate  # noqa: E402
from router_client.synth import synthesize  # noqa: E402
from router_client.traces import load_trace  # noqa: E402


def run(args: argparse.Namespace) -> None:
    for g in (int(w) for w in args.workers.split(",")):
        if args.trace.startswith("synth:"):
            trace = synthesize(f"{args.trace}:n={args.per_worker * g},seed={args.seed}")
        elif args.tile:  # per-worker load fixed on a file trace: per-worker * G requests
            trace = load_trace(args.trace, "auto", None).tile(args.per_worker * g)
        else:
            trace = load_trace(args.trace, "auto", None)
        load: float | str = args.load if args.load == "backlog" else float(args.load)
        config = SimConfig(workers=g, batch=args.batch, load=load, seed=args.seed)
        for name in args.policies.split(","):
            started = time.time()
            row = simulate(trace, make_policy(name, args.seed), config,
                           make_predictor(name, trace)).row
            label = (f"{args.trace} (tiled, {args.per_worker} per worker)" if args.tile
                     and not args.trace.startswith("synth:") else args.trace)
            row.update(trace=label, load=str(load), wall_s=round(time.time() - started, 1))
            with args.json.open("a") as out:
                out.write(json.dumps(row) + "\n")
            print(g, name, row["throughput_tok_s"], row["balanced_bound_tok_s"], row["wall_s"],
                  flush=True)


def plot(paths: list[Path], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5.5))
    for color, path in zip(("tab:blue", "tab:orange", "tab:green"), paths, strict=False):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        ltl = {r["workers"]: r for r in rows if r["policy"] == "ltl"}
        br0 = sorted((r for r in rows if r["policy"] == "br0" and r["workers"] in ltl),
                     key=lambda r: r["workers"])
        gs = [r["workers"] for r in br0]
        label = rows[0]["trace"].split("/")[-1]
        brh = sorted((r for r in rows if r["policy"] == "brh-oracle" and r["workers"] in ltl),
                     key=lambda r: r["workers"])
        for runs, marker, style, name in ((br0, "o", "-", "BR-0"),
                                          (brh, "s", ":", "BR-H, true lengths")):
            if not runs:
                continue
            hs = [r["workers"] for r in runs]
            left.plot(hs, [r["throughput_tok_s"] / ltl[r["workers"]]["throughput_tok_s"]
                           for r in runs], marker=marker, linestyle=style, color=color,
                      label=f"{name}, {label}")
            right.plot(hs, [r["throughput_tok_s"] / r["balanced_bound_tok_s"] for r in runs],
                       marker=marker, linestyle=style, color=color, label=f"{name}, {label}")
        right.plot(gs, [ltl[g]["throughput_tok_s"] / ltl[g]["balanced_bound_tok_s"] for g in gs],
                   marker="x", linestyle="--", color=color,
                   label=f"least-token-load, {label}")
    for axis, title in ((left, "throughput / least-token-load"),
                        (right, "share of the balanced bound")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("G (workers), per-worker load fixed (load 1.0, B = 64)")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="synth:long")
    ap.add_argument("--workers", default="4,8,16,32,64")
    ap.add_argument("--per-worker", type=int, default=150)
    ap.add_argument("--tile", action="store_true",
                    help="a file trace too gets per-worker * G requests (replayed back to back "
                         "when shorter, see Trace.tile); default: the whole file at every G")
    ap.add_argument("--load", default="1.0")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="ltl,br0",
                    help="comma-separated; ltl is needed as the baseline of the plot")
    ap.add_argument("--json", type=Path, action="append", required=True)
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    if not args.plot_only:
        args.json = args.json[0]
        run(args)
        args.json = [args.json]
    if args.png:
        plot(args.json, args.png)


if __name__ == "__main__":
    main()
