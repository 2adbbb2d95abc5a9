"""How BR-H's gain over BR-0 changes along a replay and with its length (fleet filling, queue).

    python tools/run_length.py run --json rows.jsonl --trace synth:long --workers 16 \
        --load 1.0 --requests 10000,20000 --seeds 1,2,3
    python tools/run_length.py plot --json rows.jsonl --out docs/run-length-g16.png

``run``: BR-0 and BR-H with true lengths (``brh-oracle``, default parameters) on the same
trace and arrivals, B = 64, the default step cost, for each request count and seed (the
synthetic trace synthesized with ``seed=k`` and that many requests). The routing window (the
steps up to the last admission, where ``balanceroute ab`` measures) is cut into tenths by
step; per tenth, each policy's steps, mean max-min imbalance and mean fleet load (the sum of
the workers' KV loads). One JSON line per (requests, seed), appended as it finishes; a run
already in the file is skipped. An idle stretch (no request running) counts in the tenth
where it starts, and each policy's window is its own (they end within a few steps of each
other). ``plot`` (a file of one trace, G and load): per request count, BR-H's
imbalance over BR-0's by tenth (each seed, and the ratio of the seeds' summed imbalances) and
BR-0's fleet load by tenth, against the steps from the start: a run still filling its fleet
shows the load rising through its window.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from predictor import abtest  # noqa: E402
from router_client.admission import BalanceRouteParams  # noqa: E402
from router_client.simulator import SimConfig, Simulation  # noqa: E402
from router_client.traces import load_trace  # noqa: E402

PARTS = 10


def by_tenth(sim: Simulation) -> dict:
    """Per tenth of the routing window: mean max-min imbalance and mean fleet load (steps
    weighted as ``ab`` weighs them, idle stretches counting 0)."""
    m = sim.metrics
    steps, weight = np.asarray(m.steps), np.asarray(m.weight, dtype=float)
    spread = np.asarray(m.top) - np.asarray(m.low)
    total = np.asarray(m.total)
    last = m.last_admission_step
    edges = np.linspace(0, last + 1, PARTS + 1)
    out: dict = {"window_steps": last + 1, "steps": [], "imbalance": [], "fleet_load": []}
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        inside = (steps >= lo) & (steps < hi)
        w = weight[inside]
        out["steps"].append(float(w.sum()))
        out["imbalance"].append(float((w * spread[inside]).sum() / w.sum()) if w.sum() else 0.0)
        out["fleet_load"].append(float((w * total[inside]).sum() / w.sum()) if w.sum() else 0.0)
    return out


def cmd_run(args: argparse.Namespace) -> None:
    params = BalanceRouteParams(horizon=80)
    done = set()  # resumable: a (trace, G, load, requests, seed) already in the file is skipped
    if args.json.exists():
        for text in args.json.read_text().splitlines():
            line = json.loads(text)
            done.add((line["trace"], line["workers"], line["load"], line["requests"],
                      line["seed"]))
    for requests in args.requests:
        for seed in args.seeds:
            if (args.trace, args.workers, args.load, requests, seed) in done:
                continue
            trace = load_trace(f"{args.trace}:seed={seed},n={requests}", "auto", None)
            config = SimConfig(workers=args.workers, batch=64, load=args.load_value,
                               horizon=80, refresh_steps=10, seed=seed)
            line: dict = {"trace": args.trace, "workers": args.workers, "load": args.load,
                          "requests": requests, "seed": seed}
            for name in ("br0", "brh-oracle"):
                policy = abtest.make_policy(name, seed=seed, params=params)
                sim = Simulation(trace, policy, config, abtest.make_predictor(name, trace))
                result = sim.run()
                line[name] = {"imbalance_maxmin_mean": result.row["imbalance_maxmin_mean"],
                              "throughput_tok_s": result.row["throughput_tok_s"],
                              "routing_steps": result.row["routing_steps"], **by_tenth(sim)}
            ratio = (line["brh-oracle"]["imbalance_maxmin_mean"]
                     / line["br0"]["imbalance_maxmin_mean"])
            with args.json.open("a") as f:
                f.write(json.dumps(line) + "\n")
            print(f"{requests} requests seed {seed}: imbalance x{ratio:.3f}", file=sys.stderr)


def cmd_plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[int, list[dict]] = defaultdict(list)
    cells = set()
    for text in args.json.read_text().splitlines():
        line = json.loads(text)
        runs[line["requests"]].append(line)
        cells.add((line["trace"], line["workers"], line["load"]))
    if len(cells) != 1:
        raise SystemExit(f"{args.json} holds {len(cells)} (trace, G, load) cells: "
                         f"{sorted(cells)}; plot one at a time")
    fig, (ratio_ax, load_ax) = plt.subplots(1, 2, figsize=(11, 4))
    middle = (np.arange(PARTS) + 0.5) / PARTS
    for number, (requests, lines) in enumerate(sorted(runs.items())):
        color = f"C{number % 10}"
        # steps from the start: the tenths of a longer run are longer
        x = middle * np.mean([line["br0"]["window_steps"] for line in lines]) / 1000
        brh = np.array([line["brh-oracle"]["imbalance"] for line in lines])
        br0 = np.array([line["br0"]["imbalance"] for line in lines])
        for one_brh, one_br0 in zip(brh, br0, strict=True):
            ratio_ax.plot(x, one_brh / one_br0, color=color, alpha=0.25, lw=1)
        ratio_ax.plot(x, brh.sum(0) / br0.sum(0), color=color, lw=2.5,
                      label=f"{requests:,} requests ({len(lines)} seeds)")
        load = np.array([line["br0"]["fleet_load"] for line in lines]).mean(0)
        load_ax.plot(x, load, color=color, lw=2.5, label=f"{requests:,} requests")
    first = next(iter(runs.values()))[0]
    ratio_ax.axhline(0.8, color="grey", ls="--", lw=1, label="issue 10's 0.8x")
    ratio_ax.axhline(1.0, color="black", lw=0.8)
    ratio_ax.set(xlabel="thousand steps (tenths of the routing window)",
                 ylabel="BR-H (true lengths) / BR-0",
                 title="max-min imbalance by tenth of the window")
    load_ax.set(xlabel="thousand steps (tenths of the routing window)",
                ylabel="tokens (mean over the seeds)",
                title="BR-0's fleet load (sum of the workers' KV loads)")
    ratio_ax.legend(fontsize=8)
    load_ax.legend(fontsize=8)
    fig.suptitle(f"{first['trace']}, load {first['load']}, G = {first['workers']}, B = 64")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--json", type=Path, required=True, help="append rows here")
    run.add_argument("--trace", default="synth:long", help="a synth:NAME workload")
    run.add_argument("--workers", type=int, default=16)
    run.add_argument("--load", default="1.0", help="a load, or backlog")
    run.add_argument("--requests", type=lambda t: [int(x) for x in t.split(",")],
                     default=[10000, 20000])
    run.add_argument("--seeds", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 3])
    plot = sub.add_parser("plot")
    plot.add_argument("--json", type=Path, required=True)
    plot.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.command == "run":
        if not args.trace.startswith("synth:") or args.trace.count(":") > 1:
            ap.error("--trace: a synth:NAME workload without parameters (n and seed are set "
                     "per run)")
        args.load_value = args.load if args.load == "backlog" else float(args.load)
        cmd_run(args)
    else:
        cmd_plot(args)


if __name__ == "__main__":
    main()
