"""Which policy a workload should run: replay past traffic over BR-0 and a small BR-H grid.

:func:`tune` replays a trace (a file, or the service's own stored observations) through BR-0
and each BR-H candidate of a grid, with the *learned* estimator the routers would get (not
true lengths: a setting is only worth what the predictions it will see make of it; or with
each of several learners, and the pick names its own), and ranks them by their share of the
balanced bound. BR-H is recommended only when a candidate beats BR-0's share by at least
``min_gain`` (default 0.1%) without less throughput or more imbalance (the best-ranked such
candidate): where lookahead cannot help, routers run BR-0, which needs no predictor at all.

Only the past counts. ``holdout`` splits the trace in arrival order: the grid is replayed on
the earlier part only, and the recommendation is then checked against BR-0 on the later part,
which tuning never saw (the figures a user should trust); there the learner starts from what
it learned on the earlier part, as a running service would. The service tunes on the
observations it holds, which are all in the past by construction.

The recommendation is a small dict, the shape of ``/v1/status`` and of every contributions
answer: ``{"policy": "br0"}`` or ``{"policy": "brh", "horizon", "beta", "gamma",
"estimator"}`` (``gamma`` a number or ``"turnover"``);
:class:`~router_client.client.RouterClient` adopts it at a refresh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from router_client.admission import TURNOVER, BalanceRouteParams, gamma_value
from router_client.errors import ParameterError
from router_client.policies import make_policy
from router_client.simulator import SimConfig, bound_share, simulate
from router_client.traces import Trace

from .abtest import make_predictor, uncontended_note, warm_up
from .estimators import estimator_spec
from .settings import Settings

ProgressCallback = Callable[[float, str], None]
MIN_WINDOW = 500  # fewer requests per window than this: tune on one window
MIN_GAIN = 0.001  # the share of the bound a BR-H setting must gain over BR-0 in every window


@dataclass(frozen=True)
class Candidate:
    """One setting of the grid: BR-0, or BR-H with its lookahead parameters."""

    policy: str  # "br0" or "brh"
    horizon: int = 0
    beta: float | None = None
    gamma: float | str | None = None  # a number, TURNOVER, or None: the base's
    # a short pool placed by the learned law's lookahead (True) or as BR-0 places it (False;
    # BalanceRouteParams.learned_short_pool); None: the base's rule
    learned_short_pool: bool | None = None

    @property
    def label(self) -> str:
        if self.policy == "br0":
            return "br0"
        beta = "G" if self.beta is None else f"{self.beta:g}"
        gamma = self.gamma if isinstance(self.gamma, str | None) else f"{self.gamma:g}"
        pool = {None: "", True: " short-pool=lookahead", False: " short-pool=br0"}[
            self.learned_short_pool]
        return f"brh H={self.horizon} beta={beta} gamma={gamma}{pool}"

    def params(self, base: BalanceRouteParams) -> BalanceRouteParams:
        if self.policy == "br0":
            return base.as_br0()
        return replace(base, horizon=self.horizon, beta=self.beta,
                       gamma=base.gamma if self.gamma is None else gamma_value(self.gamma),
                       learned_short_pool=(base.learned_short_pool
                                           if self.learned_short_pool is None
                                           else self.learned_short_pool))


# Small on purpose: every candidate is a full replay. The default grid: BR-0 and the
# discount from the fleet's turnover (H 80 and 200; and with the paper's harsher overflow
# weight 43, which suits uncertain predictions), with short pools placed by the learned law's
# lookahead and as BR-0 places them (one of the two is the base's rule, the same routing as
# the plain point: tune replays it once): on Mooncake conversation at load 1.0 the lookahead
# closes more of the gap to true lengths (0.43-0.51 against 0.24-0.32 over five draws), where
# the law knows little it can lose a little (README, "Below saturation a learned BR-H places as
# BR-0 does"): a workload's own past says which.
TURNOVER_GRID: tuple[Candidate, ...] = (
    Candidate("br0"),
    Candidate("brh", 80, None, TURNOVER),
    Candidate("brh", 80, None, TURNOVER, learned_short_pool=True),
    Candidate("brh", 80, None, TURNOVER, learned_short_pool=False),
    Candidate("brh", 200, None, TURNOVER),
    Candidate("brh", 80, 43.0, TURNOVER),
)
# The grid before 2026-12-07, an option: the turnover points and fixed discounts, H a short
# lookahead, the paper's and a long one, gamma a fast discount (effective horizon about 7
# steps) and a slow one (about 33 steps), and the paper's deployment point (H 80, beta 43,
# gamma 0.86). Judged on later traffic every pick of it below 0.999x BR-0's share of the bound
# was a fixed-discount point (4 of 85 draws, down to 0.9960x: the best of a dozen noisy
# replays picked for its luck); on 45 draws at G = 4, 8 and 16 (35 new, 10 the lead's), the
# turnover grid's picks were never below 0.9998x (mean 1.0012x, the wide grid's 1.0016x with
# two below): README, "Tuning's default grid: the turnover discount only".
WIDE_GRID: tuple[Candidate, ...] = (
    *TURNOVER_GRID,
    *(Candidate("brh", h, None, g) for h in (20, 80, 200) for g in (0.86, 0.97)),
    Candidate("brh", 80, 43.0, 0.86),
)
GRIDS: dict[str, tuple[Candidate, ...]] = {"turnover": TURNOVER_GRID, "wide": WIDE_GRID}
DEFAULT_GRID_NAME = "turnover"
DEFAULT_GRID = GRIDS[DEFAULT_GRID_NAME]


@dataclass
class TuningResult:
    rows: list[dict]  # one per candidate, best first
    recommendation: dict
    evaluation: list[dict] = field(default_factory=list)  # on the held-out window
    # BR-0 and the pick on the last window of the past, which did not rank (``confirm``);
    # empty where no BR-H setting won the ranking windows or nothing was kept back
    confirmation: list[dict] = field(default_factory=list)

    def as_dict(self, rest: bool = False) -> dict:
        """With ``note``: why the rows tie, when the fleet never filled (else None); ``rest``:
        it names the REST job's fields to change, not the command's flags."""
        names = ("`requests`", "`load`") if rest else ("--requests", "--load")
        return {"rows": self.rows, "recommendation": self.recommendation,
                "evaluation": self.evaluation, "confirmation": self.confirmation,
                "note": uncontended_note(self.rows, *names)}


def recommendation_of(candidate: Candidate, estimator: str,
                      base: BalanceRouteParams | None = None) -> dict:
    """The recommendation of ``candidate``; its ``gamma`` is a number or ``"turnover"``."""
    if candidate.policy == "br0":
        return {"policy": "br0"}
    gamma = candidate.gamma
    if gamma is None:
        gamma = (base or BalanceRouteParams()).gamma
    return {"policy": "brh", "horizon": candidate.horizon, "beta": candidate.beta,
            "gamma": TURNOVER if gamma is None else gamma, "estimator": estimator,
            "learned_short_pool": candidate.params(base or BalanceRouteParams())
            .learned_short_pool}


def parse_grid(items: Sequence[dict]) -> tuple[Candidate, ...]:
    """A grid from dicts like ``{"horizon": 20, "beta": 8, "gamma": 0.9}`` (``beta`` absent or
    null: alpha * G; ``learned_short_pool`` absent or null: the base's rule); BR-0 always
    takes part."""
    grid = [Candidate("br0")]
    for number, item in enumerate(items):
        try:
            horizon = int(item["horizon"])
            gamma = item["gamma"] if item["gamma"] == TURNOVER else float(item["gamma"])
            beta = None if item.get("beta") is None else float(item["beta"])
            pool = item.get("learned_short_pool")
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ParameterError(f"grid[{number}]", "needs a numeric horizon, gamma a number "
                                 "or 'turnover' (and beta, or null for alpha * G)") from None
        BalanceRouteParams(horizon=horizon, beta=beta, gamma=gamma_value(gamma))  # ranges
        if horizon < 1:
            raise ParameterError(f"grid[{number}].horizon", "must be >= 1 (BR-0 is always in)")
        if pool is not None and not isinstance(pool, bool):
            raise ParameterError(f"grid[{number}].learned_short_pool",
                                 "must be true, false or null")
        grid.append(Candidate("brh", horizon, beta, gamma, pool))
    return tuple(grid)


def points_of(grid: Sequence[Candidate]) -> list[dict]:
    """``grid``'s BR-H points as :func:`parse_grid` reads them (BR-0 always takes part)."""
    return [{"horizon": c.horizon, "beta": c.beta, "gamma": c.gamma,
             "learned_short_pool": c.learned_short_pool} for c in grid if c.policy == "brh"]


def replay(trace: Trace, policy_name: str, params: BalanceRouteParams, config: SimConfig,
           settings: Settings | None = None, progress: Callable[[float], None] | None = None,
           warm: Trace | None = None) -> dict:
    """The result row of one replay of ``trace`` under ``policy_name`` (``br0``,
    ``brh-<estimator>``, ``brh-oracle``) with ``params``, its horizon the simulator's;
    ``warm``: past requests the learner knows before the replay starts (a running service's
    state; true lengths and BR-0 ignore it)."""
    policy = make_policy(policy_name, seed=config.seed, params=params)
    run_config = replace(config, horizon=max(params.horizon, 1))
    predictor = make_predictor(policy_name, trace, settings)
    warm_up(predictor, warm)
    return simulate(trace, policy, run_config, predictor, progress).row


def _label(candidate: Candidate, learner: str | None, named: bool) -> str:
    """``candidate``'s label, with its learner where tuning ranks several (``named``)."""
    if named and candidate.policy != "br0":
        return f"{candidate.label} estimator={learner}"
    return candidate.label


def _replay(trace: Trace, candidate: Candidate, config: SimConfig, base: BalanceRouteParams,
            estimator: str | None, settings: Settings | None, progress,
            warm: Trace | None = None, named: bool = False) -> dict:
    """One replay of ``candidate`` (BR-H with the learner ``estimator``; BR-0 needs none, and
    its row names none); ``warm`` as in :func:`replay`; ``named`` as in :func:`_label`."""
    params = candidate.params(base)
    learner = None if candidate.policy == "br0" else estimator
    policy_name = "br0" if learner is None else estimator_spec(learner).policy
    row = replay(trace, policy_name, params, config, settings, progress, warm)
    # the rule replayed, where the candidate left it to the base
    return {"setting": _label(candidate, learner, named), **asdict(candidate),
            "learned_short_pool": params.learned_short_pool, "estimator": learner, **row,
            "bound_share": bound_share(row)}


def _choose(ranked: list[dict], min_gain: float) -> Candidate:
    """The candidate of :func:`_chosen_row`'s row, else BR-0."""
    return _pick_of(_chosen_row(ranked, min_gain))


def _pick_of(row: dict | None) -> Candidate:
    return Candidate("br0") if row is None else candidate_of(row)


def _chosen_row(ranked: list[dict], min_gain: float) -> dict | None:
    """The row of the best-ranked BR-H setting that, in every window of the past it was replayed on,
    routes better than BR-0 (its share of its own balanced bound higher by ``min_gain``) with
    no less throughput and no more imbalance (with its learner, where tuning ranked several);
    else None: BR-0.

    Throughput over the routing window alone can be won by deferring large requests past it:
    the window then holds less work, its steps are cheaper, and the pool keeps the heavy
    requests (the imbalance often rises): on Mooncake conversation a setting with 1.55x BR-0's
    imbalance ranked first by +1.3% and then lost 0.7% on the later half. The share of the
    bound does not move with the work the window held, so that kind of gain does not count.
    And one window's gain can be its noise: the same trace's next pick, balanced on the whole
    tuning half, lost 0.7% on the later half too."""
    br0_row = next(r for r in ranked if r["policy"] == "br0")
    reference = br0_row.get("windows", [br0_row])
    for row in ranked:
        if row["policy"] == "br0":
            continue
        if all(_beats(w, b, min_gain)
               for w, b in zip(row.get("windows", [row]), reference, strict=True)):
            return row
    return None


def choose(rows: Sequence[dict], min_gain: float = MIN_GAIN) -> Candidate:
    """What tuning recommends from its rows, given in grid order (rows that tie on every figure
    keep it, as in :func:`tune`): the best-ranked BR-H setting that beats BR-0 in every window
    (:func:`_choose`), else BR-0. A part of a grid's rows gives the pick tuning would have made
    over that part alone: each candidate's replays do not depend on the others."""
    return _choose(_rank(list(rows)), min_gain)


def chosen_row(rows: Sequence[dict], min_gain: float = MIN_GAIN) -> dict | None:
    """The row :func:`choose` picks its candidate from (with its learner), else None: BR-0."""
    return _chosen_row(_rank(list(rows)), min_gain)


def _beats(row: dict, br0: dict, min_gain: float) -> bool:
    """Whether ``row`` routes better than BR-0's ``br0`` on the same requests: a share of the
    balanced bound higher by ``min_gain``, no less throughput, no more imbalance."""
    return (bound_share(row) >= (1.0 + min_gain) * bound_share(br0)
            and row["throughput_tok_s"] >= br0["throughput_tok_s"]
            and row["imbalance_maxmin_mean"] <= br0["imbalance_maxmin_mean"])


def candidate_of(row: dict) -> Candidate:
    """The candidate a ranked row, or a recommendation (the same keys), stands for."""
    if row["policy"] == "br0":
        return Candidate("br0")
    return Candidate("brh", row["horizon"], row["beta"], row["gamma"],
                     row.get("learned_short_pool"))


def _windows(past: Trace, count: int) -> list[tuple[Trace, Trace | None]]:
    """``past`` in ``count`` consecutive windows, each with the requests before it (what the
    learner knows when the window starts); one window when there are too few requests."""
    if count <= 1 or len(past) < count * MIN_WINDOW:
        return [(past, None)]
    edges = np.linspace(0, len(past), count + 1).astype(int)
    return [(past.take(np.arange(a, b)), past.head(int(a)) if a else None)
            for a, b in zip(edges[:-1], edges[1:], strict=True)]


def _combine(rows: list[dict]) -> dict:
    """One candidate's row over several windows: the last window's row with the mean
    throughput, bound, share of the bound and imbalance, the summed request count, and each
    window's figures."""
    if len(rows) == 1:
        return rows[0]
    keys = ("throughput_tok_s", "balanced_bound_tok_s", "bound_share",
            "imbalance_maxmin_mean", "requests")
    mean = {key: float(np.mean([r[key] for r in rows])) for key in keys[:-1]}
    return {**rows[-1], **mean,
            "requests": sum(r["requests"] for r in rows),
            "contended_steps": sum(r.get("contended_steps", 0) for r in rows),
            "windows": [{k: r[k] for k in keys} for r in rows]}


def _rank(rows: list[dict]) -> list[dict]:
    """Best routing first: the share of the balanced bound (the mean over the windows), then
    throughput, then the lower imbalance."""
    return sorted(rows, key=lambda r: (-r["bound_share"], -r["throughput_tok_s"],
                                       r["imbalance_maxmin_mean"]))


def learners_of(estimator: str | Sequence[str]) -> tuple[str, ...]:
    """The learners tuning replays BR-H with: one name, or several (each once, in order)."""
    names = (estimator,) if isinstance(estimator, str) else tuple(dict.fromkeys(estimator))
    if not names:
        raise ParameterError("estimator", "names no estimator")
    for name in names:
        estimator_spec(name)  # a clear error for an unknown name
    return names


def tune(trace: Trace, config: SimConfig, estimator: str | Sequence[str] = "exact_match",
         grid: Sequence[Candidate] = DEFAULT_GRID, min_gain: float = MIN_GAIN,
         holdout: float = 0.0, base: BalanceRouteParams | None = None,
         settings: Settings | None = None,
         progress: ProgressCallback | None = None, windows: int = 2,
         confirm: bool = False) -> TuningResult:
    """Rank ``grid`` on ``trace`` (its earlier ``1 - holdout`` share when ``holdout`` > 0),
    replayed in ``windows`` consecutive windows (each with the learner warmed on the ones
    before it); a BR-H setting is recommended only if it wins in every window it was ranked
    on. ``confirm`` (with two windows or more; an option, measured 2026-12-07 and not the
    default): the grid is ranked on every window but the last, and the pick must win again on
    the last, which played no part in picking it (BR-0 and the pick replayed there:
    ``TuningResult.confirmation``); else BR-0. It answers the best of a dozen noisy replays
    being picked partly for its luck, but ranks on less of the past: over 25 draws of later
    traffic it lost as often as the default rule by the share, and gained less (README,
    "Tuning judged on later traffic"). ``estimator``: the learner routers would get, or
    several (:func:`learners_of`): every BR-H setting is then replayed with each, and the
    recommendation names the learner of the row it picked (BR-0's row names none)."""
    if not 0.0 <= holdout < 1.0:
        raise ParameterError("holdout", "must be in [0, 1)")
    learners = learners_of(estimator)
    base = base or BalanceRouteParams()
    split = len(trace) - int(round(len(trace) * holdout))
    if split < 1:
        raise ParameterError("holdout", "leaves no request to tune on")
    if holdout > 0 and split >= len(trace):
        raise ParameterError("holdout", f"{holdout:g} of {len(trace)} requests leaves none "
                             "to replay after tuning")
    past = trace.head(split)
    listed = list(grid) if any(c.policy == "br0" for c in grid) else [Candidate("br0"), *grid]
    # one replay per distinct routing: a setting that states what the base already does
    # (learned_short_pool as the base's) is the same candidate
    distinct: dict[tuple[BalanceRouteParams, str | None], tuple[Candidate, str | None]] = {}
    for candidate in listed:
        for learner in (None,) if candidate.policy == "br0" else learners:
            distinct.setdefault((candidate.params(base), learner), (candidate, learner))
    candidates = list(distinct.values())
    parts = _windows(past, windows)
    last = parts[-1] if confirm and len(parts) >= 2 else None
    ranking = parts[:-1] if last is not None else parts
    steps = len(candidates) * len(ranking) + (2 if last is not None else 0)
    named = len(learners) > 1  # labels name the learner where several take part
    rows = []
    for number, (candidate, learner) in enumerate(candidates):
        per_window = []
        for part, (window, warm) in enumerate(ranking):
            def report(fraction: float, done: int = number * len(ranking) + part,
                       label: str = _label(candidate, learner, named)) -> None:
                if progress is not None:
                    progress((done + fraction) / steps, label)

            per_window.append(_replay(window, candidate, config, base, learner, settings,
                                      report, warm=warm, named=named))
        rows.append(_combine(per_window))
    ranked = _rank(rows)
    row = _chosen_row(ranked, min_gain)
    chosen = _pick_of(row)
    learner = learners[0] if row is None else row["estimator"]
    confirmation: list[dict] = []
    if last is not None and chosen.policy != "br0":
        window, warm = last
        for number, candidate in enumerate((Candidate("br0"), chosen)):
            def report_last(fraction: float, done: int = steps - 2 + number,
                            label: str = f"confirming {_label(candidate, learner, named)}"
                            ) -> None:
                if progress is not None:
                    progress((done + fraction) / steps, label)

            confirmation.append(_replay(window, candidate, config, base, learner, settings,
                                        report_last, warm=warm, named=named))
        if not _beats(confirmation[1], confirmation[0], min_gain):
            chosen = Candidate("br0")
    result = TuningResult(ranked, recommendation_of(chosen, learner, base),
                          confirmation=confirmation)
    if holdout > 0:
        later = trace.split(split, "holdout")[1]  # replays shift times to 0
        result.evaluation = [
            _replay(later, c, config, base, learner, settings, None, warm=past, named=named)
            for c in dict.fromkeys([Candidate("br0"), chosen])]
    return result
