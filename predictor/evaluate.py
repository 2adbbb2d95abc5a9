"""Offline shadow scoring of every registered estimator on a trace (``balanceroute calibrate``).

The trace is replayed in arrival order through the simulator (``brh-<estimator>`` routing, by
default G = 8, B = 64, load 1.0), with a predictor that holds one fresh instance of every
registered estimator, feeds them all the same finished requests (each learns only from
requests that finished earlier, as in an A/B run) and, at every refresh, keeps a deterministic
sample of the asked items (:func:`predictor.calibration.sampled` on request and tokens
generated, each (request, tokens) pair once) with every estimator's prediction. When a request
finishes its pending predictions are scored (:func:`predictor.calibration.score_outcome`, so a
censored outcome with fewer than H tokens left is excluded) and the report per estimator is
:func:`predictor.calibration.summarize`: scored, Brier (of ``p_fin``), ECE (10 bins),
MAE of ``c_hat`` against ``min(remaining, H)``, and the share answered by the estimator itself.
It also times each estimator's ``predict`` on 1,024 items of the trace (after the replay, with
what it learned), cold (first call after learning) and warm (repeated).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from router_client.admission import BalanceRouteParams
from router_client.policies import make_policy
from router_client.predictors import ActiveBatch, FinishedBatch, Prediction
from router_client.simulator import SimConfig, simulate
from router_client.traces import FORMATS, Trace, load_trace

from .calibration import Pending, Scored, Shadow, sampled, score_outcome, summarize
from .estimators import Estimator, Features, Outcomes, estimator_spec, estimator_specs
from .estimators.base import observe_running
from .settings import Settings


class ShadowPredictor:
    """A ``Predictor`` for the simulator: ``router`` answers, every estimator is scored."""

    def __init__(self, estimators: dict[str, Estimator], router: str, sample_rate: float) -> None:
        if router not in estimators:
            raise ValueError(f"the routing estimator {router!r} is not among the estimators")
        self.estimators = estimators
        self.router = router
        self.name = router
        self.sample_rate = sample_rate
        self.pending: dict[int, list[Pending]] = {}
        self.seen: set[tuple[int, int]] = set()
        self.scored: list[Scored] = []

    def predict(self, batch: ActiveBatch, horizon: int) -> Prediction:
        features = Features.of(batch.generated_tokens, batch.prompt_keys, batch.prompt_tokens)
        observe_running(self.estimators.values(), features)  # as the service does
        answer = self.estimators[self.router].predict(features, horizon)
        rows = []
        for row, (rid, generated) in enumerate(zip(batch.request_ids.tolist(),
                                                   batch.generated_tokens.tolist(), strict=True)):
            if (rid, generated) not in self.seen and sampled(str(rid), generated,
                                                             self.sample_rate):
                self.seen.add((rid, generated))
                rows.append(row)
        if rows:
            self._record(batch, features.take(rows), rows, horizon)
        return Prediction(answer.c_hat, p_fin=answer.p_fin, mu_rem=answer.mu_rem)

    def _record(self, batch: ActiveBatch, sub: Features, rows: list[int], horizon: int) -> None:
        answers = {name: est.predict(sub, horizon) for name, est in self.estimators.items()}
        for i, row in enumerate(rows):
            shadows = tuple(Shadow(name, float(a.p_fin[i]), float(a.c_hat[i]),
                                   a.source[i] == name) for name, a in answers.items())
            pending = Pending(int(batch.generated_tokens[row]), horizon, shadows)
            self.pending.setdefault(int(batch.request_ids[row]), []).append(pending)

    def observe(self, finished: FinishedBatch) -> None:
        censored = np.asarray(finished.censored, dtype=bool)
        outcomes = Outcomes.of(finished.output_tokens, censored, finished.prompt_keys,
                               finished.prompt_tokens)
        for estimator in self.estimators.values():
            estimator.partial_fit(outcomes)
        for rid, output, cut in zip(finished.request_ids.tolist(),
                                    finished.output_tokens.tolist(), censored.tolist(),
                                    strict=True):
            for pending in self.pending.pop(int(rid), []):
                self.scored.extend(score_outcome(pending, int(output), bool(cut)))

    def report(self) -> list[dict]:
        rows = []
        for name in self.estimators:
            mine = [s for s in self.scored if s.estimator == name]
            p = np.array([s.p_fin for s in mine])
            y = np.array([s.ended for s in mine], dtype=bool)
            c = np.array([s.c_hat for s in mine])
            realized = np.array([s.realized for s in mine])
            hit = np.array([s.hit for s in mine], dtype=bool)
            summary = summarize(p, y, c, realized, hit, name)
            summary.pop("bins")
            rows.append(summary)
        return rows


@dataclass
class Evaluation:
    rows: list[dict]
    sim_row: dict


def predict_cost(estimator: Estimator, trace: Trace, horizon: int, items: int = 1024,
                 repeats: int = 20) -> tuple[float, float]:
    """Milliseconds of one ``predict`` on ``items`` requests of the trace (cold, warm median)."""
    rng = np.random.default_rng(0)
    rows = rng.integers(0, len(trace), items)
    features = Features.of(rng.integers(0, 200, items), [trace.prompt_keys[r] for r in rows],
                           trace.prompt_tokens[rows])
    started = time.perf_counter()
    estimator.predict(features, horizon)
    cold = (time.perf_counter() - started) * 1e3
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        estimator.predict(features, horizon)
        times.append((time.perf_counter() - started) * 1e3)
    return cold, float(np.median(times))


def evaluate(trace: Trace, config: SimConfig, router: str = "survival",
             estimators: Sequence[str] | None = None, sample_rate: float = 0.1,
             settings: Settings | None = None,
             progress: Callable[[float], None] | None = None) -> Evaluation:
    """Replay ``trace`` routing BR-H with ``router`` and shadow-score the estimators."""
    names = list(estimators) if estimators else [s.name for s in estimator_specs()]
    if router not in names:
        names.append(router)
    settings = settings or Settings()
    built = {name: estimator_spec(name).build(settings) for name in names}
    shadow = ShadowPredictor(built, router, sample_rate)
    policy = make_policy(estimator_spec(router).policy,
                         params=BalanceRouteParams(horizon=config.horizon))
    result = simulate(trace, policy, config, shadow, progress)
    rows = shadow.report()
    for row in rows:
        cold, warm = predict_cost(built[row["estimator"]], trace, config.horizon)
        row["predict_ms_1024_cold"], row["predict_ms_1024_warm"] = cold, warm
    return Evaluation(rows, result.row)


def format_rows(rows: list[dict]) -> str:
    header = (f"{'estimator':<12} {'scored':>8} {'brier':>7} {'ece':>7} {'mae_c_hat':>9} "
              f"{'self':>6} {'ms/1024 cold':>12} {'warm':>6}")
    lines = [header]
    for r in rows:
        if not r["scored"]:
            lines.append(f"{r['estimator']:<12} {0:>8}")
            continue
        lines.append(
            f"{r['estimator']:<12} {r['scored']:>8} {r['brier']:>7.4f} {r['ece']:>7.4f} "
            f"{r['mae_c_hat']:>9.2f} {r['hit_rate']:>6.1%} {r['predict_ms_1024_cold']:>12.2f} "
            f"{r['predict_ms_1024_warm']:>6.2f}")
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``calibrate`` subcommand (kept here so the command line only wires it in)."""
    cal = sub.add_parser("calibrate", help="shadow-score every estimator on a trace replay")
    cal.add_argument("--trace", required=True,
                     help="trace file, or synth:long|templated|shift[:key=value,...]")
    cal.add_argument("--format", default="auto", choices=FORMATS)
    cal.add_argument("--requests", type=int, default=None, help="keep the first N requests")
    cal.add_argument("--horizon", type=int, default=80)
    cal.add_argument("--workers", type=int, default=8)
    cal.add_argument("--batch", type=int, default=64)
    cal.add_argument("--load", type=float, default=1.0)
    cal.add_argument("--router", default="survival",
                     help="the estimator whose BR-H policy routes the replay")
    cal.add_argument("--estimators", default=None,
                     help="comma-separated estimators to score (default: all registered)")
    cal.add_argument("--sample-rate", type=float, default=0.1)
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--json", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace, args.format, args.requests)
    config = SimConfig(workers=args.workers, batch=args.batch, load=args.load,
                       horizon=args.horizon, seed=args.seed)
    names = args.estimators.split(",") if args.estimators else None
    for name in [*(names or []), args.router]:
        estimator_spec(name)  # an unknown name fails before the replay
    evaluation = evaluate(trace, config, args.router, names, args.sample_rate)
    print(f"trace {args.trace}: {len(trace)} requests, G={args.workers}, B={args.batch}, "
          f"load {args.load}, H={args.horizon}, routed by brh-{args.router}")
    print(format_rows(evaluation.rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"trace": args.trace, "requests": len(trace),
                                         "horizon": args.horizon, "router": args.router,
                                         "estimators": evaluation.rows}, indent=1))
    return 0
