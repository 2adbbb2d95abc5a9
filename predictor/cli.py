"""The ``balanceroute`` command line (composition root)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from importlib.resources import files
from pathlib import Path

from proxy.cli import add_commands as add_serving_commands
from router_client.admission import (
    END_SHAPES,
    GUARD_RULES,
    SHORT_POOL_GROWTHS,
    SHORT_POOL_RULES,
    STAGE1_RULES,
    STAGE2_ORDERS,
    ZERO_GAMMA_RULES,
    BalanceRouteParams,
)
from router_client.errors import BalanceRouteError, ParameterError
from router_client.predictors import Predictor
from router_client.projection import END_POINTS, END_SHAPE
from router_client.simulator import DEFAULT_STEP_COST, SimConfig, check_load, parse_step_cost
from router_client.traces import FORMATS, Trace, load_trace

from . import abtest, evaluate
from .tuning import DEFAULT_GRID_NAME, GRIDS, MIN_GAIN


def bundled_trace() -> Path:
    """The copy of the Azure 2023 conversation trace shipped with the package (found as
    package data, so a regular ``pip install`` has it too)."""
    return Path(str(files("router_client") / "data" / "AzureLLMInferenceTrace_conv.csv"))


class Progress:
    """Progress on stderr: a redrawn line on a terminal, a line per 10% otherwise."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.last_decile = -1
        self.started = time.monotonic()

    def __call__(self, fraction: float, label: str) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.started
        text = f"{fraction:6.1%} {label} ({elapsed:.0f}s)"
        if self.tty:
            sys.stderr.write("\r" + text.ljust(70))
            if fraction >= 1.0:
                sys.stderr.write("\n")
        else:
            decile = int(fraction * 10)
            if decile > self.last_decile:
                self.last_decile = decile
                sys.stderr.write(text + "\n")
        sys.stderr.flush()


def _workers(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        message = f"--workers takes integers like 8 or 4,8,16: {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("--workers needs positive integers")
    return values


def _number_or_never(text: str) -> float | None:
    """``--own-wait-horizon``'s and ``--br0-check``'s value: a number, or ``never`` (None)."""
    if text.strip().lower() in ("never", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number nor 'never': {text!r}") from None


def _load(text: str) -> float | str:
    if text == "backlog":
        return text
    try:
        value = float(text)
        check_load(value)
    except ParameterError as exc:
        raise argparse.ArgumentTypeError(exc.detail) from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"--load takes a number or 'backlog': {text!r}") from None
    return value


GAMMA_DEFAULT = BalanceRouteParams().gamma
TURNOVER_SCALE_DEFAULT = BalanceRouteParams().turnover_scale


def _gamma_text(gamma: float | None) -> str:
    return "turnover" if gamma is None else f"{gamma:g}"


def _gamma(text: str) -> float | None:
    if text == "turnover":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--gamma takes a number in (0, 1] or 'turnover': {text!r}") from None
    return value  # the range is BalanceRouteParams' to check (a ParameterError naming gamma)


def _step_cost(text: str) -> tuple[float, float]:
    try:
        return parse_step_cost(text)
    except ParameterError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None


def _names(text: str) -> list[str]:
    """A comma-separated list of names (``--policies``, ``tune --estimator``)."""
    return [p.strip() for p in text.split(",") if p.strip()]


def _estimators(text: str) -> list[str]:
    """``tune --estimator``: one registered estimator or several, comma-separated."""
    from .estimators import estimator_names

    names = list(dict.fromkeys(_names(text)))
    unknown = [n for n in names if n not in estimator_names()]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown) or repr(text)}: not an estimator; known: "
            f"{', '.join(estimator_names())} (several comma-separated)")
    return names


def _add_stage2_options(ab) -> None:
    """``ab``'s Stage-2 and starvation-guard options (BR-0 and BR-H alike)."""
    ab.add_argument("--stage2-order", default=BalanceRouteParams.stage2_order,
                    choices=list(STAGE2_ORDERS),
                    help="the order in which Stage 2 takes workers with free slots, BR-0 and "
                    "BR-H: slots (most free slots first, then the widest margin; the paper's) or "
                    "margin (the widest margin first); default: margin for BR-0, slots for BR-H")
    ab.add_argument("--stage2-fill", action=argparse.BooleanOptionalAction,
                    default=BalanceRouteParams.stage2_fill,
                    help="Stage 2 takes, for each worker, the most waiting requests that fit "
                    "under the current maximum together (then the largest total, or BR-H's best "
                    "F), and the best F only where none fits (BF-IO's subset rule); "
                    "--no-stage2-fill: the best F always (the paper's); default: the rule for "
                    "BR-0, the paper's for BR-H")
    ab.add_argument("--stage2-revisit", action=argparse.BooleanOptionalAction,
                    default=BalanceRouteParams.stage2_revisit,
                    help="a worker that took a Stage-2 subset with F > 0 and has slots left is "
                    "taken again after every worker's first visit (a later admission may have "
                    "raised the maximum), admitting only a subset with F > 0 then; default: "
                    "each worker once (the paper's and BF-IO's)")
    ab.add_argument("--guard", default=None, choices=list(GUARD_RULES),
                    help="the starvation guard where a worker's best F in Stage 2 is not "
                    "positive: always (admit the single best request anyway; the paper's) or "
                    "idle (leave its slots empty this round where no request would lower the "
                    "imbalance now; Stage 1 admits once more than --s-greedy slots are free); "
                    "default: idle for BR-H, always for BR-0")
    ab.add_argument("--patience", type=int, default=BalanceRouteParams.patience,
                    metavar="ROUNDS",
                    help="with the guard idle, a worker that has left its free slots empty "
                    "this many rounds in a row takes its best request in the next (0: never "
                    "waits; default: no bound; measured, see the README)")
    ab.add_argument("--zero-gamma-rules", default=BalanceRouteParams.zero_gamma_rules,
                    choices=list(ZERO_GAMMA_RULES),
                    help="a BR-H round whose discount is 0 (nothing the lookahead sees "
                    "outlives it) is BR-0's round: br0 (default) with BR-0's guard and Stage 2 "
                    "too, brh with BR-H's (the rule before 2026-12-05)")
    ab.add_argument("--myopic-horizon", type=float, default=BalanceRouteParams.myopic_horizon,
                    metavar="STEPS",
                    help="a BR-H round whose effective horizon 1/(1-gamma) is below this many "
                    "steps is treated as a round at gamma 0 (default 1.5: rounded to whole "
                    "steps, one step; 1: only gamma 0, the rule before 2026-12-06)")
    ab.add_argument("--own-wait-horizon", type=_number_or_never,
                    default=BalanceRouteParams.own_wait_horizon, metavar="STEPS",
                    help="with the guard idle, a BR-H round whose effective horizon 1/(1-gamma) "
                    "reaches this many steps leaves a worker's slots empty wherever its own "
                    "F of every subset is <= 0 (default 12; never: the rule before; see the "
                    "README)")
    ab.add_argument("--own-wait-learned", action=argparse.BooleanOptionalAction,
                    default=BalanceRouteParams.own_wait_learned,
                    help="the own wait (--own-wait-horizon) also in rounds with a learned law "
                    "(the rule from 2026-12-06 to 2026-12-07; default: only in rounds without a "
                    "learned law: true lengths, or c_hat alone)")
    ab.add_argument("--br0-check", type=_number_or_never,
                    default=BalanceRouteParams.br0_check, metavar="CANDIDATES",
                    help="a BR-H round stands only where its own measure (summed F) is above "
                    "that of BR-0's round from the same state by more than this many "
                    "candidates' discounted fill, else the round is BR-0's (0: strictly "
                    "better; default never: no check; see the README)")


def _add_ab(sub) -> None:
    ab = sub.add_parser("ab", help="A/B comparison of routing policies by trace replay")
    ab.add_argument("--trace", required=True,
                    help="trace file, or synth:long|templated|shift[:key=value,...]")
    ab.add_argument("--format", default="auto", choices=FORMATS)
    ab.add_argument("--workers", type=_workers, default=[8], help="8, or a list like 4,8,16")
    ab.add_argument("--batch", type=int, default=64, help="B: slots per worker (default 64)")
    ab.add_argument("--requests", type=int, default=None,
                    help="replay the first N requests (of a synth: workload without n: N "
                    "requests synthesized)")
    ab.add_argument("--load", type=_load, default=1.0,
                    help="arrival rate relative to saturation, or 'backlog' (default 1.0)")
    ab.add_argument("--policies", type=_names, default=abtest.default_policies(),
                    help=f"comma-separated, of {','.join(abtest.known_policies())} "
                    f"(default: {','.join(abtest.default_policies())})")
    ab.add_argument("--step-cost", type=_step_cost, default=DEFAULT_STEP_COST,
                    help="A,B: step time = A * max load + B seconds (default {:g},{:g})".format(
                        *DEFAULT_STEP_COST))
    ab.add_argument("--horizon", type=int, default=80, help="H for BR-H (default 80)")
    ab.add_argument("--refresh-steps", type=int, default=10,
                    help="predictions refreshed every this many steps (default 10)")
    ab.add_argument("--seed", type=int, default=0)
    ab.add_argument("--beta", type=float, default=None,
                    help="BR-H overflow weight (default alpha*G: each step on BR-0's scale; "
                    "the paper's deployment value is 43; BR-0 always uses G)")
    ab.add_argument("--learned-beta-scale", type=float,
                    default=BalanceRouteParams.learned_beta_scale, metavar="X",
                    help="BR-H with a learned law and --beta unset: an overflow weight of X "
                    "times alpha*G (default 1; true lengths are never scaled; see the README)")
    ab.add_argument("--candidate-life", action=argparse.BooleanOptionalAction, default=True,
                    help="BR-H scores a candidate by its projected added work (s + h while its "
                    "own c_hat says it runs); --no-candidate-life: the paper's constant D")
    ab.add_argument("--refill", action=argparse.BooleanOptionalAction, default=False,
                    help="BR-H projects each slot emptied within the window as taken at once "
                    "by a request of the pool's mean prompt (when the pool outnumbers the free "
                    "slots); default off")
    ab.add_argument("--gamma", type=_gamma, default=GAMMA_DEFAULT,
                    help="BR-H per-step discount in (0, 1], or 'turnover': each round, the "
                    "discount whose effective horizon is --turnover-scale times the steps "
                    "between two admissions to one worker (default: "
                    f"{_gamma_text(GAMMA_DEFAULT)})")
    ab.add_argument("--turnover-scale", type=float, default=TURNOVER_SCALE_DEFAULT,
                    help="with --gamma turnover: effective horizon in units of the steps "
                    f"between admissions to a worker (default {TURNOVER_SCALE_DEFAULT:g})")
    ab.add_argument("--rmax", type=int, default=None,
                    help="Stage-2 candidates per worker (default min(4G, 64), BR-0 and BR-H)")
    ab.add_argument("--s-greedy", type=int, default=7,
                    help="Stage 1 runs while more slots than this are free (default 7)")
    ab.add_argument("--stage1", default="auto", choices=list(STAGE1_RULES),
                    help="BR Stage-1 rule: auto (default: while the pool is short, BR-0 admits "
                    "largest first onto the least-loaded open worker (lpt) and BR-H places it by "
                    "--short-pool; the paper's most-free-slots rule at "
                    "saturation), paper, best-pair, lpt, auto-pair (best pair on a short pool)")
    _add_stage2_options(ab)
    ab.add_argument("--out", type=Path, default=None, help="directory for CSV and PNG plots")
    ab.add_argument("--json", type=Path, default=None, help="write the result rows here")
    ab.add_argument("--predictor-url", default=None,
                    help="route BR-H through a running prediction service")
    ab.add_argument("--sample", type=int, default=None,
                    help="replay N requests drawn at random (seeded by --seed, kept in order); "
                    "with --peer drawn as the BF-IO simulator draws them: in random order, "
                    "with replacement when the trace has fewer than N")
    ab.add_argument("--skip", type=int, default=None, metavar="N",
                    help="leave out the first N requests (after --requests and --sample): the "
                    "replay starts after them, every learner empty (with --warm, the past is "
                    "the requests right after the skipped ones)")
    ab.add_argument("--warm", type=int, default=None, metavar="N",
                    help="the first N requests (after --requests and --sample) are the past: "
                    "every learner (brh-<estimator>) is told them all as finished before its "
                    "replay, as a running service knows its history (and a little more: its "
                    "last requests would still be running), and the requests after them are "
                    "replayed, by every policy (default: none, learners start empty)")
    ab.add_argument("--peer", action="store_true",
                    help="the BF-IO simulator's setting: --load backlog (the pool kept at the "
                    "first 4G waiting requests), --batch 72, --step-cost 1.0052e-7,0.0048875")
    ab.add_argument("--run-tag", default=None,
                    help="prefix of request ids sent to --predictor-url (default: from the "
                    "clock, so repeated runs do not collide)")
    ab.add_argument("--quiet", action="store_true", help="no progress on stderr")
    _add_learned_flags(ab)


def _add_learned_flags(ab: argparse.ArgumentParser) -> None:
    """``ab``'s flags for how BR-H reads a learned law and places a short pool."""
    ab.add_argument("--end-points", type=int, default=END_POINTS,
                    help="BR-H with a learned predictor: spread the end time of a request "
                    "that ends within the window over this many points of its law with "
                    f"mean mu_rem (0: all at mu_rem, the point law; default {END_POINTS})")
    ab.add_argument("--end-shape", choices=END_SHAPES, default=END_SHAPE,
                    help="BR-H with a learned predictor: the end-time law within the window "
                    "and how an answer ages between refreshes: exponential (a constant hazard, "
                    "conditioned on the request still running; default) or uniform (the law "
                    "before 2026-12-06: mu_rem moved closer, p_fin kept)")
    ab.add_argument("--expected-overflow", action=argparse.BooleanOptionalAction, default=True,
                    help="BR-H with a learned predictor: the overflow penalty is its expectation "
                    "under the predicted law of each worker's load (default); "
                    "--no-expected-overflow: the overflow of the expected load")
    ab.add_argument("--marginal-overflow", action=argparse.BooleanOptionalAction,
                    default=BalanceRouteParams.marginal_overflow,
                    help="BR-H with a learned predictor: the overflow penalty is the rise of the "
                    "expected overflow the admission causes (the worker's own expected overflow "
                    "without it subtracted); default: the expected overflow itself")
    ab.add_argument("--learned-short-pool", action=argparse.BooleanOptionalAction,
                    default=BalanceRouteParams.learned_short_pool,
                    help="BR-H with a learned predictor places a short pool (every waiting "
                    "request admitted this round) by --short-pool; default: as BR-0 places it "
                    "(with true lengths --short-pool decides either way)")
    ab.add_argument("--short-pool", default=BalanceRouteParams.short_pool,
                    choices=list(SHORT_POOL_RULES),
                    help="how BR-H places a short pool under --stage1 auto (ignored by the "
                    "other rules), with true lengths, or with a learned predictor together with "
                    "--learned-short-pool: lpt-fit (default: largest first, onto the "
                    "least-loaded open worker if it fits there under the current maximum, else "
                    "where its F is highest), lpt (largest first, where its F is highest), "
                    "lpt-load (largest first onto the least-loaded, as BR-0), best-pair (the "
                    "best (worker, request) pair by F)")
    ab.add_argument("--short-pool-growth", default=BalanceRouteParams.short_pool_growth,
                    choices=list(SHORT_POOL_GROWTHS),
                    help="how --short-pool's F projects the workers' growth with true lengths: "
                    "requests (by the requests each holds now), slots (each free slot grows "
                    "as an occupied one: a filling fleet's later arrivals even the counts out), "
                    "filling (the default: slots while more arrivals than completions are "
                    "expected within the window, requests otherwise) or arrivals (each free "
                    "slot grows as the measured arrival rate is expected to fill it)")
    ab.add_argument("--fit-horizon", type=float, default=BalanceRouteParams.fit_horizon,
                    help="with --short-pool lpt-fit: a round whose effective horizon "
                    "1 / (1 - gamma) reaches this many steps places the short pool by F, as "
                    "lpt (default: never; measured, see the README)")


def _add_tune(sub) -> None:
    tune = sub.add_parser("tune", help="which policy this workload should run: BR-0 or a BR-H "
                          "setting, by replaying the trace over a small grid")
    tune.add_argument("--trace", required=True,
                      help="trace file, or synth:long|templated|shift[:key=value,...]")
    tune.add_argument("--format", default="auto", choices=FORMATS)
    tune.add_argument("--workers", type=int, default=8)
    tune.add_argument("--batch", type=int, default=64)
    tune.add_argument("--requests", type=int, default=None, help="the first N requests")
    tune.add_argument("--load", type=_load, default=1.0,
                      help="arrival rate relative to saturation, or 'backlog' (default 1.0)")
    tune.add_argument("--estimator", type=_estimators, default=["exact_match"],
                      help="estimator BR-H would use (default exact_match), or several, "
                      "comma-separated (exact_match,hazard): every BR-H setting is replayed "
                      "with each, and the recommendation names the learner of its pick")
    tune.add_argument("--holdout", type=float, default=0.0,
                      help="share of the trace (the latest requests) kept out of tuning and "
                      "used to check the recommendation against BR-0 (default 0)")
    tune.add_argument("--grid", default=DEFAULT_GRID_NAME, choices=list(GRIDS),
                      help="the settings replayed: turnover (BR-0 and BR-H with the discount "
                      "from the fleet's turnover, the default) or wide (those and fixed "
                      "discounts: more chances to gain, and to pick a lucky replay)")
    tune.add_argument("--min-gain", type=float, default=MIN_GAIN,
                      help="BR-H must beat BR-0's share of the balanced bound by this "
                      "fraction, with no less throughput and no more imbalance (default "
                      f"{MIN_GAIN:g})")
    tune.add_argument("--windows", type=int, default=2,
                      help="replay the past in this many consecutive windows, each with the "
                      "learner warmed on the ones before (default 2; 1: one replay); BR-H "
                      "is recommended only if it wins in each")
    tune.add_argument("--confirm", action="store_true",
                      help="rank the grid on all windows but the last and recommend its pick "
                      "only if it wins again on the last, which played no part in picking it "
                      "(an option: README, 'Tuning judged on later traffic')")
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument("--json", type=Path, default=None, help="write the result here")
    tune.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _add_bench(sub) -> argparse._SubParsersAction:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    router = bench_sub.add_parser("router", help="time full BR-H scheduling rounds")
    router.add_argument("--workers", type=int, default=8, help="G (default 8)")
    router.add_argument("--rmax", type=int, default=None,
                        help="Stage-2 window (default min(4G, 64), BR-0 and BR-H)")
    router.add_argument("--pool", type=int, default=256,
                        help="waiting requests in each timed round (default 256)")
    router.add_argument("--batch", type=int, default=64, help="B (default 64)")
    router.add_argument("--horizon", type=int, default=80,
                        help="H of the BR-H timed (default 80); 0 times BR-0 and its fast path")
    router.add_argument("--rounds", type=int, default=2000, help="rounds timed (default 2000)")
    router.add_argument("--seed", type=int, default=0, help="default 0")
    router.add_argument("--predictor", default="oracle",
                        help="where the timed states' predictions come from: oracle (true "
                        "lengths, default) or a registered estimator learning online in the "
                        "sampling run (survival, exact_match, hazard), whose law of remaining "
                        "life the round projects and scores with its spread")
    router.add_argument("--json", type=Path, default=None)
    predictor = bench_sub.add_parser("predictor", help="time /v1/contributions")
    predictor.add_argument("--items", type=int, default=1024,
                           help="active requests per contributions query (default 1024)")
    predictor.add_argument("--rounds", type=int, default=300,
                           help="queries timed per layout and phase (default 300)")
    predictor.add_argument("--json", type=Path, default=None)
    calibration = bench_sub.add_parser("calibration",
                                       help="time the calibration report over stored scores")
    calibration.add_argument("--scored", type=int, default=100_000,
                             help="stored scores the report covers (default 100000)")
    calibration.add_argument("--json", type=Path, default=None)
    restart = bench_sub.add_parser(
        "restart", help="time a restart over a SQLite database of stored observations")
    restart.add_argument("--observations", type=int, default=1_000_000,
                         help="observations stored before the restart (default 1000000)")
    restart.add_argument("--replay", type=int, default=None,
                         help="replay_observations (default: the setting's; 0: all)")
    restart.add_argument("--json", type=Path, default=None)
    return bench_sub


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="balanceroute",
        description="Load balancing for barrier-synchronized data-parallel LLM decode fleets.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    parser.add_argument("--version", action="version",
                        version=f"balanceroute {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the prediction service (FastAPI)",
                           description="Run the prediction service.",
                           epilog=settings_help(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--database-url", default=None,
                       help="SQLAlchemy URL (default: BALANCEROUTE_DATABASE_URL or SQLite)")
    serve.add_argument("--access-log", action="store_true",
                       help="log every request (uvicorn's access log; off by default: a line "
                       "per contributions query costs about a sixth of a small query's time in "
                       "the service; /metrics counts the requests)")

    _add_ab(sub)
    _add_tune(sub)
    bench_sub = _add_bench(sub)
    sub.add_parser("demo", help="run the main job end to end on bundled data")
    evaluate.add_parser(sub)
    add_serving_commands(sub, bench_sub)  # proxy, emulate, bench serve (proxy/cli.py)
    return parser


# The BF-IO simulator's setting (the same group's predecessor method): a saturated fleet of
# B = 72 slots per worker, its step cost, and a window of the first 4G waiting requests.
PEER_BATCH = 72
PEER_STEP_COST = (1.0052e-7, 0.0048875)


def _ab_params(args: argparse.Namespace) -> BalanceRouteParams:
    """The BR parameters ``ab``'s options set (its horizon is the simulation's)."""
    return BalanceRouteParams(beta=args.beta, gamma=args.gamma, r_max=args.rmax,
                              learned_beta_scale=args.learned_beta_scale,
                              turnover_scale=args.turnover_scale,
                              s_greedy=args.s_greedy, stage1=args.stage1,
                              candidate_life=args.candidate_life, refill=args.refill,
                              end_points=args.end_points, end_shape=args.end_shape,
                              expected_overflow=args.expected_overflow,
                              marginal_overflow=args.marginal_overflow,
                              learned_short_pool=args.learned_short_pool,
                              short_pool=args.short_pool,
                              short_pool_growth=args.short_pool_growth,
                              stage2_order=args.stage2_order,
                              stage2_fill=args.stage2_fill,
                              stage2_revisit=args.stage2_revisit,
                              fit_horizon=args.fit_horizon, guard=args.guard,
                              patience=args.patience,
                              zero_gamma_rules=args.zero_gamma_rules,
                              myopic_horizon=args.myopic_horizon,
                              own_wait_horizon=args.own_wait_horizon,
                              own_wait_learned=args.own_wait_learned,
                              br0_check=args.br0_check)


def cmd_ab(args: argparse.Namespace) -> int:
    abtest.validate_policies(args.policies)
    if args.peer:
        args.load, args.batch, args.step_cost = "backlog", PEER_BATCH, PEER_STEP_COST
    trace = load_trace(args.trace, args.format, args.requests)
    if args.sample:
        # the peer's draw (random order, with replacement past the trace's length) under
        # --peer; otherwise a sample in trace order, arrival times kept
        trace = (trace.draw if args.peer else trace.sample)(args.sample, args.seed)
    if args.peer and (args.skip is not None or args.warm is not None):
        raise ParameterError("--skip" if args.skip is not None else "--warm",
                             "not with --peer: its draw is in random order (with replacement "
                             "past the trace's length), so it has no past")
    if args.skip is not None:
        trace = trace.split(args.skip, "--skip")[1]
    warm = None
    if args.warm is not None:
        if args.predictor_url:
            raise ParameterError("--warm", "warms the in-process learners; a service at "
                                 "--predictor-url knows what it has stored")
        warm, trace = trace.split(args.warm, "--warm")
    config = SimConfig(
        batch=args.batch, load=args.load, step_cost=args.step_cost, horizon=args.horizon,
        refresh_steps=args.refresh_steps, seed=args.seed, record_trajectory=args.out is not None,
    )
    factory: Callable[[str, Trace], Predictor | None] = abtest.make_predictor
    if args.predictor_url:
        factory = abtest.http_predictor_factory(
            args.predictor_url, run_tag=args.run_tag or f"ab{int(time.time())}",
            token=os.environ.get(
                "BALANCEROUTE_API_TOKEN"))
    comparison = abtest.run_comparison(
        trace, args.policies, args.workers, config, Progress(not args.quiet),
        predictor_factory=factory,
        params=_ab_params(args),
        warm=warm,
    )
    skipped = f" after the first {args.skip} skipped" if args.skip else ""
    warmed = f" (after the {len(warm)} that warmed the learners)" if warm is not None else ""
    print(f"trace {args.trace}: {len(trace)} requests{skipped}{warmed}, load {args.load}, "
          f"B={args.batch}, step cost {args.step_cost[0]:g}*max_load + {args.step_cost[1]:g} s")
    print(abtest.format_table(comparison.rows))
    for note in (abtest.uncontended_note(comparison.rows), abtest.window_note(comparison.rows)):
        if note:
            print(note)
    if args.predictor_url:
        print(f"BR-H predictions from {args.predictor_url}")
        refused = {p.config_error for p in getattr(factory, "created", []) if p.config_error}
        if refused:  # the service taught nothing: say so, and fail the command
            print(f"error: the service refused the outcomes: {'; '.join(sorted(refused))}",
                  file=sys.stderr)
            return 2
    for (g, name), events in comparison.switches.items():
        shown = ", ".join(f"step {s.step}: to {s.to.upper()} ({s.reason})" for s in events[:8])
        more = f" (+{len(events) - 8} more)" if len(events) > 8 else ""
        print(f"fallback events G={g} {name}: {shown}{more}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(comparison.rows, indent=1))
        if not args.out:
            print(f"wrote {args.json}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        abtest.write_csv(comparison.rows, args.out / "results.csv")
        title = f"{Path(args.trace).name}, load {args.load}"
        plots = abtest.write_plots(comparison, args.out, title)
        rows = f"{args.json}, " if args.json else ""
        print(f"wrote {rows}{args.out / 'results.csv'} and {', '.join(p.name for p in plots)}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from .tuning import tune

    trace = load_trace(args.trace, args.format, args.requests)
    config = SimConfig(workers=args.workers, batch=args.batch, load=args.load, seed=args.seed)
    result = tune(trace, config, estimator=args.estimator, grid=GRIDS[args.grid],
                  min_gain=args.min_gain,
                  holdout=args.holdout, progress=Progress(not args.quiet),
                  windows=args.windows, confirm=args.confirm)
    reference = next(r for r in result.rows if r["policy"] == "br0")["throughput_tok_s"]
    tuned = len(trace) - int(round(len(trace) * args.holdout))
    print(f"trace {args.trace}: tuned on the first {tuned} of {len(trace)} requests, "
          f"G={args.workers}, B={args.batch}, load {args.load}, "
          f"estimator {','.join(args.estimator)}")
    width = max(34, *(len(row["setting"]) for row in result.rows))
    print(f"{'setting':<{width}} {'tok/s':>9} {'x br0':>7} {'of bound':>8} {'max-min':>9} "
          f"{'guard':>6}")
    for row in result.rows:  # best routing (share of the balanced bound) first
        print(f"{row['setting']:<{width}} {row['throughput_tok_s']:9.1f} "
              f"{row['throughput_tok_s'] / reference:7.4f} {row['bound_share']:8.2%} "
              f"{row['imbalance_maxmin_mean']:9.0f} {row['starvation_guard_admissions']:6d}")
    note = abtest.uncontended_note(result.rows)
    if note:
        print(note)
    if result.confirmation:
        first, pick = result.confirmation
        verdict = ("confirmed" if result.recommendation["policy"] == "brh"
                   else "not confirmed: BR-0")
        print(f"confirmation on the last window of the past ({pick['requests']} requests): "
              f"{pick['setting']} {pick['throughput_tok_s'] / first['throughput_tok_s']:.4f}x "
              f"BR-0's tok/s, {pick['bound_share']:.2%} of bound against "
              f"{first['bound_share']:.2%}, max-min {pick['imbalance_maxmin_mean']:.0f} "
              f"against {first['imbalance_maxmin_mean']:.0f}: {verdict}")
    print("recommendation:", json.dumps(result.recommendation))
    if result.evaluation:
        base = result.evaluation[0]["throughput_tok_s"]
        for row in result.evaluation:
            ratio = row["throughput_tok_s"] / base
            print(f"held out ({row['requests']} later requests): {row['setting']:<{width}} "
                  f"{row['throughput_tok_s']:9.1f} tok/s, x br0 {ratio:.4f}, "
                  f"{row['bound_share']:.2%} of bound, "
                  f"max-min {row['imbalance_maxmin_mean']:.0f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.as_dict(), indent=1))
    return 0


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("balanceroute")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "unknown"


def settings_help() -> str:
    """The settings and their defaults, for ``serve --help``."""
    from .settings import Settings

    lines = ["settings (environment variables; defaults in brackets):"]
    for name, field in Settings.model_fields.items():
        default = field.default
        if default is None:  # unset: a default derived from others, where the field says so
            derived = re.search(r"default:? ([^;)]+)", field.description or "")
            default = derived.group(1).strip() if derived else "unset"
        lines.append(f"  BALANCEROUTE_{name.upper():<30} [{default}]")
    return "\n".join(lines)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from .app import create_app
    from .settings import Settings
    from .store import make_engine, ping

    try:
        settings = Settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "BALANCEROUTE_" + str(first["loc"][0]).upper()
        print(f"error: {field}: {first['msg']}", file=sys.stderr)
        return 1
    if args.database_url:
        settings = settings.model_copy(update={"database_url": args.database_url})
    try:  # fail in one line, before uvicorn starts, on a URL that cannot work
        engine = make_engine(settings.database_url)
        with engine.connect() as connection:
            from sqlalchemy.orm import Session

            ping(session=Session(bind=connection))
        engine.dispose()
    except (ArgumentError, SQLAlchemyError, ModuleNotFoundError, ValueError) as exc:
        url = settings.database_url
        shown = url_without_password(url)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"error: cannot use the database {shown!r}: {reason.replace(url, shown)}",
              file=sys.stderr)
        return 1
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info",
                access_log=args.access_log)
    return 0


def url_without_password(url: str) -> str:
    """A database URL fit to print: its password replaced by ``***`` (as SQLAlchemy renders
    it), also where the URL does not parse."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        shown = make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        shown = re.sub(r"(://[^:/@]*:)[^/]*@", r"\1***@", url)  # to the last @ of the host part
    # a password given as a query parameter (libpq's and psycopg's password=...)
    return re.sub(r"(?i)([?&](?:password|passwd|pwd|secret)=)[^&]*", r"\1***", shown)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "router":
        from router_client.bench import bench_router

        learned, policy = None, "brh-oracle"
        if args.predictor != "oracle" and args.horizon == 0:
            raise ParameterError("--predictor", "applies to BR-H (--horizon > 0); BR-0 "
                                 "rounds use no predictions")
        if args.predictor != "oracle":
            from .estimators.in_process import LearnerPredictor
            from .estimators.registry import estimator_spec

            spec = estimator_spec(args.predictor)
            learned, policy = LearnerPredictor(spec.build()), spec.policy
        result = bench_router(workers=args.workers, rmax=args.rmax, pool=args.pool,
                              batch=args.batch, horizon=args.horizon, rounds=args.rounds,
                              seed=args.seed, predictor=learned, policy=policy)
        print(json.dumps(result, indent=1))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return 0
    from .bench import bench_calibration, bench_predictor, bench_restart

    if args.bench == "calibration":
        result = bench_calibration(scored=args.scored)
    elif args.bench == "restart":
        result = bench_restart(observations=args.observations, replay=args.replay)
    else:
        result = bench_predictor(items=args.items, rounds=args.rounds)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Start the service on 127.0.0.1 (SQLite), replay the bundled trace with BR-H asking it
    for predictions (it learns from the run's completions), print the A/B table."""
    import httpx

    from proxy.fleetbench import DEMO_REQUESTS, demo_stage

    from .livesrv import live_server

    out = Path("demo-out")
    out.mkdir(exist_ok=True)
    database = out / "demo.db"
    for stale in out.glob("demo.db*"):
        stale.unlink()
    trace = str(bundled_trace())
    print("BalanceRoute demo: the prediction service on 127.0.0.1 (SQLite, demo-out/demo.db);")
    print("A/B comparison on the bundled Azure 2023 conversation trace (first 4000 requests,")
    print("G = 8, B = 64, load 1.0); brh-survival queries the live service, which learns from")
    print("the run's completions (the trace has no prompt keys, so ExactMatch would equal it).")
    with live_server(f"sqlite:///{database}") as url:
        print(f"service ready at {url}")
        demo_args = build_parser().parse_args(
            ["ab", "--trace", trace, "--requests", "4000", "--workers", "8", "--load", "1.0",
             "--policies", "rr,jsq,p2c,ltl,br0,brh-survival,brh-oracle",
             "--out", str(out), "--json", str(out / "results.json"), "--predictor-url", url,
             "--run-tag", "demo"]
        )
        code = cmd_ab(demo_args)
        print(f"serving stage: the first {DEMO_REQUESTS} requests through balanceroute proxy "
              "to balanceroute emulate (G = 8, B = 16; tok/s and max-min from the emulator's "
              "step log), load generator in a closed loop; BR-H asks the service above")
        print(demo_stage(trace, url))
        status = httpx.get(url + "/v1/status").json()
        report = httpx.get(url + "/v1/calibration").json()
        (out / "calibration.png").write_bytes(httpx.get(url + "/v1/calibration.png").content)
    print(f"service learned {status['observations']} observations "
          f"(model version {status['model_version']}, drifted: {status['drifted']})")
    for entry in report["estimators"]:
        if entry["scored"]:
            print(f"calibration {entry['estimator']}: {entry['scored']} scored, "
                  f"Brier {entry['brier']:.3f}, ECE {entry['ece']:.3f}, "
                  f"MAE c_hat {entry['mae_c_hat']:.1f}")
    print(f"wrote {out / 'calibration.png'}")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "handler", None) is not None:
            return args.handler(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "ab":
            return cmd_ab(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "tune":
            return cmd_tune(args)
        if args.command == "calibrate":
            return evaluate.run(args)
        return cmd_demo(args)
    except BalanceRouteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
