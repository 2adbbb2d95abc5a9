"""What a service that tunes itself gives its routers: tuning's pick, replayed on later traffic.

    python tools/tuned_eval.py run --json out.jsonl [--cells sharegpt:1.0,azure:1.0] \\
        [--workers 4,8,16] [--seeds 1] [--first-seed 1] [--requests 10000] \\
        [--grid turnover|wide] [--subgrid turnover] [--min-gain 0.001]
    python tools/tuned_eval.py table --json out.jsonl [more.jsonl ...]

For each cell (trace:load), G and replicate k: 2N requests in arrival order (real traces: a
sample drawn with seed k, kept in order, ShareGPT with Poisson arrivals seeded by k;
synth:long and synth:templated: the trace synthesized with ``seed=k``), the first N are the
past and the last N the traffic the recommendation is judged on. ``balanceroute tune`` runs
on the past with the learner the routers would get (default ``exact_match``): its grid ranked
and gated on two windows (with ``--confirm``, ranked on the first and the pick confirmed on
the second, an option). Then four replays of the later N, every
learner warmed on the past as a running service's would be: BR-0, tuning's recommendation
(BR-0 again where tuning says so), learned BR-H at its defaults (what a router runs without
tuning) and BR-H with true lengths (``brh-oracle``, the gap's far end). Tuning sees only the
past (the split is in arrival order and the later replays' learners know only the past's
outcomes: ``test_tuning_uses_only_the_past``). ``--grid`` names tuning's grid (default
tuning's own, ``turnover``; rows without the field were tuned over ``wide``, the default before
2026-12-07). ``--grid wide --subgrid turnover`` also judges the pick tuning's rule makes over
the turnover grid alone, from the same ranking rows: both grids measured on the same draws.
``--min-gain`` sets tuning's gate (the share of the bound BR-H must gain over BR-0 in every
window; rows record it where it is not tuning's default).

``table`` reports per cell and G the recommendations and, for the tuned policy, the untuned
learned one and the oracle, as ratios to BR-0 on the later N: throughput (``tok/s``), the share
of the balanced bound (which the work the window held does not move), the imbalance, and the
share of the BR-0-to-oracle imbalance gap closed. One JSON line per run is appended as it
finishes; ``run`` skips runs already there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import evalcli  # noqa: E402  (tools/ beside this script)
from tracepaths import synth_spec, trace_file  # noqa: E402

from predictor.estimators import estimator_spec  # noqa: E402
from predictor.tuning import (  # noqa: E402
    DEFAULT_GRID_NAME,
    GRIDS,
    MIN_GAIN,
    candidate_of,
    chosen_row,
    learners_of,
    replay,
    tune,
)
from router_client.admission import BalanceRouteParams  # noqa: E402
from router_client.simulator import SimConfig, bound_share  # noqa: E402
from router_client.traces import Trace, load_trace  # noqa: E402

CELLS = [f"{t}:1.0" for t in ("mooncake", "tpl", "azure", "sharegpt", "long")]
KEEP = ("throughput_tok_s", "imbalance_maxmin_mean", "balanced_bound_tok_s",
        "starvation_guard_admissions", "guard_waits", "requests", "contended_steps")


def draw(trace: str, seed: int, requests: int) -> Trace:
    """Replicate ``seed`` of ``trace``: ``requests`` requests in arrival order."""
    spec = synth_spec(trace, seed)
    if spec is not None:
        return load_trace(spec, requests=requests)
    return load_trace(trace_file(trace)).sample(requests, seed)


def _row(row: dict) -> dict:
    return {**{k: row[k] for k in KEEP if k in row}, "bound_share": bound_share(row)}


def run(args: argparse.Namespace) -> None:
    if args.subgrid is not None and (
            args.confirm or not set(GRIDS[args.subgrid]) < set(GRIDS[args.grid])):
        raise SystemExit(f"--subgrid {args.subgrid}: a part of --grid ({args.grid}), judged "
                         "by the default rule (not with --confirm)")
    if len(_learners(args.estimator)) > 1 and args.confirm:
        raise SystemExit("--estimator with several learners judges each learner's own pick "
                         "by the default rule (not with --confirm)")
    done = set()
    if args.json.exists():
        for line in args.json.read_text().splitlines():
            row = json.loads(line)
            done.add(_run_key(row))
    for cell in args.cells:
        trace_name, load_text = cell.split(":")
        load: float | str = load_text if load_text == "backlog" else float(load_text)
        for workers in args.workers:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                head = {"cell": cell, "workers": workers, "seed": seed,
                        "requests_asked": args.requests, "estimator": args.estimator,
                        "confirm": args.confirm, "grid": args.grid}
                if args.min_gain != MIN_GAIN:
                    head["min_gain"] = args.min_gain
                if args.subgrid is not None:
                    head["subgrid"] = args.subgrid
                if _run_key(head) in done:
                    continue
                started = time.monotonic()
                record = _judge(args, trace_name, load, workers, seed)
                with args.json.open("a") as f:
                    f.write(json.dumps({**head, **record}) + "\n")
                print(f"{cell} G={workers} seed {seed}: {record['recommendation']} "
                      f"{record.get('subgrid_pick', '')} "
                      f"({time.monotonic() - started:.0f} s)", file=sys.stderr)


def _judge(args: argparse.Namespace, trace_name: str, load: float | str, workers: int,
           seed: int) -> dict:
    """One draw: tuning on its past, the replays of its later half (a row's fields after the
    run's key)."""
    whole = draw(trace_name, seed, 2 * args.requests)
    split = len(whole) // 2
    config = SimConfig(workers=workers, batch=args.batch, load=load, seed=seed)
    learners = _learners(args.estimator)
    result = tune(whole, config, estimator=learners, grid=GRIDS[args.grid],
                  min_gain=args.min_gain,
                  holdout=(len(whole) - split) / len(whole), confirm=args.confirm)
    past, later = whole.split(split, "--requests")
    default = BalanceRouteParams()
    # the later half's replays by routing and learner: tuning's own of BR-0 and of its pick,
    # any other setting replayed once (the defaults are often tuning's pick)
    picked = result.recommendation.get("estimator")
    replays = {(candidate_of(result.recommendation).params(default), picked):
               result.evaluation[-1], (default.as_br0(), None): result.evaluation[0]}

    def later_of(params: BalanceRouteParams, learner: str | None) -> dict:
        learner = None if not params.horizon else learner
        if (params, learner) not in replays:
            name = "br0" if learner is None else estimator_spec(learner).policy
            replays[(params, learner)] = replay(later, name, params, config, warm=past)
        return replays[(params, learner)]

    rows = {"br0": result.evaluation[0], "tuned": result.evaluation[-1],
            **{estimator_spec(name).policy: later_of(default, name) for name in learners},
            "brh-oracle": replay(later, "brh-oracle", default, config)}
    extra: dict = {}

    def pick_over(name: str, keep, named: bool) -> str:
        """Tuning's pick (its ranking and gate on every window) over the rows ``keep``
        keeps, replayed on the later half as ``name`` (each candidate's replays do not depend
        on the others, so it costs one more replay at most); its label."""
        row = chosen_row([r for r in result.rows if keep(r)], args.min_gain)
        if row is None:
            rows[name] = result.evaluation[0]
            return "br0"
        rows[name] = later_of(candidate_of(row).params(default), row["estimator"])
        return _label_of(row, named)

    if args.subgrid is not None:
        part = {c.params(default) for c in GRIDS[args.subgrid]}
        extra["subgrid_pick"] = pick_over(_pick_name(args.subgrid, False, args.min_gain,
                                                     learners),
                                          lambda r: candidate_of(r).params(default) in part,
                                          len(learners) > 1)
    if len(learners) > 1:
        # the pick of tuning with each learner alone, from the same ranking rows
        extra["learner_picks"] = {
            learner: pick_over(_pick_name(args.grid, False, args.min_gain, [learner]),
                               lambda r, lr=learner: r["estimator"] in (None, lr), False)
            for learner in learners}
    return {"requests": [len(past), len(later)], "recommendation": result.recommendation,
            "confirmation": [{"setting": r["setting"], **_row(r)} for r in result.confirmation],
            "tuning": [{"setting": r["setting"], **_row(r)} for r in result.rows], **extra,
            "later": {name: _row(r) for name, r in rows.items()}}


def table(args: argparse.Namespace) -> None:
    """Runs of one draw under both tuning rules (files pooled) share its replays of BR-0, the
    default and the oracle, which do not depend on the rule: each (cell, G, draw) counts once,
    its pick named by grid and rule (:func:`_pick_name`; rows without the ``confirm`` field
    predate the option and are the default rule, rows without ``grid`` tuned the wide grid);
    a ``--subgrid`` pick and a run over that grid of the same draw must agree."""
    draws: dict[tuple, dict] = {}
    for path in args.json:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            row = json.loads(line)
            gain = row.get("min_gain", MIN_GAIN)
            learners = _learners(row.get("estimator", "exact_match"))
            name = _pick_name(row.get("grid", "wide"), row.get("confirm", False), gain,
                              learners)
            # a draw is its cell, G, seed and halves: runs of other sizes are others; runs
            # ranking other learners share its replays of BR-0, the oracle and each learner's
            # defaults, and a pick of the same rule in two runs must agree (checked below)
            key = (row["cell"], row["workers"], row["seed"], tuple(row["requests"]))
            merged = draws.setdefault(key, {"later": {}, "picks": {}})
            later = dict(row["later"])
            later[name] = later.pop("tuned")
            for shared, figures in later.items():
                if shared in merged["later"] and merged["later"][shared] != figures:
                    raise SystemExit(f"{path}:{number}: {shared} on {key} differs from the "
                                     "same draw's replay in another run")
            merged["later"].update(later)
            merged["picks"][name] = _label_of(row["recommendation"], len(learners) > 1)
            if "subgrid" in row:
                merged["picks"][_pick_name(row["subgrid"], False, gain, learners)] = \
                    row["subgrid_pick"]
            for learner, label in row.get("learner_picks", {}).items():
                merged["picks"][_pick_name(row.get("grid", "wide"), False, gain,
                                           [learner])] = label
    cells: dict[tuple[str, int, int], list[dict]] = defaultdict(list)
    for key, merged in sorted(draws.items()):
        cells[(key[0], key[1], key[3][0])].append(merged)  # draws of one size pool
    sizes = defaultdict(set)
    for cell, workers, half in cells:
        sizes[(cell, workers)].add(half)
    print("| cell | G | policy | n | picks | throughput x BR-0 (min..max) "
          "| share of the bound x BR-0 (min..max) | imbalance x BR-0 "
          "| gap closed (ratio of means) |")
    print("|---|---:|---|---:|---|---|---|---|---|")
    for (name_of_cell, workers, half), runs in sorted(cells.items()):
        cell = (name_of_cell if len(sizes[(name_of_cell, workers)]) == 1
                else f"{name_of_cell} (halves of {half})")
        names = _policies(runs)
        for name in names:
            have = [r for r in runs if name in r["later"]]
            picks = (", ".join(r["picks"][name] for r in have) if name.startswith("tuned")
                     else "")
            thr = np.array([_ratio(r, name, "throughput_tok_s") for r in have])
            share = np.array([_ratio(r, name, "bound_share") for r in have])
            imb = np.array([_ratio(r, name, "imbalance_maxmin_mean") for r in have])
            closed = _gap_closed(name, have)
            print(f"| {cell} | {workers} | {name} | {len(have)} | {picks} | {thr.mean():.4f} "
                  f"({thr.min():.4f}..{thr.max():.4f}) | {share.mean():.4f} "
                  f"({share.min():.4f}..{share.max():.4f}) | {imb.mean():.3f} | {closed} |")
    _summary(list(draws.values()))


def _policies(draws: list[dict]) -> list[str]:
    """The policies the draws replayed besides BR-0: tuning's picks, then the rest, the oracle
    last."""
    names = {n for d in draws for n in d["later"] if n != "br0"}
    return sorted(names, key=lambda n: (0 if n.startswith("tuned") else 2 if n == "brh-oracle"
                                        else 1, n))


def _summary(draws: list[dict]) -> None:
    """Every draw pooled, once each: per policy the mean ratios to BR-0 and the draws below
    0.999x; and the same on the draws where every policy of the files was replayed (paired)."""
    names = _policies(draws)
    paired = [d for d in draws if all(n in d["later"] for n in names)]
    print(f"\n| policy | draws | mean share x BR-0 (min) | mean tok/s x BR-0 (min) "
          f"| below 0.999x in share / tok/s | picked BR-H | on the {len(paired)} draws with "
          "every policy: mean share, below |")
    print("|---|---:|---|---|---|---|---|")
    for name in names:
        have = [d for d in draws if name in d["later"]]
        share = np.array([_ratio(d, name, "bound_share") for d in have])
        thr = np.array([_ratio(d, name, "throughput_tok_s") for d in have])
        both = np.array([_ratio(d, name, "bound_share") for d in paired])
        brh = (f"{sum(d['picks'][name] != 'br0' for d in have)} of {len(have)}"
               if name.startswith("tuned") else "")
        on_paired = f"{both.mean():.4f}, {(both < 0.999).sum()}" if len(both) else "-"
        print(f"| {name} | {len(have)} | {share.mean():.4f} ({share.min():.4f}) "
              f"| {thr.mean():.4f} ({thr.min():.4f}) | {(share < 0.999).sum()} / "
              f"{(thr < 0.999).sum()} | {brh} | {on_paired} |")


def _gap_closed(name: str, runs: list[dict]) -> str:
    """The share of the BR-0-to-oracle imbalance gap ``name`` closes (ratio of means), over
    the ``runs`` that replayed the oracle too (a draw pooled from a file without it has no
    gap to close)."""
    if name == "brh-oracle":
        return "1"
    paired = [r for r in runs if "brh-oracle" in r["later"]]
    if not paired:
        return "n/a (no oracle replay)"
    oracle = np.mean([_ratio(r, "brh-oracle", "imbalance_maxmin_mean") for r in paired])
    if oracle >= 1.0:
        return "n/a (oracle not below BR-0)"
    imb = np.mean([_ratio(r, name, "imbalance_maxmin_mean") for r in paired])
    return f"{(1.0 - imb) / (1.0 - oracle):.2f}"


def _ratio(run: dict, name: str, key: str) -> float:
    return run["later"][name][key] / run["later"]["br0"][key]


def _pick_name(grid: str, confirm: bool, min_gain: float = MIN_GAIN,
               learners: list[str] | None = None) -> str:
    """The table's name for the pick of tuning over ``grid`` by a rule and gate, ranking the
    rows of ``learners``: the default, ``exact_match`` alone, names none (whether its run
    ranked it alone or picked it out of several runs' rows: the same rule, the same replays),
    another alone ``<name> only``, several ``a+b``."""
    names = learners or ["exact_match"]
    return (f"tuned, {grid} grid" + (", confirmed" if confirm else "")
            + ("" if min_gain == MIN_GAIN else f", min gain {min_gain:g}")
            + ("" if names == ["exact_match"] else
               f", {names[0]} only" if len(names) == 1 else f", {'+'.join(names)}"))


def _learners(text: str) -> list[str]:
    """``--estimator``'s learners: comma-separated, each once, in order (tuning's check)."""
    return list(learners_of([n.strip() for n in text.split(",") if n.strip()]))


def _label_of(pick: dict, named: bool) -> str:
    """The label of a pick (a ranking row, or a recommendation: the same keys), its pool rule
    resolved and, where tuning ranked several learners (``named``), its learner named."""
    label = candidate_of(pick).label
    if named and pick["policy"] != "br0":
        label += f" estimator={pick['estimator']}"
    return label


def _run_key(row: dict) -> tuple:
    """What ``run`` resumes by: a row's cell, G, seed, N asked, learner, rule, grids
    (rows from before ``requests_asked`` was kept: the first half's size)."""
    asked = row["requests_asked"] if "requests_asked" in row else row["requests"][0]
    return (row["cell"], row["workers"], row["seed"], asked, row.get("estimator", "exact_match"),
            row.get("confirm", False), row.get("grid", "wide"), row.get("subgrid"),
            row.get("min_gain", MIN_GAIN))


def main() -> None:
    ap = evalcli.parser(__doc__)
    ap.add_argument("--cells", type=lambda s: s.split(","), default=CELLS)
    ap.add_argument("--workers", type=lambda s: [int(g) for g in s.split(",")], default=[8])
    ap.add_argument("--seeds", type=int, default=1, help="how many draws")
    ap.add_argument("--first-seed", type=int, default=1,
                    help="the first draw's seed (fresh draws: above the ones measured)")
    ap.add_argument("--requests", type=int, default=10000,
                    help="N: the past and the later traffic are N requests each")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--confirm", action="store_true",
                    help="tune with the pick confirmed on a window that did not rank it")
    ap.add_argument("--grid", choices=sorted(GRIDS), default=DEFAULT_GRID_NAME,
                    help=f"tuning's grid (default {DEFAULT_GRID_NAME}, tuning's own)")
    ap.add_argument("--min-gain", type=float, default=MIN_GAIN,
                    help=f"tuning's gate (default {MIN_GAIN:g}, tuning's own)")
    ap.add_argument("--subgrid", choices=sorted(GRIDS),
                    help="also judge the pick tuning would make over this part of its grid "
                         "(turnover: BR-0 and the turnover-discount points)")
    ap.add_argument("--estimator", default="exact_match",
                    help="the learner tuning replays and routers get (default exact_match), "
                         "or several, comma-separated (exact_match,hazard): tuning ranks each "
                         "BR-H setting with each, and each learner's own pick is judged too")
    evalcli.dispatch(ap, run, table)


if __name__ == "__main__":
    main()
