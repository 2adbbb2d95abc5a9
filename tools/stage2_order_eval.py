"""BR-0's Stage-2 worker order: most free slots first (the paper's) against the widest margin
first, on the same requests and arrivals, with least-token-load as the common reference.

    python tools/stage2_order_eval.py run --json rows.jsonl --setting peer --seeds 0,1,2
    python tools/stage2_order_eval.py run --json rows.jsonl --setting b64 --seeds 0,1 \
        --requests 6000 --loads backlog,1.5,1.0,0.8 --workers 4,8,16
    python tools/stage2_order_eval.py table --json rows.jsonl

``peer``: the BF-IO simulator's setting (``balanceroute ab --peer --sample 20000``: B = 72, its
step cost, a saturated fleet with the first 4G waiting requests in the pool), Azure and
Mooncake conversation, drawn the peer's way with seed k. ``b64``: our default setting (B = 64,
the default step cost) on the five traces of issue 10's matrix; replicate k of a file trace is
``Trace.sample(requests, k)`` (k = 0: the first ``requests``), of a synthetic one the trace
synthesized with ``seed=k``; the simulator's seed is k. ``--fill`` adds BR-0 with
``stage2_fill`` (BF-IO's subset rule) under each order (``fill``, ``fill-margin``);
``--guard`` adds BR-0 with the starvation guard ``idle`` under the paper's Stage 2 and with
both (``idle``, ``fill-margin-idle``). One JSON line per (setting, trace, load, G, seed) with
ltl's and each variant's row.

``table`` prints, per cell, the mean over replicates of each order's I(k) at the step's end
(where the peer measures it) as times lower than ltl's, its throughput gain over ltl and its
share of the balanced bound, and each other order's paired ratios to ``slots`` of I(k) at the
step's start and max-min imbalance (geometric means) and throughput.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracepaths import trace_file  # noqa: E402  (tools/ beside this script)

from predictor.cli import PEER_BATCH, PEER_STEP_COST  # noqa: E402
from router_client.admission import STAGE2_ORDERS, BalanceRouteParams  # noqa: E402
from router_client.policies import make_policy  # noqa: E402
from router_client.simulator import DEFAULT_STEP_COST, SimConfig, simulate  # noqa: E402
from router_client.traces import Trace, load_trace  # noqa: E402

TRACES = {"azure": trace_file("azure"), "mooncake": trace_file("mooncake"),
          "sharegpt": trace_file("sharegpt"), "synth-long": "synth:long",
          "synth-templated": "synth:templated"}
KEPT = ("throughput_tok_s", "balanced_bound_tok_s", "imbalance_maxmin_mean",
        "imbalance_total_mean", "imbalance_total_after_step_mean",
        "starvation_guard_admissions")


def replicate(name: str, setting: str, requests: int, seed: int) -> Trace:
    """The trace of one replicate (see the module docstring)."""
    if setting == "peer":
        return load_trace(TRACES[name], "auto").draw(20000, seed)
    if TRACES[name].startswith("synth:"):
        return load_trace(f"{TRACES[name]}:seed={seed}", "auto", requests)
    trace = load_trace(TRACES[name], "auto")
    return trace.sample(requests, seed) if seed else load_trace(TRACES[name], "auto", requests)


def run(args: argparse.Namespace) -> None:
    peer = args.setting == "peer"
    traces = args.traces.split(",") if args.traces else (
        ["azure", "mooncake"] if peer else list(TRACES))
    loads = ["backlog"] if peer else args.loads.split(",")
    batch, cost = (PEER_BATCH, PEER_STEP_COST) if peer else (64, DEFAULT_STEP_COST)
    for name in traces:
        for seed in (int(s) for s in args.seeds.split(",")):
            trace = replicate(name, args.setting, args.requests, seed)
            for load in loads:
                for g in (int(w) for w in args.workers.split(",")):
                    config = SimConfig(workers=g, batch=batch, step_cost=cost, seed=seed,
                                       load=load if load == "backlog" else float(load))
                    row: dict[str, object] = {"setting": args.setting, "trace": name,
                                              "load": load, "workers": g, "seed": seed,
                                              "requests": len(trace)}
                    policies = [("ltl", make_policy("ltl", seed))] + [
                        (order, make_policy("br0", seed, BalanceRouteParams.br0(
                            stage2_order=order, stage2_fill=False))) for order in STAGE2_ORDERS]
                    if args.fill:
                        policies += [(f"fill-{order}" if order != "slots" else "fill",
                                      make_policy("br0", seed, BalanceRouteParams.br0(
                                          stage2_fill=True, stage2_order=order)))
                                     for order in STAGE2_ORDERS]
                    if args.guard:
                        policies += [
                            ("idle", make_policy("br0", seed, BalanceRouteParams.br0(
                                guard="idle", stage2_order="slots", stage2_fill=False))),
                            ("fill-margin-idle", make_policy("br0", seed, BalanceRouteParams.br0(
                                stage2_fill=True, stage2_order="margin", guard="idle")))]
                    for label, policy in policies:
                        result = simulate(trace, policy, config).row
                        row[label] = {k: result[k] for k in KEPT}
                    with Path(args.json).open("a") as out:
                        out.write(json.dumps(row) + "\n")
                    print(_line(row), flush=True)


def _orders(row: dict) -> list[str]:
    return [order for order in (*STAGE2_ORDERS, "fill", "fill-margin", "idle",
                                "fill-margin-idle") if order in row]


def _ratios(row: dict) -> dict[str, float]:
    """Each order against ltl (``<order>_ik``, ``_gain``, ``_bound``) and each order but
    ``slots`` against ``slots`` (``<order>_start``: I(k) at the step's start, ``_maxmin``,
    ``_thr``)."""
    ltl, slots = row["ltl"], row["slots"]
    out = {}
    for order in _orders(row):
        r = row[order]
        out[f"{order}_ik"] = ltl["imbalance_total_after_step_mean"] / max(
            r["imbalance_total_after_step_mean"], 1e-9)
        out[f"{order}_gain"] = r["throughput_tok_s"] / ltl["throughput_tok_s"] - 1.0
        out[f"{order}_bound"] = r["throughput_tok_s"] / r["balanced_bound_tok_s"]
        if order != "slots":
            out[f"{order}_start"] = r["imbalance_total_mean"] / max(
                slots["imbalance_total_mean"], 1e-9)
            out[f"{order}_maxmin"] = r["imbalance_maxmin_mean"] / max(
                slots["imbalance_maxmin_mean"], 1e-9)
            out[f"{order}_thr"] = r["throughput_tok_s"] / slots["throughput_tok_s"]
    return out


def _line(row: dict) -> str:
    r = _ratios(row)
    parts = [f"{o} {r[o + '_ik']:.2f}" for o in _orders(row)]
    paired = [f"{o}/slots I(k) {r[o + '_start']:.3f} tok/s {r[o + '_thr']:.4f}"
              for o in _orders(row) if o != "slots"]
    return (f"{row['setting']} {row['trace']} {row['load']} G={row['workers']} "
            f"seed {row['seed']}: I(k) end x lower than ltl {', '.join(parts)}; "
            + "; ".join(paired))


def _geo(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def table(args: argparse.Namespace) -> None:
    cells: dict[tuple, list[dict[str, float]]] = defaultdict(list)
    orders: list[str] = []
    for line in Path(args.json).read_text().splitlines():
        row = json.loads(line)
        orders = orders or _orders(row)
        cells[(row["setting"], row["trace"], row["load"], row["workers"])].append(_ratios(row))
    others = [o for o in orders if o != "slots"]
    print("| setting | trace | load | G | runs | "
          + " | ".join(f"{o}: I(k) end x lower than ltl, gain, bound" for o in orders) + " | "
          + " | ".join(f"{o} / slots: I(k), max-min, tok/s" for o in others) + " |")
    print("|---|---|---|---:|---:|" + "---|" * (len(orders) + len(others)))
    pooled: dict[str, list[float]] = defaultdict(list)
    for key in sorted(cells):
        runs = cells[key]
        mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
        against_ltl = [f"{mean[o + '_ik']:.1f}x, {100 * mean[o + '_gain']:+.2f}%, "
                       f"{100 * mean[o + '_bound']:.2f}%" for o in orders]
        paired = []
        for o in others:
            paired.append(f"{_geo([r[o + '_start'] for r in runs]):.3f}, "
                          f"{_geo([r[o + '_maxmin'] for r in runs]):.3f}, "
                          f"{mean[o + '_thr']:.4f}")
            for suffix in ("_start", "_maxmin", "_thr"):
                pooled[o + suffix] += [r[o + suffix] for r in runs]
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {len(runs)} | "
              + " | ".join(against_ltl + paired) + " |")
    for o in others:
        starts, thr = pooled[o + "_start"], pooled[o + "_thr"]
        print(f"\n{o} / slots over {len(thr)} runs: geometric mean I(k) {_geo(starts):.3f} "
              f"(lower in {sum(x < 1 for x in starts)}, higher in {sum(x > 1 for x in starts)}), "
              f"max-min {_geo(pooled[o + '_maxmin']):.3f}, mean tok/s "
              f"{sum(thr) / len(thr):.4f} (min {min(thr):.4f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run")
    go.add_argument("--json", required=True)
    go.add_argument("--setting", choices=["peer", "b64"], default="peer")
    go.add_argument("--traces", default=None)
    go.add_argument("--loads", default="backlog,1.5,1.0,0.8")
    go.add_argument("--workers", default="4,8,16")
    go.add_argument("--seeds", default="0,1,2")
    go.add_argument("--requests", type=int, default=6000)
    go.add_argument("--fill", action="store_true",
                    help="also BR-0 with stage2_fill (the most free slots filled without "
                    "overflowing first, BF-IO's subset rule)")
    go.add_argument("--guard", action="store_true",
                    help="also BR-0 with the starvation guard idle (alone, and with "
                    "stage2_fill and stage2_order margin)")
    show = sub.add_parser("table")
    show.add_argument("--json", required=True)
    args = parser.parse_args()
    (run if args.command == "run" else table)(args)


if __name__ == "__main__":
    main()
