"""Sweep BR-0's R_max, S_greedy and Stage-1 rule against least-token-load (one process).

    python tools/sweep_defaults.py --trace PATH --workers 4,8,16 --load backlog --peer \
        --configs "rmax=4,sg=7,s1=auto;rmax=4G,sg=7,s1=auto" --sample 20000 --json out.json

``rmax=4G`` scales with the fleet (4G: the whole peer window). One JSON line per run is
appended to ``--json`` as it finishes, so a time budget can stop the sweep at any point.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from predictor.cli import PEER_BATCH, PEER_STEP_COST  # noqa: E402
from router_client.admission import BalanceRouteParams  # noqa: E402
from router_client.policies import make_policy  # noqa: E402
from router_client.simulator import DEFAULT_STEP_COST, SimConfig, simulate  # noqa: E402
from router_client.traces import load_trace  # noqa: E402


def parse_config(text: str, workers: int) -> tuple[str, BalanceRouteParams]:
    fields = dict(item.split("=") for item in text.split(","))
    def scaled(value: str) -> int:
        return int(value[:-1]) * workers if value.endswith("G") else int(value)

    params = BalanceRouteParams.br0(r_max=scaled(fields.get("rmax", "4")),
                                    s_greedy=scaled(fields.get("sg", "7")),
                                    stage1=fields.get("s1", "auto"))
    return text, params


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", required=True)
    ap.add_argument("--workers", default="8")
    ap.add_argument("--load", default="backlog")
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--configs", required=True)
    ap.add_argument("--sample", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--no-ltl", action="store_true")
    args = ap.parse_args()
    trace = load_trace(args.trace, "auto", args.requests)
    if args.sample:
        trace = (trace.draw if args.peer else trace.sample)(args.sample, args.seed)
    load: float | str = args.load if args.load == "backlog" else float(args.load)
    batch, cost = (PEER_BATCH, PEER_STEP_COST) if args.peer else (args.batch, DEFAULT_STEP_COST)
    if args.peer:
        load = "backlog"
    for g in (int(w) for w in args.workers.split(",")):
        config = SimConfig(workers=g, batch=batch, load=load, step_cost=cost, seed=args.seed)
        runs = [] if args.no_ltl else [("ltl", make_policy("ltl", args.seed))]
        for text in args.configs.split(";"):
            label, params = parse_config(text, g)
            runs.append((label, make_policy("br0", args.seed, params)))
        for label, policy in runs:
            started = time.time()
            row = simulate(trace, policy, config).row
            row.update(config=label, trace=args.trace, load=str(load), peer=args.peer,
                       sample=args.sample, wall_s=round(time.time() - started, 1))
            with args.json.open("a") as out:
                out.write(json.dumps(row) + "\n")
            print(g, label, round(row["imbalance_total_mean"]), round(row["throughput_tok_s"]),
                  round(row["throughput_tok_s"] / row["balanced_bound_tok_s"], 4),
                  row["wall_s"], flush=True)


if __name__ == "__main__":
    main()
