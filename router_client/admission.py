"""BalanceRoute's two-stage admission: BR-0 and BR-H (arXiv 2605.06113).

One scheduling round, given the fleet view and the waiting pool (in arrival order):

Stage 1, while the free slots ``S_tot`` exceed ``s_greedy``, admits one request at a time:
  - ``stage1="paper"``: the worker with the most free slots (ties: lower load, then lower
    index) takes the single waiting request with the highest F.
  - ``stage1="best-pair"``: the (worker, request) pair with the highest F over all workers with
    free slots (ties: lower load, lower index, earlier request).
  - ``stage1="lpt"``: while the pool is short (no more waiting requests than free slots:
    every request is admitted this round, only *where* matters, and "most free slots" would
    act like JSQ), the largest waiting request first (ties: the earliest), onto the open
    worker with the lowest ``load + lpt_count_weight * active requests`` (ties: lower index):
    longest-processing-time-first list scheduling; the paper's rule otherwise (saturation:
    *which* request fills a slot is what pays). The pool is short in that sense for the whole
    round, so Stage 2 is not needed then. BR-H takes the largest first too, onto the open
    worker where its F (which looks ahead) is highest (ties: lower load, lower index); for
    BR-0 that is the least-loaded one.
  - ``stage1="auto-pair"``: ``best-pair`` while the pool is short, the paper's rule otherwise.
  - ``stage1="auto"`` (default): :data:`AUTO_SHORT_POOL` while the pool is short, the paper's
    rule otherwise. BR-H places a short pool by ``short_pool`` with true lengths (default
    ``lpt-fit``: the largest first, onto BR-0's worker if it fits there under the current
    maximum, else onto the open worker where its F is highest; ``lpt`` and ``best-pair``
    were the rules before, see the README), and as BR-0 does with a learned predictor's
    law unless ``learned_short_pool``.
Stage 2, when ``S_tot <= s_greedy``: workers with free slots are taken in order of free slots,
then margin (``stage2_order="slots"``, the paper's, BR-H's default) or by the widest margin
alone (``"margin"``, BR-0's default since 2026-12-05); each takes the subset of the first
``r_max`` waiting requests, of size at most its free slots, that maximizes F
(:mod:`router_client.subset`; ``stage2_fill=False``, the paper's, BR-H's default), or
(``stage2_fill=True``, BF-IO's subset rule, BR-0's default since 2026-12-05) the most that fit
together under the current maximum (then the largest total; BR-H: the highest F among them),
the F-best subset only where none fits.
Starvation guard: if the best F is not positive, the single best request is admitted anyway
(``guard="always"``, the paper's, BR-0's default); under ``guard="idle"`` (BR-H's default) the
worker waits for a later round where no request would lower the imbalance now even counting
its share of the step's fixed cost (:func:`router_client.fastpath.overflow_pays`); a worker with
no request never waits.

BR-H scores a candidate by the work it really adds (``candidate_life``, default): ``s + h`` at
step h while its own ``c_hat`` says it runs, 0 after (:func:`router_client.fscore.candidate_rows`);
Stage 2 then enumerates the subsets of the ``r_max`` candidates (at most ``2^r_max - 1``), or
grows one greedily when there are too many. ``candidate_life=False`` is the paper's constant
``D = sum of s_i`` with the reachable-sum bitsets.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache, partial
from itertools import combinations, islice
from math import comb
from numbers import Integral
from operator import attrgetter
from time import perf_counter
from typing import Literal, get_args

import numpy as np

from . import fastpath
from .errors import ContractError, ParameterError
from .fleet import DEFAULT_STEP_COST, Assignment, FleetView, WaitingRequest
from .fscore import MarginTable, candidate_rows, discounts
from .projection import (
    END_POINTS,
    END_SHAPE,
    EndShape,
    end_law,
    end_window,
    expected_ends,
    mixture_moments,
    projected_loads,
)
from .subset import SubsetChoice, best_subset

Stage1Rule = Literal["auto", "paper", "best-pair", "lpt", "auto-pair"]
STAGE1_RULES: tuple[str, ...] = get_args(Stage1Rule)
ShortPoolRule = Literal["lpt-fit", "lpt", "lpt-load", "best-pair"]
SHORT_POOL_RULES: tuple[str, ...] = get_args(ShortPoolRule)
Stage2Order = Literal["slots", "margin"]
STAGE2_ORDERS: tuple[str, ...] = get_args(Stage2Order)
GuardRule = Literal["always", "idle"]
GUARD_RULES: tuple[str, ...] = get_args(GuardRule)
ZeroGammaRules = Literal["br0", "brh"]
ShortPoolGrowth = Literal["requests", "slots", "filling", "arrivals"]
SHORT_POOL_GROWTHS: tuple[str, ...] = get_args(ShortPoolGrowth)
END_SHAPES: tuple[str, ...] = get_args(EndShape)
ZERO_GAMMA_RULES: tuple[str, ...] = get_args(ZeroGammaRules)
# The decode step's fixed cost in KV tokens, b / a of T = a max L + b, where neither the
# parameters nor the fleet view give it: the simulator's default step cost's (0.010 s over
# 1.5e-7 s per token, 66,667 tokens).
DEFAULT_STEP_OVERHEAD = DEFAULT_STEP_COST[1] / DEFAULT_STEP_COST[0]
# How many rounds in a row the guard idle may leave one worker's free slots empty (None: no
# bound); see ``BalanceRouteParams.patience``.
DEFAULT_PATIENCE: int | None = None
AUTO_SHORT_POOL: Literal["lpt", "best-pair"] = "lpt"  # BR-0's short-pool rule in auto (README)
# BR-H's Stage-1 rule on a short pool under auto, by its ``short_pool`` setting
_SHORT_POOL_STAGE1: dict[str, Literal["best-pair", "lpt", "lpt-f", "lpt-fit"]] = {
    "lpt-fit": "lpt-fit", "lpt": "lpt-f", "lpt-load": "lpt", "best-pair": "best-pair"}
_LPT_PLACEMENT: dict[str, Literal["load", "score", "fit"]] = {
    "lpt": "load", "lpt-f": "score", "lpt-fit": "fit"}  # internal Stage-1 rule -> placement
# The largest magnitude BalanceRouteParams.with_settings reads (the REST API's bound on numbers)
SETTING_LIMIT = 1_000_000.0
MAX_ENUMERATED_SUBSETS = 4096  # Stage 2 with candidate rows: enumerate up to this many subsets
_PROMPT_TOKENS = attrgetter("prompt_tokens")
BR0_WINDOW_PER_WORKER = 4  # BR-0's default Stage-2 window: 4G requests ...
BR0_WINDOW_CAP = 64  # ... but never more than this (router time at large G)
FAST_PATH = True  # router_client.fastpath where it is exact (False: the reference throughout)


@dataclass(frozen=True)
class BalanceRouteParams:
    """Parameters of BR-H; BR-0 is ``horizon=0`` (then ``alpha=1`` and ``beta=G`` are forced).

    Defaults: the paper's ``H=80, gamma=0.86``, ``R_max=4``, ``S_greedy=7`` and 1024 Stage-1
    candidates from its predecessor simulator; ``beta = alpha * G`` (each horizon step scored on
    BR-0's scale) and candidate rows (a candidate adds ``s + h`` while its own ``c_hat`` says it
    runs). The paper's form (``beta=43``, constant ``D``) is :meth:`paper`; with true lengths it
    loses throughput to BR-0 on short-output traffic in our simulator.

    Attributes:
        horizon: ``H``, lookahead steps; 0 makes the policy BR-0.
        alpha: weight of the fill benefit.
        beta: weight of the overflow penalty; ``None`` means ``alpha * G`` (for BR-0: ``G``).
        learned_beta_scale: with a learned law (``FleetView.active_p_fin`` and ``active_mu_rem``
            given) and ``beta`` unset, the overflow weight is this many times ``alpha * G``
            (1: ``alpha * G`` as with true lengths; true lengths are never scaled). A round of a
            one-step horizon is BR-0's only where the weight is ``alpha * G``.
        gamma: per-step discount in (0, 1]; ``None``: from the fleet's turnover each round
            (:func:`turnover_gamma`).
        turnover_scale: with ``gamma=None``, the effective horizon ``1 / (1 - gamma)`` is this
            many times the steps between two admissions to one worker.
        turnover_arrivals: with ``gamma=None`` and a measured ``FleetView.arrival_rate``,
            admissions come at least as fast as the arrivals the free slots can take (a fleet
            filling up), not only as fast as completions free slots; False: completions alone
            (the rule before 2026-12-01), see :func:`turnover_gamma`.
        r_max: Stage-2 candidates per worker (the first ``r_max`` of the pool); ``None``
            (default): the first ``min(4G, 64)`` (the peer's whole 4G window, capped for
            the router's time budget; measured, see the README), for BR-H too: with the
            paper's 4 against BR-0's wider window, BR-H with true lengths lost to BR-0
            (Mooncake at backlog, G = 8: 0.987x throughput; with the same window 1.011x).
        s_greedy: Stage 1 runs while the fleet's free slots exceed this.
        stage1_candidates: Stage 1 looks at the first this-many waiting requests.
        stage1: Stage-1 rule, see the module docstring.
        lpt_count_weight: the ``lpt`` rule's worker key is ``load + this * active requests``
            (0: the load alone).
        candidate_life: score a candidate by its projected added work ``(s + h) * alive_h``
            (its own ``c_hat``, from ``FleetView.pool_c_hat``; unknown: alive over the window)
            instead of the paper's constant ``D = s`` over the whole window.
        refill: when the pool holds more requests than there are free slots (saturation),
            project every slot emptied within the window (an active request's, or a
            candidate's own) as taken at once by a request of the pool's mean prompt, growing
            from there, instead of left empty. Off by default: with true lengths it helps at
            long horizons (H 200, gamma 0.97) and hurts at the default one (see the README).
        end_points: with a predictor's ``p_fin`` and ``mu_rem``, the end time of a request
            that ends within the window is spread over this many points of its law with mean
            ``mu_rem`` (:func:`router_client.projection.mixture_loads`); 0: all at
            ``mu_rem`` (the point law, the previous default).
        end_shape: that law's shape and how an answer ages between refreshes:
            ``"exponential"`` (default since 2026-12-06), a constant hazard truncated to the
            window, and the answer conditioned on the request still running
            (:func:`router_client.projection.aged_law`); ``"uniform"`` (before), uniform with
            mean ``mu_rem``, and ``mu_rem`` moved closer by the steps elapsed, ``p_fin``
            kept. The oracle's true lengths have no law and are not affected.
        expected_overflow: with a predictor's ``p_fin`` and ``mu_rem``, score the overflow
            penalty as its expectation under their law (each active request running at step h
            with its probability, independently; a worker's load about normal with the
            variance that gives: :func:`router_client.projection.mixture_moments`,
            :func:`router_client.fscore.expected_overflow`) instead of the overflow of the
            expected load. Known loads (step 0, true lengths) are scored as before.
        marginal_overflow: with ``expected_overflow``, the penalty is the rise of the
            expected overflow the admission causes (the worker's expected overflow without
            it subtracted), so that F of a learned round is minus the expected rise of I(k)
            as BR-0's F is of the known one; False (default): the expected overflow itself,
            which charges a worker near the envelope for its own spread whatever it takes
            (F <= 0 more often: more rounds go to the starvation guard). On one worker every
            subset shifts alike, so Stage 2's choice moves only where F's sign does (it
            admits instead of guarding); where F is compared across workers (a short pool
            placed by F with ``learned_short_pool``, ``best-pair``, ``br0_check``'s sum) the
            shift differs by worker and the choice can move too. Without
            ``expected_overflow`` there is no spread and it does nothing.
        learned_short_pool: under ``stage1="auto"``, place a short pool by BR-H's lookahead
            (the ``short_pool`` rule) also with a learned predictor's law; False (default):
            with a learned law (loads with a spread), a short pool is placed as BR-0 places it
            (lpt onto the least-loaded open worker) whatever ``short_pool`` says, with true
            lengths by ``short_pool``. Every request of a
            short pool is admitted this round; only where is decided, and learned lookahead
            placed worse than BR-0 below saturation (see the README).
        short_pool: under ``stage1="auto"`` (other Stage-1 rules ignore it), how BR-H
            places a short pool (true lengths, or a learned law with
            ``learned_short_pool``), the largest waiting request first (ties: the earliest)
            in every rule but ``best-pair``: ``lpt-fit`` (default, since 2026-12-01) onto
            BR-0's ``lpt`` worker (the least-loaded open one at the default
            ``lpt_count_weight`` 0) if it fits there under the current
            maximum, else onto the open worker where its F is highest: the lookahead moves
            only a request that raises the maximum now wherever BR-0 puts it (the departures
            it sees are mostly refilled before they matter; see the README); ``lpt`` onto
            the open worker where its F is highest (ties: lower load, lower index), the
            rule before; ``lpt-load`` the largest
            first onto the least-loaded open worker (BR-0's placement); ``best-pair`` the
            (worker, request) pair with the highest F, the rule before 2026-12-01, which
            places the requests that fit first and the large ones last (shortest-first list
            scheduling: it lost to BR-0 below saturation, see the README).
        stage2_order: the order in which Stage 2 takes workers with free slots: ``slots``
            (the paper's) the most free slots first, then the widest margin, then index;
            ``margin`` the widest margin first (the least-loaded worker chooses first).
            ``None`` (default): ``margin`` for BR-0 (since 2026-12-05, with ``stage2_fill``),
            ``slots`` for BR-H. Rounds at ``gamma`` 0: see ``zero_gamma_rules``.
        stage2_fill: Stage 2 takes, for a worker, the most requests whose total fits under its
            margin now (the largest such total; BR-H: the highest F among them) and the F-best
            subset only where no request fits (BF-IO's subset rule). ``False`` (the paper's):
            the F-best subset always, which may take one large request that overflows over a
            small one that fits, or leave a free slot empty. ``None`` (default): ``True`` for
            BR-0 (since 2026-12-05: its share of the balanced bound +0.19% and 0.84x the
            imbalance over issue 10's saturated cells), ``False`` for BR-H (the rule gains it
            little and costs it at Azure G = 4; see the README, "BF-IO's subset rule").
            Rounds at ``gamma`` 0: see ``zero_gamma_rules``.
        stage2_revisit: a worker that took a Stage-2 subset scoring F > 0 and has slots
            left is taken again after every worker's first visit (later admissions may have
            raised the maximum, giving it room again), revisits in the same order by their
            margins under the round's first maximum; a revisit admits only a subset scoring
            F > 0 (no guard), so the round without revisits is routed first and only added
            to. False (default): each worker is taken once (the paper's and BF-IO's).
            Measured in the peer's setting, see the README.
        guard: the starvation guard in Stage 2, where a worker's best subset scores F <= 0
            (every candidate raises the imbalance more than it fills): ``always`` (the
            paper's) admits the single best request anyway; ``idle`` leaves the worker's
            slots empty this round where, in addition, no candidate would lower the
            imbalance now (BR-0's F at step 0 not positive for any; so BR-H, whose lookahead
            may object where BR-0 would not, then admits its best request as under
            ``always``). The "now" score adds the admission's share of the step's fixed
            cost, ``G step_overhead / N`` (:func:`router_client.fastpath.overflow_pays`): where
            a step costs mostly its fixed part (small batches), a filled slot is worth an
            overflow and the worker does not wait. A worker with no request never waits
            (liveness: otherwise a saturated fleet whose pool holds only requests that
            overflow could stall; found by hypothesis). ``idle`` acts only with G >= 2 and
            more than ``s_greedy`` slots in the fleet (where Stage 1 runs); elsewhere it is
            ``always``; BF-IO's simulator likewise forces a request only after three
            failed tries on one worker. ``None`` (default): ``idle`` for BR-H (since
            2026-12-02: with true lengths it raises BR-H's gain over BR-0 and clears the
            imbalance flag at Mooncake G = 4), ``always`` for BR-0 (the paper's; ``idle``
            is a measured option there, see the README). Rounds at ``gamma`` 0: see
            ``zero_gamma_rules``.
        fit_horizon: with ``short_pool="lpt-fit"``, a round whose effective horizon
            ``1 / (1 - gamma)`` reaches this many steps places its short pool by F, as
            ``lpt`` (None, default: never; measured, not adopted, see the README).
        step_overhead: the decode step's fixed cost in KV tokens, ``b / a`` for a step
            costing ``a * max load + b`` seconds, which the guard ``idle`` weighs. ``None``
            (default): the fleet view's (the simulator passes its step cost's), else
            :data:`DEFAULT_STEP_OVERHEAD` (the simulator's default step cost, 66,667
            tokens). 0 waits wherever BR-0's F now is not positive.
        patience: under the guard ``idle``, a worker that has left its free slots empty in
            this many rounds in a row takes its best request in the next one, as under
            ``always`` (a bound on how long one worker waits, whatever ``step_overhead``
            says; the count is the policy's, :class:`router_client.policies.BalanceRoutePolicy`,
            passed to :func:`route_round` as ``waited``). ``None``: no bound; 0: never waits.
        zero_gamma_rules: a BR-H round whose discount comes out 0 (the next admission to a
            worker within a step: nothing the lookahead sees outlives the round) is scored as
            BR-0 scores it; ``"br0"`` (default since 2026-12-05) routes it with BR-0's guard
            and Stage 2 as well (unless BR-H's parameters set them), so it is exactly BR-0's
            round; ``"brh"`` keeps BR-H's guard and Stage 2 (the rule before). Against
            today's BR-0 on synth:long families with short outputs it lifted BR-H's mean
            throughput from 0.9973x to 0.9986x and changed issue 10's matrix by less than
            0.03% (see the README, "BR-H's rounds at gamma 0").
        myopic_horizon: a BR-H round whose effective horizon ``1 / (1 - gamma)`` (the
            discount from the turnover) is below this many steps is treated as a round at
            gamma 0 (``zero_gamma_rules``: BR-0's round, its score, guard and Stage 2): the
            next admission to a worker comes within a step, rounded, and the lookahead's
            weight past step 0 is at most ``gamma`` < 1/3. 1.5 (default since 2026-12-06)
            rounds the effective horizon to whole steps; 1 keeps BR-H's rules in every round
            whose discount is above 0 (the rule before), where a discount of 0.05-0.2 made
            BR-H's guard and Stage 2 diverge from BR-0's in a round or two of a run and
            raised its imbalance on outputs of 20-30 tokens (see the README, "Rounds of a
            one-step horizon"). A fixed ``gamma`` is never treated so.
        own_wait_horizon: under the guard ``idle``, a round whose effective horizon
            ``1 / (1 - gamma)`` reaches this many steps leaves a worker's slots empty wherever
            BR-H's own F of every subset is <= 0, even where BR-0's view now says an overflow
            pays (the lookahead's objection stands: what it sees ending is not refilled at
            once); an empty worker never waits, and ``patience`` still bounds the waits.
            12 (default since 2026-12-06): synth:long's rounds (effective horizons near 15
            steps) wait, Mooncake conversation's (near 5) mostly do not; it met the synth:long
            0.8x target at G = 4 over six draws of 10,000 (0.742x against 0.840x) and left
            Mooncake as it was. 8 gained more on synth:long but raised BR-H's imbalance on
            Mooncake; ``None``: never, the rule before (see the README, "A long view that
            waits on its own F"). Only in rounds without a learned law (true lengths, or
            ``c_hat`` alone), unless ``own_wait_learned``.
        own_wait_learned: ``own_wait_horizon`` applies to rounds with a learned law too (the
            rule from 2026-12-06 to 2026-12-07). False (default): only where the active
            requests come without a law (``p_fin``, ``mu_rem``); with a learned law F <= 0
            comes mostly from the expected overflow of uncertain loads, and leaving slots
            empty on it cost learned BR-H up to 1.4% of BR-0's throughput on synth:long at
            load 1.5, G = 4 (see the README).
        short_pool_growth: how ``lpt-fit`` and ``lpt`` (``short_pool``) project the workers'
            growth when they score a short pool's request by F from point lengths
            (``c_hat`` without a law; true lengths in ``brh-oracle``):
            ``"requests"`` (the form before 2026-12-06) by the requests each worker holds now;
            ``"slots"`` by its slots, each free slot growing as an occupied one (the router
            fills it: while a fleet fills, later arrivals even the counts out over a long
            request's life, so a worker is not charged for holding more requests now), the
            departures the lookahead sees kept; ``"filling"`` (default since 2026-12-06):
            ``"slots"`` while more arrivals are expected within the window (at the measured
            ``FleetView.arrival_rate``) than completions, a fleet filling up or a full one at
            load 1.0 and above (whose freed slots are refilled soon), ``"requests"``
            otherwise and without a measured rate; ``"arrivals"``: each free slot grows as
            arrivals at the measured rate are expected to fill the free slots in proportion
            (:func:`arrival_fill_growth`), by requests without a rate (within the window few
            slots fill, so it places nearly as ``"requests"``). On the synth:long families
            ``"filling"`` cleared the three cells below 0.999x by share of the bound and five
            of eleven by ``tok/s``; on issue 10's matrix (60 cells, two replicates of 4,000)
            mean 1.0079x against 1.0072x, lowest 1.0002x against 0.9997x (see the README,
            "A filling fleet's short pool").
        br0_check: a BR-H round is checked against BR-0's round from the same state (BR-0's
            score, guard and Stage 2): where BR-H's own measure of its round (the summed F of
            its admissions on its margin table, the discounted fill less beta times the
            envelope's discounted rise) is not above that of BR-0's round's admissions by
            more than this many candidates' worth of discounted fill, the round is BR-0's.
            0: BR-H departs from BR-0 only where it expects to do strictly better by its own
            reckoning. ``None`` (default): no check. Costs a BR-0 round and two evaluations
            per BR-H round (see the README, "A round checked against BR-0's").
    """

    horizon: int = 80
    alpha: float = 1.0
    beta: float | None = None
    learned_beta_scale: float = 1.0
    gamma: float | None = None
    turnover_scale: float = 1.0
    turnover_arrivals: bool = True
    r_max: int | None = None
    s_greedy: int = 7
    stage1_candidates: int = 1024
    stage1: Stage1Rule = "auto"
    lpt_count_weight: float = 0.0
    candidate_life: bool = True
    refill: bool = False
    end_points: int = END_POINTS
    end_shape: EndShape = END_SHAPE
    expected_overflow: bool = True
    marginal_overflow: bool = False
    learned_short_pool: bool = False
    short_pool: ShortPoolRule = "lpt-fit"
    stage2_order: Stage2Order | None = None
    stage2_fill: bool | None = None
    stage2_revisit: bool = False
    fit_horizon: float | None = None
    guard: GuardRule | None = None
    step_overhead: float | None = None
    patience: int | None = DEFAULT_PATIENCE
    zero_gamma_rules: ZeroGammaRules = "br0"
    myopic_horizon: float = 1.5
    own_wait_horizon: float | None = 12.0
    own_wait_learned: bool = False
    short_pool_growth: ShortPoolGrowth = "filling"
    br0_check: float | None = None

    def __post_init__(self) -> None:
        for name, unset_ok in _SWITCHES:  # a switch is True or False ("yes" is neither)
            value = getattr(self, name)
            if not (isinstance(value, bool) or (value is None and unset_ok)):
                raise ParameterError(name, f"must be true or false, not {value!r}")
        if self.horizon < 0:
            raise ParameterError("horizon", "must be >= 0")
        if self.horizon == 0 and self.alpha != 1.0:
            raise ParameterError("alpha", "BR-0 (horizon 0) forces alpha = 1")
        if not 0 < self.alpha < math.inf:
            raise ParameterError("alpha", "must be a finite number > 0")
        if self.beta is not None and not 0 <= self.beta < math.inf:
            raise ParameterError("beta", "must be a finite number >= 0 (or None: alpha * G)")
        if self.gamma is not None and not 0.0 < self.gamma <= 1.0:
            raise ParameterError("gamma", "must be in (0, 1] (or None: from the turnover)")
        if not self.turnover_scale > 0:
            raise ParameterError("turnover_scale", "must be > 0")
        if self.r_max is not None and self.r_max < 1:
            raise ParameterError("r_max", "must be >= 1")
        if self.s_greedy < 0:
            raise ParameterError("s_greedy", "must be >= 0")
        if self.end_points < 0:
            raise ParameterError("end_points", "must be >= 0 (0: the point law)")
        if self.end_shape not in END_SHAPES:
            raise ParameterError("end_shape", f"must be one of {', '.join(END_SHAPES)}")
        if self.stage1_candidates < 1:
            raise ParameterError("stage1_candidates", "must be >= 1")
        if self.stage1 not in STAGE1_RULES:
            raise ParameterError("stage1", f"must be one of {', '.join(STAGE1_RULES)}")
        if self.short_pool not in SHORT_POOL_RULES:
            raise ParameterError("short_pool", f"must be one of {', '.join(SHORT_POOL_RULES)}")
        if self.fit_horizon is not None and not self.fit_horizon >= 1.0:
            raise ParameterError("fit_horizon", "must be >= 1 step (or None: never)")
        if self.stage2_order is not None and self.stage2_order not in STAGE2_ORDERS:
            raise ParameterError("stage2_order", f"must be one of {', '.join(STAGE2_ORDERS)}")
        if self.guard is not None and self.guard not in GUARD_RULES:
            raise ParameterError("guard", f"must be one of {', '.join(GUARD_RULES)}")
        if self.zero_gamma_rules not in ZERO_GAMMA_RULES:
            raise ParameterError("zero_gamma_rules",
                                 f"must be one of {', '.join(ZERO_GAMMA_RULES)}")
        if self.own_wait_horizon is not None and not self.own_wait_horizon >= 1.0:
            raise ParameterError("own_wait_horizon", "must be >= 1 step (or None: never)")
        if not self.myopic_horizon >= 1.0:
            raise ParameterError("myopic_horizon", "must be >= 1 step (1: only rounds at gamma 0)")
        if self.br0_check is not None and not 0.0 <= self.br0_check < float("inf"):
            raise ParameterError("br0_check", "must be a number >= 0 (or None: never)")
        if not 0.0 < self.learned_beta_scale <= SETTING_LIMIT:  # as REST's bound; NaN fails
            raise ParameterError("learned_beta_scale",
                                 f"must be a number > 0 and at most {SETTING_LIMIT:g}")
        if self.short_pool_growth not in SHORT_POOL_GROWTHS:
            raise ParameterError("short_pool_growth",
                                 f"must be one of {', '.join(SHORT_POOL_GROWTHS)}")
        if self.step_overhead is not None and not self.step_overhead >= 0:
            raise ParameterError("step_overhead", "must be >= 0 KV tokens (or None)")
        if not self.lpt_count_weight >= 0:
            raise ParameterError("lpt_count_weight", "must be >= 0")
        if self.patience is not None and (isinstance(self.patience, bool)
                                          or not isinstance(self.patience, Integral)
                                          or self.patience < 0):
            raise ParameterError("patience", "must be a whole number of rounds >= 0 (or None: "
                                             "no bound)")

    @classmethod
    def br0(cls, **overrides: object) -> BalanceRouteParams:
        """BR-0: no lookahead, ``alpha = 1``, ``beta = G`` (left unset: G is the fleet's)."""
        return cls(horizon=0, alpha=1.0, beta=None, **overrides)  # type: ignore[arg-type]

    @classmethod
    def paper(cls, **overrides: object) -> BalanceRouteParams:
        """The paper's BR-H: ``beta = 43`` (its G = 8 deployment point), constant ``D``, the
        guard that always admits, the F-best subset in Stage 2 with workers by free slots."""
        settings: dict[str, object] = {"beta": 43.0, "candidate_life": False,
                                       "guard": "always", "stage2_fill": False,
                                       "stage2_order": "slots"}
        settings.update(overrides)
        return cls(**settings)  # type: ignore[arg-type]

    def effective_beta(self, workers: int, learned: bool = False) -> float:
        """``beta``, or ``alpha * G`` when unset (times ``learned_beta_scale`` for a round
        with a ``learned`` law); in BR-0 (horizon 0) it must be G."""
        if self.beta is None:
            scale = self.learned_beta_scale if learned and self.horizon > 0 else 1.0
            return float(self.alpha * workers * scale)
        if self.horizon == 0 and self.beta != workers:
            raise ParameterError(
                "beta", f"BR-0 (horizon 0) forces beta = G = {workers}, got {self.beta:g}"
            )
        return float(self.beta)

    def stage1_rule(self, short_pool: bool, learned: bool = False
                    ) -> tuple[Literal["paper", "best-pair", "lpt", "lpt-f", "lpt-fit"], bool]:
        """The Stage-1 rule of a round, and whether it runs until every slot is used (a short
        pool under ``auto``, ``auto-pair`` or ``lpt``) instead of down to ``s_greedy``.
        ``lpt`` places the largest first onto the least-loaded open worker, ``lpt-f`` onto
        the open worker where BR-H's F is highest, ``lpt-fit`` onto the least-loaded one if
        it fits there under the current maximum, else as ``lpt-f``. ``learned``: the
        round's projected loads carry a learned law's spread; BR-H under ``auto`` then
        places a short pool as BR-0 does (``lpt``) unless ``learned_short_pool``, else by
        ``short_pool``."""
        if self.stage1 == "paper" or self.stage1 == "best-pair":
            return self.stage1, False
        if not short_pool:
            return "paper", False
        if self.stage1 == "auto" and self.horizon > 0:
            if learned and not self.learned_short_pool:
                return "lpt", True
            return _SHORT_POOL_STAGE1[self.short_pool], True
        if self.stage1 == "lpt" and self.horizon > 0:
            return "lpt-f", True
        if self.stage1 == "auto-pair":
            return "best-pair", True
        if self.stage1 == "lpt":
            return "lpt", True
        return AUTO_SHORT_POOL, True

    @property
    def effective_stage2_fill(self) -> bool:
        """``stage2_fill``, or when unset ``True`` for BR-0 and ``False`` for BR-H."""
        if self.stage2_fill is not None:
            return self.stage2_fill
        return bool(self.horizon == 0)  # a bool even for a numpy horizon (the field's check)

    @property
    def effective_stage2_order(self) -> Stage2Order:
        """``stage2_order``, or when unset ``slots`` for BR-H and ``margin`` for BR-0."""
        if self.stage2_order is not None:
            return self.stage2_order
        return "slots" if self.horizon > 0 else "margin"

    @property
    def effective_guard(self) -> GuardRule:
        """``guard``, or when unset ``idle`` for BR-H and ``always`` for BR-0."""
        if self.guard is not None:
            return self.guard
        return "idle" if self.horizon > 0 else "always"

    def effective_r_max(self, workers: int) -> int:
        """``r_max``, or the default window when unset (see the attribute)."""
        if self.r_max is not None:
            return self.r_max
        return min(BR0_WINDOW_PER_WORKER * workers, BR0_WINDOW_CAP)

    def with_settings(self, settings: dict[str, str]) -> BalanceRouteParams:
        """These parameters with fields set from text (``{"horizon": "20", "beta": "none",
        "learned_short_pool": "true"}``): each value read as its field's type (a whole
        number, a number, ``true``/``false``, a name; ``none``/``never``/``null`` where the
        field may be unset), then checked as any parameters are. A name that is not a field,
        or a value its field cannot take, raises :class:`ParameterError` naming the field."""
        fields = {f.name: str(f.type) for f in dataclasses.fields(self)}
        values: dict[str, object] = {}
        for name, text in settings.items():
            if name not in fields:
                raise ParameterError(name, "is not a BR parameter (one of: "
                                     + ", ".join(sorted(fields)) + ")")
            values[name] = _parse_setting(name, fields[name], text)
        return replace(self, **values)  # type: ignore[arg-type]

    def as_br0(self) -> BalanceRouteParams:
        """The BR-0 parameters this BR-H falls back to (same stage settings)."""
        return BalanceRouteParams.br0(
            r_max=self.r_max,
            s_greedy=self.s_greedy,
            stage1_candidates=self.stage1_candidates,
            stage1=self.stage1,
            lpt_count_weight=self.lpt_count_weight,
            stage2_order=self.stage2_order,
            stage2_fill=self.stage2_fill,
            stage2_revisit=self.stage2_revisit,
            guard=self.guard,
            step_overhead=self.step_overhead,
            patience=self.patience,
        )


def _parse_setting(name: str, annotation: str, text: str) -> object:
    """One :meth:`BalanceRouteParams.with_settings` value, read by its field's annotation."""
    raw = text.strip()
    if raw.lower() in ("none", "never", "null"):
        if "None" not in annotation:
            raise ParameterError(name, "cannot be unset")
        return None
    kind = annotation.replace(" | None", "").strip()
    if kind == "bool":
        if raw.lower() not in ("true", "false"):
            raise ParameterError(name, f"{raw!r} is not true or false")
        return raw.lower() == "true"
    if kind in ("int", "float"):
        try:
            value: float = int(raw) if kind == "int" else float(raw)
        except ValueError:
            raise ParameterError(name, f"{raw!r} is not a "
                                 + ("whole number" if kind == "int" else "number")) from None
        if not -SETTING_LIMIT <= value <= SETTING_LIMIT:  # NaN, inf and 400-digit numbers
            raise ParameterError(name, f"{raw!r} is not a number within +-{SETTING_LIMIT:g}")
        return value
    return raw  # a name (a Literal's choices are checked with the parameters)


# BalanceRouteParams' switches, read once: (name, whether None, the policy's rule, is allowed)
_SWITCHES = tuple((spec.name, spec.type == "bool | None")
                  for spec in dataclasses.fields(BalanceRouteParams)
                  if spec.type in ("bool", "bool | None"))


@dataclass
class RoundStats:
    """What one round did (for metrics)."""

    stage1_admissions: int = 0
    stage2_admissions: int = 0
    starvation_guard_admissions: int = 0
    used_prediction: bool = False
    extra: dict[str, float] = field(default_factory=dict)
    waited: list[int] = field(default_factory=list)  # workers the guard idle held back
    patience_admissions: int = 0  # guard admissions of workers out of patience
    revisit_admissions: int = 0  # Stage-2 admissions on a revisit (``stage2_revisit``)


def build_table(fleet: FleetView, params: BalanceRouteParams,
                refill: float | None = None, gamma: float | None = None) -> MarginTable:
    """Projection, envelope and margins for one round (H = 0: the current loads); ``refill``:
    the size of the request taking each slot emptied within the window (None: none);
    ``gamma``: the round's discount when already known (else ``params.gamma``, or the
    turnover discount)."""
    beta = params.effective_beta(fleet.workers, fleet.has_law)
    if fleet.active_c_hat is None:
        if params.horizon > 0:
            raise ValueError("BR-H needs c_hat for every active request")
        loads = fleet.loads.astype(np.float64)[:, None]
        return MarginTable(loads, discounts(0, 1.0), params.alpha, beta)
    spread = None
    if fleet.active_p_fin is not None and fleet.active_mu_rem is not None:
        loads, spread = mixture_moments(
            fleet.workers, params.horizon, fleet.active_worker, fleet.active_size,
            fleet.active_p_fin, fleet.active_mu_rem, refill=refill,
            end_points=params.end_points, spread=params.expected_overflow,
            end_shape=params.end_shape)
    else:
        loads = projected_loads(fleet.workers, params.horizon, fleet.active_worker,
                                fleet.active_size, fleet.active_c_hat, refill=refill)
    gamma = params.gamma if gamma is None else gamma
    if gamma is None:
        gamma = turnover_gamma(fleet, params.horizon, params.turnover_scale,
                               end_shape=params.end_shape)
    return MarginTable(loads, discounts(params.horizon, gamma), params.alpha, beta, spread,
                       marginal=params.marginal_overflow)


def arrival_fill_growth(free: float, rate: float | None, horizon: int) -> np.ndarray | None:
    """The expected growth of one of ``free`` free slots by each step h = 0..``horizon``
    when arrivals at ``rate`` a step fill the free slots in proportion (a slot taken by step t
    with chance min(1, rate t / free), growing a token a step after): the integral of that
    chance from 0 to h, ``rate h^2 / (2 free)`` until ``free / rate`` steps, then
    ``h - free / (2 rate)``. None without a positive rate or a free slot
    (``short_pool_growth="arrivals"``)."""
    if rate is None or not rate > 0 or not free > 0:
        return None
    steps = np.arange(horizon + 1, dtype=np.float64)
    fill = free / rate  # steps until the free slots are all taken
    return np.where(steps <= fill, rate * steps**2 / (2.0 * free), steps - fill / 2.0)


TURNOVER = "turnover"  # a recommendation's or grid point's gamma for ``gamma=None``


def gamma_value(gamma: object) -> float | None:
    """A recommendation's or grid point's ``gamma`` as :class:`BalanceRouteParams` takes it:
    ``"turnover"`` (or null) is ``None``, the discount taken from the fleet's turnover."""
    if gamma is None or gamma == TURNOVER:
        return None
    return float(gamma)  # type: ignore[arg-type]


def turnover_gamma(fleet: FleetView, horizon: int, scale: float = 1.0,
                   pool: int | None = None, end_shape: str = END_SHAPE) -> float:
    """The discount whose effective horizon ``1 / (1 - gamma)`` is ``scale`` times the steps
    between two admissions to one worker, clipped to [1, H] steps (1: gamma 0, no look
    ahead at all).

    Whatever a round decides about a worker is corrected at that worker's next admission; the
    projection past it is of a fleet the router will have changed. In steady state admissions
    match completions, so the steps between two admissions to a worker are the steps by which
    the fleet expects G completions, one per worker: the t where ``n(t) = G``, ``n(t)`` the
    completions expected within t steps (:func:`expected_completions`). Where fewer than G
    are expected within the window, ``G * H / n(H)``, the rate seen over the window carried
    on. (``G * H / n(H)`` alone, the rule before, undercounts where outputs are short against
    H: a slot then turns over several times within the window, and ``n(H)`` counts it once.)

    A fleet filling up (arrivals outpacing completions: a cold start, a sustained rise) admits
    faster than its completions free slots. Given the round's ``pool`` (waiting requests) and
    a measured ``fleet.arrival_rate`` (lambda per step), the admissions expected within t steps
    after this round are at least ``min(F + n(t), P + lambda t)``, F the free slots and P the
    waiting requests this round leaves; ``n(t)`` is replaced by the larger of the two (never a
    longer lookahead than the completions give; :func:`expected_admissions`).
    """
    workers = fleet.workers
    if horizon < 1:
        return 0.0
    admissions = expected_admissions(fleet, horizon, pool, end_shape)
    if admissions is None or admissions[-1] <= 0:
        steps = float("inf")
    elif admissions[-1] < workers:
        steps = workers * horizon / float(admissions[-1])
    else:
        k = int(np.searchsorted(admissions, workers))  # the first t = k + 1 with n >= G
        before = float(admissions[k - 1]) if k > 0 else 0.0
        steps = k + (workers - before) / max(float(admissions[k]) - before, 1e-12)
    effective = min(max(scale * steps, 1.0), float(max(horizon, 1)))
    return 1.0 - 1.0 / effective


def expected_admissions(fleet: FleetView, horizon: int, pool: int | None = None,
                        end_shape: str = END_SHAPE) -> np.ndarray | None:
    """The admissions expected within t = 1..H steps after this round, as
    :func:`turnover_gamma` counts them: ``n(t)`` (:func:`expected_completions`), raised to
    ``min(F + n(t), P + lambda t)`` where arrivals at ``fleet.arrival_rate`` (lambda) would fill
    free slots faster; ``pool``: the waiting requests this round sees (None: completions
    alone)."""
    completions = expected_completions(fleet, horizon, end_shape)
    rate = fleet.arrival_rate
    if completions is None or pool is None or rate is None:
        return completions
    free = int(fleet.free_slots.sum())
    free_after, waiting_after = max(free - pool, 0), max(pool - free, 0)
    t = np.arange(1, horizon + 1, dtype=np.float64)
    fed = np.minimum(free_after + completions, waiting_after + rate * t)
    return np.maximum(completions, fed)


def expected_completions(fleet: FleetView, horizon: int, end_shape: str = END_SHAPE
                         ) -> np.ndarray | None:
    """``n(t)`` for t = 1..H: the active requests expected to end within t steps. Under the
    predictor's law when it gives one (``p_fin``, with the end time of ``end_shape`` given
    ``mu_rem``: the law :func:`~router_client.projection.mixture_loads` takes, here exact
    rather than at its ``end_points`` quantiles), else the requests whose
    ``c_hat`` is at most t (true lengths: exact). None without predictions."""
    t = np.arange(1, horizon + 1, dtype=np.float64)
    p_fin, mu_rem = fleet.active_p_fin, fleet.active_mu_rem
    if p_fin is not None and mu_rem is None:  # no end times given: spread over the window
        return float(np.clip(p_fin, 0.0, 1.0).sum()) * t / horizon
    if p_fin is not None and mu_rem is not None:
        p, mu = end_law(p_fin, mu_rem, horizon)
        if end_shape == "exponential":
            return expected_ends(p, mu, horizon)
        low, high = end_window(mu, horizon)
        return _uniform_ends(t, p, low, high - low)
    if fleet.active_c_hat is None:
        return None
    ends = np.sort(np.asarray(fleet.active_c_hat, dtype=np.float64))
    return np.searchsorted(ends[ends < horizon], t, side="right").astype(np.float64)


def _uniform_ends(t: np.ndarray, p: np.ndarray, low: np.ndarray, width: np.ndarray
                  ) -> np.ndarray:
    """``sum_i p_i P(T_i <= t)`` at each t, ``T_i`` uniform on ``[low_i, low_i + width_i]``:
    a sum of ramps, piecewise linear in t, built from its 2n breakpoints (``O(n log n)``, not
    the ``O(n H)`` of evaluating every ramp at every t). A width below 1e-6 is a step at the
    ramp's end."""
    out = np.zeros(t.shape[0])
    step = width < 1e-6
    if step.any():
        order = np.argsort(low[step] + width[step])
        ends = (low[step] + width[step])[order]
        out += np.concatenate([[0.0], np.cumsum(p[step][order])])[
            np.searchsorted(ends, t, side="right")]
    ramp = ~step
    if ramp.any():
        rate = p[ramp] / width[ramp]
        x = np.concatenate([low[ramp], low[ramp] + width[ramp]])
        order = np.argsort(x, kind="stable")
        x = x[order]
        slope = np.cumsum(np.concatenate([rate, -rate])[order])  # on [x_j, x_j+1)
        values = np.concatenate([[0.0], np.cumsum(slope[:-1] * np.diff(x))])
        out += np.interp(t, x, values)
    return out


def route_round(
    fleet: FleetView, pool: list[WaitingRequest], params: BalanceRouteParams,
    reference: bool | None = None, waited: np.ndarray | None = None,
) -> tuple[list[Assignment], RoundStats]:
    """One scheduling round of BR-H (or BR-0 when ``params.horizon == 0``).

    ``waited``: for each worker, the rounds in a row the guard ``idle`` has held it back
    (the caller's count, see ``BalanceRouteParams.patience``; None: none has waited); the
    workers it holds back in this round are ``stats.waited``.

    ``reference=True`` runs the pure-Python/numpy reference throughout; the default
    (:data:`FAST_PATH`) reads only the head of the pool that the round can reach
    (:func:`reachable_head`) and takes BR-0's stages, and BR-H's exhaustive subset choice,
    through :mod:`router_client.fastpath`, which makes the same decisions."""
    started = perf_counter()
    stats = RoundStats(used_prediction=params.horizon > 0)
    free = fleet.free_slots.astype(np.int64).copy()
    total_free = int(free.sum())
    if not pool or total_free <= 0:
        return [], stats
    gamma = params.gamma
    if params.horizon > 0 and gamma is None and fleet.active_c_hat is not None:
        gamma = turnover_gamma(fleet, params.horizon, params.turnover_scale,
                               len(pool) if params.turnover_arrivals else None,
                               params.end_shape)
        if gamma <= 0.0 or 1.0 / (1.0 - gamma) < params.myopic_horizon:
            stats.extra["gamma"] = max(gamma, 0.0)
            if params.effective_beta(fleet.workers, fleet.has_law) == params.alpha * fleet.workers:
                # The next admission to a worker comes within a step (rounded to whole
                # steps: ``myopic_horizon``): nothing the lookahead sees outlives this
                # round's decisions, and BR-H with gamma 0 and beta = alpha G is BR-0's score
                # (scaled by alpha). The round is BR-0's, Stage-1 rule included. (Another
                # beta, the paper's 43, keeps its own score at gamma 0.)
                params = _as_br0(params)
                stats.extra["as_br0"] = True
    fast = FAST_PATH if reference is None else not reference
    head = reachable_head(len(pool), params, fleet.workers, total_free) if fast else len(pool)
    state = _Round(fleet, pool, params, free, stats, head, fast, gamma, waited)
    checked = params.br0_check is not None and params.horizon > 0
    initial = copy.deepcopy(state.table) if checked else None
    if not (fast and state.fast_stage1()):
        state.stage1()
    stage2_started = perf_counter()
    stats.extra["stage1_s"] = stage2_started - started
    if not (fast and state.fast_stage2()):
        state.stage2()
    stats.extra["stage2_s"] = perf_counter() - stage2_started
    if initial is not None:
        return _checked_against_br0(fleet, pool, params, reference, waited, state, initial)
    return state.out, stats


def _checked_against_br0(
    fleet: FleetView, pool: list[WaitingRequest], params: BalanceRouteParams,
    reference: bool | None, waited: np.ndarray | None, state: _Round, initial: MarginTable,
) -> tuple[list[Assignment], RoundStats]:
    """``br0_check``: BR-0's round from the same state (:func:`_as_br0`'s rules), and BR-H's
    round (``state``, routed from the margin table ``initial``) kept only where BR-H's own
    measure puts it more than ``br0_check`` candidates' worth of discounted fill above
    BR-0's; otherwise BR-0's round with its stats (waits included), ``extra`` holding BR-H's
    round's figures (its discount, its stages' times) and ``br0_check_s``, the check's own
    time (BR-0's round and the two measures).

    A round's measure is the F of its admissions summed in order on a copy of ``initial``
    (with known loads: ``alpha`` times the discounted work added less ``beta`` times the
    envelope's discounted rise, whatever the order); the scale is the mean discounted fill
    of the first ``r_max`` candidates."""
    started = perf_counter()
    out, stats = state.out, state.stats
    alt, alt_stats = route_round(fleet, pool, _as_br0(params), reference, waited)
    if sorted((a.pool_index, a.worker) for a in alt) == \
            sorted((a.pool_index, a.worker) for a in out):
        stats.extra["br0_check_s"] = perf_counter() - started
        return out, stats
    # BR-0's round reads the same head of the pool (the same window, Stage-1 candidates
    # and free slots: reachable_head), so BR-H's rows cover every request it admits.
    rows, sizes = state.rows, state.sizes
    if max((a.pool_index for a in alt), default=-1) >= len(sizes):
        raise ContractError("BR-0's round admitted a request past BR-H's head")
    own, br0 = (_summed_f(copy.deepcopy(initial), rows, sizes, admitted)
                for admitted in (out, alt))
    width = min(len(sizes), params.effective_r_max(fleet.workers))
    if rows is not None:
        scale = params.alpha * float((rows[:width] @ initial.d).mean())
    else:
        scale = initial.fill * float(sizes[:width].mean())
    gain = (own - br0) / scale if scale > 0 else 0.0
    stats.extra["br0_check_gain"] = gain
    stats.extra["br0_check_s"] = perf_counter() - started  # BR-0's round and the measures
    if gain > params.br0_check:  # type: ignore[operator]  # set: the caller checked
        return out, stats
    alt_stats.used_prediction = True
    alt_stats.extra = {**alt_stats.extra, **stats.extra, "br0_check": True}
    return alt, alt_stats


def _summed_f(table: MarginTable, rows: np.ndarray | None, sizes: np.ndarray,
              admitted: list[Assignment]) -> float:
    """The F of ``admitted`` scored and admitted in order on ``table`` (changed), as a
    round scores and admits them (:class:`_Round`)."""
    total = 0.0
    for a in admitted:
        total += float(_table_score(table, rows, sizes, a.worker, a.pool_index))
        _table_admit(table, rows, sizes, a.worker, a.pool_index)
    return total


def _table_score(table: MarginTable, rows: np.ndarray | None, sizes: np.ndarray, worker: int,
                 indices: int | list[int]) -> np.ndarray:
    """F on ``worker`` of the pool entries ``indices``: their rows where the round has them
    (BR-H's projected loads), else their sizes."""
    if rows is not None:
        return table.score_rows(worker, rows[indices])
    return table.score(worker, sizes[indices])


def _table_admit(table: MarginTable, rows: np.ndarray | None, sizes: np.ndarray, worker: int,
                 index: int) -> None:
    """Pool entry ``index`` admitted to ``worker`` on ``table``, by its row or its size."""
    if rows is not None:
        table.admit_row(worker, rows[index])
    else:
        table.admit(worker, float(sizes[index]))


@lru_cache(maxsize=64)
def _as_br0(params: BalanceRouteParams) -> BalanceRouteParams:
    """BR-0's parameters for a BR-H round at gamma 0. ``zero_gamma_rules="br0"`` (default):
    :meth:`BalanceRouteParams.as_br0`, BR-0's own guard and Stage 2 unless BR-H's parameters
    set them, so the round is exactly the one BR-0 would route; ``"brh"`` (the rule until
    2026-12-05): BR-H's guard (``idle`` by default) and Stage 2 (the paper's by default),
    scored as BR-0 scores it."""
    if params.zero_gamma_rules == "br0":
        return params.as_br0()
    return replace(params.as_br0(), guard=params.effective_guard,
                   stage2_order=params.effective_stage2_order,
                   stage2_fill=params.effective_stage2_fill)


def reachable_head(pool: int, params: BalanceRouteParams, workers: int, total_free: int) -> int:
    """How many entries at the head of a pool of ``pool`` requests one round can look at.

    Stage 1 reads the first ``stage1_candidates`` still waiting, Stage 2 the first ``r_max``,
    and a round admits at most ``total_free`` requests, each letting one more in: nothing past
    ``max(stage1_candidates, r_max) + total_free`` is ever scored or admitted, so a round that
    reads only that head decides the same (at G = 256 with a 4,096-request pool it reads about
    a quarter of it)."""
    window = max(params.stage1_candidates, params.effective_r_max(workers))
    return min(pool, window + total_free)


class _Round:
    """The state of one round: the margin table, free slots, who still waits (the first
    ``head`` entries of the pool: see :func:`reachable_head`)."""

    def __init__(self, fleet: FleetView, pool: list[WaitingRequest],
                 params: BalanceRouteParams, free: np.ndarray, stats: RoundStats,
                 head: int, fast: bool = False, gamma: float | None = None,
                 waited: np.ndarray | None = None) -> None:
        self.fleet, self.params, self.free, self.stats = fleet, params, free, stats
        patience = params.patience
        if waited is None:  # the caller keeps no count: none has waited
            waited = np.zeros(fleet.workers, dtype=np.int64)
        self.impatient: frozenset[int] = frozenset(
            () if patience is None else np.flatnonzero(np.asarray(waited) >= patience).tolist())
        self.fast = fast  # BR-H's enumerated subsets vectorized (fastpath.best_row_subset)
        self.total_free = int(free.sum())
        self.sizes = np.fromiter(map(_PROMPT_TOKENS, islice(pool, head)), dtype=np.float64,
                                 count=head)
        refill = None
        if params.refill and params.horizon > 0 and len(pool) > self.total_free:
            refill = float(self.sizes[: params.stage1_candidates].mean())
        self.table = build_table(fleet, params, refill, gamma)
        if params.horizon > 0:
            stats.extra["gamma"] = float(self.table.d[1])
        self.rows: np.ndarray | None = None
        if params.candidate_life and params.horizon > 0:
            pool_c_hat = fleet.pool_c_hat
            if pool_c_hat is not None and len(pool_c_hat) != len(pool):
                pool_c_hat = None
            elif pool_c_hat is not None:
                pool_c_hat = pool_c_hat[:head]
            self.rows = candidate_rows(self.sizes, pool_c_hat, params.horizon, refill)
        elif self.table.spread is not None:  # the paper's constant D, scored as rows
            self.rows = np.repeat(self.sizes[:, None], params.horizon + 1, axis=1)
        self.waiting = list(range(head))  # pool indices still waiting, in arrival order
        self.short_pool = len(pool) <= self.total_free
        self.rule, whole = params.stage1_rule(self.short_pool,
                                              learned=self.table.spread is not None)
        self.threshold = 0 if whole else params.s_greedy
        self.out: list[Assignment] = []
        self.exact = False

    def score(self, worker: int, indices: list[int]) -> np.ndarray:
        return _table_score(self.table, self.rows, self.sizes, worker, indices)

    def admit(self, worker: int, index: int, guard: bool = False) -> None:
        _table_admit(self.table, self.rows, self.sizes, worker, index)
        self.free[worker] -= 1
        self.total_free -= 1
        self.out.append(Assignment(index, worker, guard))

    def fast_stage1(self) -> bool:
        """Stage 1 by :mod:`router_client.fastpath`; False (nothing done) where it does not
        apply."""
        params, rule, threshold = self.params, self.rule, self.threshold
        if self.total_free <= threshold:
            return params.horizon == 0  # no Stage-1 admission either way
        loads = self.table.loads[:, 0]
        if rule not in ("lpt", "best-pair", "paper") or not fastpath.applies(
                params.horizon, self.rows, loads, self.sizes):
            return False  # lpt-f and lpt-fit (BR-H's F) have no fast path
        self.exact = True  # the fast path applies to this round (checked once)
        window = fastpath.Window(self.sizes, self.waiting, params.stage1_candidates)
        if rule == "lpt":
            done = fastpath.stage1_lpt(loads, self.free, window, self.fleet.capacity,
                                       params.lpt_count_weight)
        elif rule == "best-pair":
            done = fastpath.stage1_best_pair(loads, self.free, window, self.table.beta,
                                             threshold)
        else:
            done = fastpath.stage1_paper(loads, self.free, window, self.table.beta,
                                         params.s_greedy)
        self.out.extend(Assignment(index, worker) for index, worker in done.admitted)
        self.stats.stage1_admissions += len(done.admitted)
        self.free[:] = done.free
        self.total_free = int(done.free.sum())
        # Stage 2 reads the first r_max and admits at most total_free: that head is enough.
        self.waiting = window.still_waiting(
            self.params.effective_r_max(self.fleet.workers) + self.total_free)
        self.table = MarginTable(done.loads[:, None], self.table.d, self.table.alpha,
                                 self.table.beta)
        return True

    def fast_stage2(self) -> bool:
        """Stage 2 by :func:`router_client.fastpath.stage2_br0` (BR-0 only); False (nothing
        done) where it does not apply."""
        if not self.waiting or self.total_free <= 0:
            return True
        loads = self.table.loads[:, 0]
        if not (self.exact or fastpath.applies(self.params.horizon, self.rows, loads,
                                                self.sizes)):
            return False
        done = fastpath.stage2_br0(loads, self.free, self.sizes, self.waiting,
                                   self.params.effective_r_max(self.fleet.workers),
                                   self.table.beta, self.params.effective_stage2_order,
                                   self.params.effective_stage2_fill,
                                   "idle" if self._guard_waits() else "always",
                                   self._wait_context(), self.params.stage2_revisit)
        self.stats.waited.extend(done.waited)
        self.stats.patience_admissions += done.patience_admissions
        self.stats.revisit_admissions += done.revisit_admissions
        for index, worker, guard in done.admitted:
            self.out.append(Assignment(index, worker, guard))
            self.stats.stage2_admissions += 1
            self.stats.starvation_guard_admissions += int(guard)
        self.waiting = done.waiting
        return True

    def stage1(self) -> None:
        params, rule, threshold = self.params, self.rule, self.threshold
        if rule in _LPT_PLACEMENT:
            self.stage1_lpt(_LPT_PLACEMENT[rule])
            return
        if rule == "best-pair":
            while self.waiting and self.total_free > threshold:
                worker, pos = _best_pair(self.table, self.free,
                                         self.waiting[: params.stage1_candidates], self.score)
                self.admit(worker, self.waiting.pop(pos))
                self.stats.stage1_admissions += 1
            return
        while self.waiting and self.total_free > params.s_greedy:
            loads0 = self.table.loads[:, 0]
            order = np.lexsort((np.arange(self.fleet.workers), loads0, -self.free))
            worker = int(order[0])
            scores = self.score(worker, self.waiting[: params.stage1_candidates])
            pos = int(np.argmax(scores))  # first maximum: the earliest request
            self.admit(worker, self.waiting.pop(pos))
            self.stats.stage1_admissions += 1

    def stage1_lpt(self, placement: Literal["load", "score", "fit"] = "load") -> None:
        """The ``lpt`` rules (a short pool: every request is admitted): the largest of the
        first ``stage1_candidates`` waiting (the earliest of ties) onto an open worker.
        ``placement``: ``load`` (BR-0's ``lpt``) the open worker with the lowest ``load +
        lpt_count_weight * active requests`` (ties: lower index); ``score`` (BR-H's
        ``lpt-f``) the open worker where its F is highest; ``fit`` (BR-H's ``lpt-fit``) the
        ``load`` choice if the request fits there under the current maximum (it raises no
        step now), else the ``score`` choice."""
        weight, capacity = self.params.lpt_count_weight, self.fleet.capacity
        if placement == "fit" and self._long_view():
            placement = "score"
        while self.waiting and self.total_free > 0:
            candidates = self.waiting[: self.params.stage1_candidates]
            pos = int(np.argmax(self.sizes[candidates]))  # first maximum: the earliest
            index = candidates[pos]
            if placement == "score":
                worker = self._best_worker(index)
            else:
                key = self.table.loads[:, 0] + weight * (capacity - self.free)
                worker = int(np.argmin(np.where(self.free > 0, key, np.inf)))
                if placement == "fit" and not self._fits_now(worker, index):
                    worker = self._best_worker(index)
            self.admit(worker, self.waiting.pop(pos))
            self.stats.stage1_admissions += 1

    def _long_view(self) -> bool:
        """Whether this round's effective horizon ``1 / (1 - gamma)`` reaches
        ``params.fit_horizon`` steps (then ``lpt-fit`` places by F, as ``lpt``)."""
        return self._reaches(self.params.fit_horizon)

    def _reaches(self, limit: float | None) -> bool:
        """Whether this round's effective horizon ``1 / (1 - gamma)`` reaches ``limit`` steps
        (None: never)."""
        if limit is None or self.params.horizon <= 0:
            return False
        gamma = float(self.table.d[1])  # the round's: fixed, or from the turnover
        # 1 / (1 - gamma) >= limit, written as the turnover rule writes gamma (1 - 1 / steps)
        # so that a horizon of exactly ``limit`` steps counts, whatever the rounding
        return gamma >= 1.0 - 1.0 / limit - 1e-12

    def _fits_now(self, worker: int, index: int) -> bool:
        """Whether request ``index`` adds no more than ``worker``'s margin under the current
        maximum at this step (it adds its prompt at step 0, candidate rows included:
        :func:`router_client.fscore.candidate_rows` keeps every candidate alive there)."""
        return bool(self.sizes[index] <= self.table.current_margin(worker))

    def _best_worker(self, index: int) -> int:
        """The open worker where request ``index`` scores the highest F (ties: lower load,
        lower index)."""
        open_workers = np.flatnonzero(self.free > 0)
        curve = self._slot_growth() if self.table.spread is None else None
        if self.rows is not None and curve is not None:
            scores = self._slot_growth_scores(open_workers, self.rows[index], curve)
        elif self.rows is not None:
            scores = self.table.score_row_workers(open_workers, self.rows[index])
        else:
            scores = np.array([float(self.score(int(g), [index])[0]) for g in open_workers])
        order = np.lexsort((open_workers, self.table.loads[open_workers, 0], -scores))
        return int(open_workers[order[0]])

    def _slot_growth(self) -> np.ndarray | None:
        """How much one free slot is projected to grow by each step of the window, when this
        short pool's F projects growth by slots (``short_pool_growth``), else None: ``h``
        for ``"slots"`` (and ``"filling"`` while the fleet fills); for ``"arrivals"`` the
        expected growth of a slot filled by arrivals at the measured rate, shared over the
        free slots in proportion: with F free slots and rate lambda, a slot is taken by step
        t with chance min(1, lambda t / F) and grows a token a step after, so by step h it
        has grown the integral of that chance, lambda h^2 / (2F) until F / lambda, then
        h - F / (2 lambda), F the free slots at this placement."""
        rule = self.params.short_pool_growth
        if rule == "requests" or not self.short_pool:
            return None
        if rule == "arrivals":  # the free slots left at this placement (each takes one)
            return arrival_fill_growth(float(self.free.sum()), self.fleet.arrival_rate,
                                       self.params.horizon)
        return self._round_growth

    @cached_property
    def _round_growth(self) -> np.ndarray | None:
        """``"slots"``' and ``"filling"``'s curve, the same all round (computed at the
        round's first placement by F)."""
        rate = self.fleet.arrival_rate
        if self.params.short_pool_growth == "filling":
            ends = expected_completions(self.fleet, self.params.horizon, self.params.end_shape)
            if not (rate is not None and ends is not None
                    and rate * self.params.horizon > float(ends[-1])):
                return None
        return np.arange(self.params.horizon + 1, dtype=np.float64)

    def _slot_growth_scores(self, workers: np.ndarray, row: np.ndarray,
                            curve: np.ndarray) -> np.ndarray:
        """F of ``row`` on each of ``workers`` with every free slot projected to grow by
        ``curve`` (``short_pool_growth``; ``h`` for ``"slots"``): each worker's loads plus
        ``free * curve``, the slot the request itself takes left out of its own worker's (its
        row carries its growth), against the envelope of the fleet so projected."""
        loads = self.table.loads + self.free[:, None] * curve[None, :]
        return self.table.score_row_against(row, loads.max(axis=0),
                                            loads[workers] - curve[None, :])

    def stage2(self) -> None:
        """Workers with free slots in ``params.effective_stage2_order`` (``slots``: most free
        slots, then the widest margin, then index; ``margin``: the widest margin, then index), each
        the best subset of the first ``r_max`` waiting requests, or the starvation guard's
        single request where no subset scores above 0. ``stage2_revisit``: a worker that took
        a subset scoring above 0 and has slots left is taken again after every worker's first
        visit (revisits in the same order, by their slots and margins under the round's first
        maximum), and on that visit takes only a subset scoring above 0."""
        if not self.waiting or self.total_free <= 0:
            return
        free, table = self.free, self.table
        by_slots = self.params.effective_stage2_order == "slots"
        # (revisit, slots, margin, index); a revisit is keyed by its margin at the round's
        # first maximum (its load, which nothing changes until it is popped again), so that
        # every key compares margins under one maximum
        first = float(table.envelope[0])
        heap = [(False, -int(free[g]) if by_slots else 0, -table.current_margin(g), g)
                for g in range(self.fleet.workers) if free[g] > 0]
        heapq.heapify(heap)
        while heap and self.waiting:
            again, _, _, worker = heapq.heappop(heap)
            candidates = self.waiting[: self.params.effective_r_max(self.fleet.workers)]
            choice = self._subset(worker, candidates)
            if choice is None:
                continue
            if choice.score > 0:
                picked = [candidates[k] for k in choice.indices]
                for index in picked:
                    self.admit(worker, index)
                self.stats.stage2_admissions += len(picked)
                self.stats.revisit_admissions += len(picked) if again else 0
                if self.params.stage2_revisit and free[worker] > 0:  # after first visits
                    heapq.heappush(heap, (True, -int(free[worker]) if by_slots else 0,
                                          -(first - table.loads[worker, 0]), worker))
            elif again:
                continue  # a revisit admits only what pays (no guard, no wait)
            elif (holds := self._wait(worker, candidates)) and worker not in self.impatient:
                self.stats.waited.append(worker)
                continue  # the slots stay empty this round (guard "idle")
            else:  # starvation guard: the single best request, even at F <= 0
                index = candidates[int(np.argmax(self.score(worker, candidates)))]
                self.admit(worker, index, guard=True)
                self.stats.stage2_admissions += 1
                self.stats.starvation_guard_admissions += 1
                self.stats.patience_admissions += int(holds)  # it would have waited
                picked = [index]
            taken = set(picked)  # all among the first r_max: only the head is rebuilt
            head = len(candidates)
            self.waiting = ([i for i in self.waiting[:head] if i not in taken]
                            + self.waiting[head:])

    def _guard_waits(self) -> bool:
        """Whether the guard ``idle`` applies: G >= 2 workers up (a margin exists) with more
        than ``s_greedy`` slots (Stage 1, which admits whatever F says, can run). It never
        holds back a worker with no request (:meth:`_wait`)."""
        fleet = self.fleet
        return (self.params.effective_guard == "idle" and fleet.live_workers >= 2
                and fleet.live_workers * fleet.capacity > self.params.s_greedy)

    def _wait(self, worker: int, candidates: list[int]) -> bool:
        """The guard ``idle``: whether ``worker`` (whose best subset scores F <= 0) takes
        nothing this round, i.e. no candidate's overflow pays
        (:func:`router_client.fastpath.overflow_pays`: BR-0's F now plus the admission's
        share of the step's fixed cost is not positive for any; where BR-H's lookahead alone
        objects it admits its best request as the guard ``always`` does, unless the round's
        effective horizon reaches ``own_wait_horizon`` and the fleet has no learned law, or
        ``own_wait_learned``: then it waits). A worker out of
        patience (:attr:`impatient`) takes its best request all the same: the caller's
        business."""
        if not self._guard_waits() or self.free[worker] >= self.fleet.capacity:
            return False  # an empty worker never waits: nothing else would fill it
        if (self.params.own_wait_learned or not self.fleet.has_law) and self._reaches(
                self.params.own_wait_horizon):
            return True  # a long view: the lookahead's own objection (F <= 0) stands
        context = self._wait_context()
        pays = fastpath.overflow_pays(self.sizes[candidates], self.table.current_margin(worker),
                                      context.workers, context.active, context.overhead)
        return not bool(pays.any())

    def _wait_context(self) -> fastpath.WaitContext:
        """The guard's G (workers up), N (their requests, this round's admissions so far
        included) and ``K = b / a`` in KV tokens: the parameters', else the fleet's (the
        simulator knows its step-cost model), else the default."""
        fleet, overhead = self.fleet, self.params.step_overhead
        if overhead is None:
            overhead = (fleet.step_overhead if fleet.step_overhead is not None
                        else DEFAULT_STEP_OVERHEAD)
        return fastpath.WaitContext(fleet.capacity, fleet.live_workers,
                                    fleet.live_active + len(self.out), overhead,
                                    self.impatient)

    def _subset(self, worker: int, candidates: list[int]) -> SubsetChoice | None:
        if self.rows is not None:
            fit = (self.table.current_margin(worker) if self.params.effective_stage2_fill
                   else None)
            return _best_row_subset(self.rows[candidates], int(self.free[worker]),
                                    partial(self.table.score_rows, worker), self.fast, fit)
        return best_subset([int(self.sizes[i]) for i in candidates], int(self.free[worker]),
                           partial(self.table.score, worker), self.table.peak(worker),
                           fill_slots=self.params.effective_stage2_fill)


def _best_row_subset(
    rows: np.ndarray, max_count: int, score: Callable[[np.ndarray], np.ndarray],
    fast: bool = False, fit_margin: float | None = None,
) -> SubsetChoice | None:
    """The non-empty subset of at most ``max_count`` candidates (rows of added work) with the
    highest F; ties: smaller added work now, then more requests. Exhaustive while there are at
    most :data:`MAX_ENUMERATED_SUBSETS` subsets (``fast``: all sums in one numpy pass,
    :func:`router_client.fastpath.best_row_subset`), else greedy (add the best request while F
    rises). ``total`` is the added work at step 0. ``fit_margin`` (``stage2_fill``): where
    some subset adds at most this much now, the most requests that do, then the highest F
    (ties: smaller added work now); greedy: the best request that still fits while one does."""
    n = rows.shape[0]
    max_count = min(max_count, n)
    if max_count <= 0:
        return None
    count = sum(comb(n, j) for j in range(1, max_count + 1))
    if count <= MAX_ENUMERATED_SUBSETS and fast:
        return fastpath.best_row_subset(rows, max_count, score, fit_margin)
    if count <= MAX_ENUMERATED_SUBSETS:
        subsets = [c for j in range(1, max_count + 1) for c in combinations(range(n), j)]
        sums = np.stack([rows[list(c)].sum(axis=0) for c in subsets])
        values = score(sums)
        fitting = ([q for q in range(len(subsets)) if sums[q, 0] <= fit_margin]
                   if fit_margin is not None else [])
        if fitting:
            best = min(fitting, key=lambda q: (-len(subsets[q]), -float(values[q]),
                                               float(sums[q, 0])))
        else:
            best = min(range(len(subsets)),
                       key=lambda q: (-float(values[q]), float(sums[q, 0]), -len(subsets[q])))
        return SubsetChoice(subsets[best], int(round(sums[best, 0])), float(values[best]))
    if fit_margin is not None and rows[:, 0].min() > fit_margin:
        fit_margin = None  # nothing fits now: the F-best greedy, as without the rule
    return _greedy_subset(rows, max_count, score, fit_margin)


def _greedy_subset(rows: np.ndarray, max_count: int,
                   score: Callable[[np.ndarray], np.ndarray],
                   fit_margin: float | None = None) -> SubsetChoice:
    """Stage 2 past enumeration: add the highest-F request while F rises; with
    ``fit_margin`` (``stage2_fill``, some request fits) add the highest-F request that keeps
    the added work now within it while one does, whether F rises or not."""
    chosen: list[int] = []
    current = np.zeros(rows.shape[1])
    value = float("-inf")
    while len(chosen) < max_count:
        rest = [i for i in range(rows.shape[0]) if i not in chosen and (
            fit_margin is None or current[0] + rows[i, 0] <= fit_margin)]
        if not rest:
            break
        values = score(current[None, :] + rows[rest])
        k = int(np.argmax(values))
        if fit_margin is None and chosen and values[k] <= value:
            break
        chosen.append(rest[k])
        current = current + rows[rest[k]]
        value = float(values[k])
    return SubsetChoice(tuple(sorted(chosen)), int(round(current[0])), value)


def _best_pair(
    table: MarginTable,
    free: np.ndarray,
    candidates: list[int],
    score: Callable[[int, list[int]], np.ndarray],
) -> tuple[int, int]:
    """Highest-F (worker, position in ``candidates``); ties: lower load, index, earlier."""
    best: tuple[float, float, int, int] | None = None
    for worker in np.flatnonzero(free > 0):
        scores = score(int(worker), candidates)
        pos = int(np.argmax(scores))
        key = (-float(scores[pos]), float(table.loads[worker, 0]), int(worker), pos)
        if best is None or key < best:
            best = key
    if best is None:
        raise ContractError("best pair asked with no worker that has a free slot")
    return best[2], best[3]
