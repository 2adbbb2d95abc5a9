"""BR-H with true lengths (``brh-oracle``) against BR-0 under variants of the method.

    python tools/oracle_eval.py matrix --json rows.jsonl --seeds 0 --requests 10000 \
        --variant lpt=short_pool=lpt --variant best-pair=short_pool=best-pair
    python tools/oracle_eval.py families --json fam.jsonl --output-means 30,60,120,250,600 \
        --prompt-means 1000,6000 --loads 0.8,1.0 --workers 4,8 --variant lpt=short_pool=lpt ...
    python tools/oracle_eval.py table --json rows.jsonl

``matrix``: the bundled and shared traces (Azure conversation, Mooncake conversation,
ShareGPT, synth:long, synth:templated) at backlog, 1.5, 1.0 and 0.8, G = 4, 8, 16, B = 64
(``--batch``), the default step cost. Replicate 0 is the first ``--requests`` requests (the
README's matrix);
replicate k > 0 of a file trace is its k-th window of ``--requests`` consecutive requests
(requests ``k * n`` to ``(k + 1) * n - 1``) while the trace holds it, and past its end ``n``
requests drawn at random (seeded by k) without replacement, kept in trace order with their
arrival times (``Trace.sample``). Replicate k of a synthetic trace (k = 0 too) is the trace
synthesized with ``seed=k`` and ``n`` = ``--requests`` (up to 10,000 the same trace as
before 2026-12-03, when replicate 0 was capped at the workload's default 10,000). The
simulator's seed is k. ``families``: ``synth:long`` with each output mean x
prompt mean (lognormal, shape 1.0 and 0.8): workloads of the shapes we do not ship, short
outputs above all. A ``--variant NAME=k=v,k=v`` sets :class:`BalanceRouteParams` fields for
BR-H (an empty list: the defaults); BR-0 runs once per replicate and is the reference of
every variant (a variant may not set ``horizon``: the simulation's H, 80, is every BR-H's);
``--br0 k=v,...`` sets the reference BR-0's fields (default: BR-0's defaults), recorded in each
row as ``br0_fields``.
One JSON line per (variant, cell, G) is appended as it finishes (to a new file, or one the
same command has not filled yet: ``table`` counts every line).

``table`` prints per cell the mean throughput ratio over replicates (``--measure``: ``tok/s``
over the routing window, the default; ``share`` of each run's balanced bound; ``run``, the
whole run) and the geometric mean
of the max-min imbalance ratio, flagged where issue 10's must-holds miss (T: throughput <
0.999; I: imbalance above BR-0's at saturation, load 1.0 and above or backlog; L: above 0.8x
on synth:long and ShareGPT there), and per variant the summary.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracepaths import trace_file  # noqa: E402  (tools/ beside this script)

from predictor import abtest  # noqa: E402
from router_client.admission import BalanceRouteParams  # noqa: E402
from router_client.simulator import SimConfig, bound_share  # noqa: E402
from router_client.traces import Trace, load_trace  # noqa: E402

TRACES = {
    "azure": trace_file("azure"),
    "mooncake": trace_file("mooncake"),
    "sharegpt": trace_file("sharegpt"),
    "synth-long": "synth:long",
    "synth-templated": "synth:templated",
}
LOADS = ["backlog", "1.5", "1.0", "0.8"]
LONG_OUTPUTS = ("synth-long", "sharegpt")
KEPT = ("throughput_tok_s", "balanced_bound_tok_s", "imbalance_maxmin_mean",
        "imbalance_total_mean", "starvation_guard_admissions", "completed", "ttft_p95_ms",
        "pool_wait_p95_steps", "guard_waits", "makespan_s", "run_throughput_tok_s")  # of each row


def parse_variant(text: str) -> tuple[str, dict[str, object]]:
    """``NAME=k=v,k=v`` -> (NAME, fields); values are integers, then numbers, where they
    parse as one."""
    name, _, rest = text.partition("=")
    fields: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, _, raw = item.partition("=")
        for kind in (int, float):
            try:
                fields[key] = kind(raw)
                break
            except ValueError:
                continue
        else:
            fields[key] = {"true": True, "false": False}.get(raw, raw)
    if "horizon" in fields:
        raise SystemExit(f"variant {name}: horizon is the simulation's (80), not a variant's")
    BalanceRouteParams(**fields)  # type: ignore[arg-type]  # a bad field fails here, early
    return name, fields


def replicate(name: str, seed: int, requests: int) -> Trace:
    """Replicate ``seed`` of a bundled trace (see the module docstring)."""
    spec = TRACES[name]
    if spec.startswith("synth:"):  # ``requests`` of them, synthesized with this seed
        return load_trace(f"{spec}:seed={seed},n={requests}", "auto", None)
    if seed == 0:
        return load_trace(spec, "auto", requests)
    full = load_trace(spec, "auto", None)
    if (seed + 1) * requests <= len(full):
        return full.take(np.arange(seed * requests, (seed + 1) * requests))
    return full.sample(requests, seed)


def load_value(load: str) -> float | str:
    return load if load == "backlog" else float(load)


def compare(trace: Trace, load: str, workers: list[int], seed: int,
            variants: dict[str, dict[str, object]],
            br0: dict[str, object] | None = None, batch: int = 64) -> Iterator[dict]:
    """BR-0 once (``br0``: its :class:`BalanceRouteParams` fields, default none), then
    ``brh-oracle`` under each variant, on the same trace and arrivals (``batch`` slots per
    worker)."""
    config = SimConfig(batch=batch, load=load_value(load), horizon=80, refresh_steps=10,
                       seed=seed, record_trajectory=False)
    reference = BalanceRouteParams(**(br0 or {}))  # type: ignore[arg-type]
    base = {r["workers"]: r for r in abtest.run_comparison(trace, ["br0"], workers, config,
                                                           params=reference).rows}
    for name, fields in variants.items():
        params = BalanceRouteParams(**fields)  # type: ignore[arg-type]
        for row in abtest.run_comparison(trace, ["brh-oracle"], workers, config,
                                         params=params).rows:
            b = base[row["workers"]]
            yield {"variant": name, "fields": fields, "load": load, "workers": row["workers"],
                   "seed": seed, "batch": batch,
                   "throughput_ratio": row["throughput_tok_s"] / b["throughput_tok_s"],
                   "imbalance_ratio": row["imbalance_maxmin_mean"] / b["imbalance_maxmin_mean"],
                   "gamma_mean": row.get("gamma_mean"), "br0_fields": br0 or {},
                   "br0": {k: b[k] for k in KEPT}, "oracle": {k: row[k] for k in KEPT}}


def emit(path: Path, rows: Iterator[dict], cell: dict) -> None:
    with path.open("a") as f:
        for row in rows:
            row.update(cell)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"{row['trace']} {row['load']} G={row['workers']} seed {row['seed']} "
                  f"{row['variant']}: throughput x{row['throughput_ratio']:.4f}, "
                  f"imbalance x{row['imbalance_ratio']:.3f}", flush=True)


def cmd_matrix(args: argparse.Namespace) -> None:
    variants = dict(map(parse_variant, args.variant))
    for name, seed in itertools.product(args.traces, args.seeds):
        trace = replicate(name, seed, args.requests)
        for load in args.loads:
            emit(args.json, compare(trace, load, args.workers, seed, variants, args.br0,
                                    args.batch),
                 {"trace": name, "requests": len(trace)})


def cmd_families(args: argparse.Namespace) -> None:
    variants = dict(map(parse_variant, args.variant))
    for om, pm, load, seed in itertools.product(args.output_means, args.prompt_means,
                                                args.loads, args.seeds):
        spec = (f"synth:long:output_mean={om},prompt_mean={pm},n={args.requests},"
                f"max_output=16384,seed={seed}")
        trace = load_trace(spec, "auto", None)
        emit(args.json, compare(trace, load, args.workers, seed, variants, args.br0,
                                args.batch),
             {"trace": f"long-o{om}-p{pm}", "requests": len(trace)})


MEASURES = ("tok/s", "share", "run")


def throughput_ratio(row: dict, measure: str, where: str) -> float:
    """BR-H's throughput over BR-0's in one row, by ``measure``: ``tok/s`` over the routing
    window (``throughput_ratio``, issue 10's figure), ``share`` of each run's own balanced
    bound (the routing, without the work the window held) or ``run``: every token of the run,
    drain included."""
    if measure == "tok/s":
        return float(row["throughput_ratio"])
    b, o = row.get("br0", {}), row.get("oracle", {})
    keys = (("throughput_tok_s", "balanced_bound_tok_s") if measure == "share"
            else ("run_throughput_tok_s",))
    if not all(k in b and k in o for k in keys):
        raise SystemExit(f"{where}: the row does not keep {' and '.join(keys)} for --measure "
                         f"{measure}")
    if measure == "share":
        return bound_share(o) / bound_share(b)
    return float(o["run_throughput_tok_s"] / b["run_throughput_tok_s"])


def cmd_table(args: argparse.Namespace) -> None:
    cells: dict[str, dict[tuple, list[tuple[float, float]]]] = defaultdict(
        lambda: defaultdict(list))
    for number, line in enumerate(args.json.read_text().splitlines(), 1):
        r = json.loads(line)
        cells[r["variant"]][(r["trace"], r["load"], r["workers"])].append(
            (throughput_ratio(r, args.measure, f"{args.json}:{number}"), r["imbalance_ratio"]))
    names = list(cells)
    keys = sorted({k for v in cells.values() for k in v})
    print("| trace | load | G | " + " | ".join(names) + " |")
    print("|---|---|---:|" + "---|" * len(names))
    summary: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for key in keys:
        out = []
        for name in names:
            runs = cells[name].get(key)
            if not runs:
                out.append("")
                continue
            thr = sum(t for t, _ in runs) / len(runs)
            imb = math.exp(sum(math.log(i) for _, i in runs) / len(runs))
            saturated = key[1] == "backlog" or float(key[1]) >= 1.0
            flag = ("T" if thr < 0.999 else "") + ("I" if saturated and imb > 1.0 else "") + (
                "L" if saturated and key[0] in LONG_OUTPUTS and imb > 0.8 else "")
            summary[name].append((thr, imb, flag))
            out.append(f"{thr:.4f}, {imb:.3f}" + (f" **{flag}**" if flag else ""))
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(out) + " |")
    print()
    for name in names:
        rows = summary[name]
        thr = [t for t, _, _ in rows]
        singles = [t for runs in cells[name].values() for t, _ in runs]
        print(f"{name}: {len(rows)} cells, mean throughput x{sum(thr) / len(thr):.4f} "
              f"(lowest x{min(thr):.4f}), geometric-mean imbalance "
              f"x{math.exp(sum(math.log(i) for _, i, _ in rows) / len(rows)):.3f}; cells below "
              f"0.999: {sum(t < 0.999 for t in thr)}; misses T/I/L: "
              f"{sum('T' in f for _, _, f in rows)}/{sum('I' in f for _, _, f in rows)}/"
              f"{sum('L' in f for _, _, f in rows)}; single runs below 0.999: "
              f"{sum(t < 0.999 for t in singles)} of {len(singles)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    for name in ("matrix", "families"):
        p = sub.add_parser(name)
        p.add_argument("--json", type=Path, required=True, help="append rows here")
        p.add_argument("--variant", action="append", default=[],
                       help="NAME=field=value,... (BalanceRouteParams for BR-H; repeatable)")
        p.add_argument("--workers", type=ints, default=[4, 8, 16])
        p.add_argument("--batch", type=int, default=64, help="B slots per worker (default 64)")
        p.add_argument("--seeds", type=ints, default=[0])
        p.add_argument("--requests", type=int, default=10000 if name == "matrix" else 4000)
        p.add_argument("--loads", type=lambda t: t.split(","), default=LOADS)
        p.add_argument("--br0", type=lambda t: parse_variant("br0=" + t)[1], default=None,
                       help="field=value,... of the reference BR-0's BalanceRouteParams "
                       "(default: BR-0's defaults)")
    sub.choices["matrix"].add_argument("--traces", type=lambda t: t.split(","),
                                       default=list(TRACES))
    sub.choices["families"].add_argument("--output-means", type=ints,
                                         default=[30, 60, 120, 250, 600])
    sub.choices["families"].add_argument("--prompt-means", type=ints, default=[1000, 6000])
    t = sub.add_parser("table")
    t.add_argument("--json", type=Path, required=True)
    t.add_argument("--measure", choices=MEASURES, default="tok/s",
                   help="the throughput ratio T flags: tok/s over the routing window "
                        "(default), share of the run's balanced bound, or the whole run")
    args = ap.parse_args(argv)
    if args.command != "table" and not args.variant:
        args.variant = ["default="]
    {"matrix": cmd_matrix, "families": cmd_families, "table": cmd_table}[args.command](args)


if __name__ == "__main__":
    main()
