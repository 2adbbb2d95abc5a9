import dataclasses

import numpy as np
import pytest

from predictor.estimators import ExactMatchEstimator, HazardEstimator, SurvivalEstimator
from predictor.estimators.in_process import LearnerPredictor
from router_client.errors import ContractError, ParameterError
from router_client.policies import make_policy
from router_client.predictors import OraclePredictor
from router_client.simulator import SimConfig, arrival_steps, simulate
from router_client.synth import synthesize
from router_client.traces import Trace, parse_trace

TINY = "arrival_s,prompt_tokens,output_tokens\n0,10,2\n0,4,1\n0,6,3\n"


def tiny_run(**overrides):
    config = SimConfig(workers=2, batch=2, load=1.0, step_cost=(1.0, 0.5), **overrides)
    return simulate(parse_trace(TINY), make_policy("ltl"), config)


def test_tiny_scenario_by_hand():
    # ltl puts r0 (10) on worker 0, r1 (4) and r2 (6) on worker 1 at step 0.
    # step 0: loads [10, 10]; step 1: [11, 7] (r1 left); step 2: [0, 8] (r0 left).
    result = tiny_run()
    row = result.row
    assert row["completed"] == 3
    assert row["routing_steps"] == 1 and row["drain_steps"] == 2
    assert row["imbalance_maxmin_mean"] == 0.0
    assert row["imbalance_total_mean"] == 0.0
    # where BF-IO measures it, once step 0's finished request (r1) has left: [11, 7]
    assert row["imbalance_total_after_step_mean"] == 4.0  # 2 * 11 - 18
    assert row["throughput_tok_s"] == pytest.approx(3 / 10.5)
    assert row["balanced_bound_tok_s"] == pytest.approx(3 / 10.5)
    assert row["makespan_s"] == pytest.approx(10.5 + 11.5 + 8.5)
    # all six output tokens (2 + 1 + 3) over the whole run, the drain's two steps included
    assert row["run_throughput_tok_s"] == pytest.approx(6 / (10.5 + 11.5 + 8.5))
    assert row["ttft_p95_ms"] == pytest.approx(10500.0)
    assert row["tpot_p95_ms"] is None  # nothing with two or more tokens ended in the window
    assert row["pool_wait_p95_steps"] == 0.0
    assert row["contended_steps"] == 0  # three requests, four slots: none waited
    assert list(result.finish_step) == [1, 0, 2]


def test_imbalance_and_idle_by_hand():
    # One worker holds both requests (B = 2, jsq ties to worker 0? no: jsq spreads them);
    # rr on G = 2: r0 -> w0, r1 -> w1 at step 0 with loads [10, 4].
    text = "arrival_s,prompt_tokens,output_tokens\n0,10,1\n0,4,1\n"
    row = simulate(parse_trace(text), make_policy("rr"),
                   SimConfig(workers=2, batch=1, load=1.0, step_cost=(1.0, 0.0))).row
    assert row["imbalance_maxmin_mean"] == 6.0
    assert row["imbalance_total_mean"] == 6.0  # G*M - sum = 20 - 14
    assert row["imbalance_total_after_step_mean"] == 0.0  # both have left after the step
    assert row["barrier_idle_fraction"] == pytest.approx(6 / 20)
    assert row["throughput_tok_s"] == pytest.approx(2 / 10)
    assert row["balanced_bound_tok_s"] == pytest.approx(2 / 7)


def test_pool_wait_when_capacity_is_short():
    # G = 1, B = 1: the second request waits for the first (2 steps) to finish.
    text = "arrival_s,prompt_tokens,output_tokens\n0,5,2\n0,5,2\n"
    result = simulate(parse_trace(text), make_policy("jsq"),
                      SimConfig(workers=1, batch=1, load=1.0, step_cost=(0.0, 1.0)))
    assert list(result.admit_step) == [0, 2]
    assert result.row["pool_wait_p95_steps"] == pytest.approx(np.percentile([0, 2], 95))
    assert result.row["tpot_p50_ms"] == pytest.approx(1000.0)  # 1 s per step, 2 tokens


def test_arrival_rate_matches_load():
    trace = synthesize("synth:long:n=4000")
    config = SimConfig(workers=8, batch=64, load=0.8)
    steps = arrival_steps(trace, config)
    rate = len(trace) / steps[-1]
    assert rate == pytest.approx(0.8 * 8 * 64 / trace.output_tokens.mean(), rel=1e-3)
    assert np.all(np.diff(steps) >= 0)
    # keeps the burst shape: the same relative gaps
    gaps = np.diff(trace.arrival_s)
    np.testing.assert_allclose(np.diff(steps) / steps[-1], gaps / trace.arrival_s[-1])


def test_same_seed_same_results():
    trace = synthesize("synth:long:n=600,seed=4")
    config = SimConfig(workers=4, batch=8, load=1.2, seed=7)
    for name in ("p2c", "random", "br0"):
        a = simulate(trace, make_policy(name, seed=7), config).row
        b = simulate(trace, make_policy(name, seed=7), config).row
        a.pop("sim_wall_s"), b.pop("sim_wall_s")
        assert a == b


def test_backlog_keeps_the_pool_topped_up_and_everything_completes():
    trace = synthesize("synth:long:n=500")
    result = simulate(trace, make_policy("br0"), SimConfig(workers=4, batch=8, load="backlog"))
    assert result.row["completed"] == 500
    assert (result.admit_step >= 0).all() and (result.finish_step >= result.admit_step).all()


class RecordingPredictor:
    """Wraps a learner and records every answer it gives."""

    def __init__(self, estimator=None):
        self.inner = LearnerPredictor(estimator or SurvivalEstimator(window=0))
        self.name = self.inner.name
        self.answers = []

    def predict(self, batch, horizon):
        prediction = self.inner.predict(batch, horizon)
        self.answers.append((batch.request_ids.copy(), prediction.c_hat.copy()))
        return prediction

    def observe(self, finished):
        self.inner.observe(finished)


LEARNERS = {
    "survival": lambda: SurvivalEstimator(window=0),
    "exact_match": lambda: ExactMatchEstimator(window=0, refresh_every=20),
    "hazard": lambda: HazardEstimator(min_fit=30, refit_every=60, max_iter=20),
}


@pytest.mark.parametrize("learner, spec", [("survival", "synth:long:n=400,seed=2"),
                                           ("exact_match", "synth:templated:n=400,seed=2"),
                                           ("hazard", "synth:templated:n=400,seed=2")])
def test_no_peeking_learners_depend_only_on_finished_requests(learner, spec):
    trace = synthesize(spec)
    # backlog: arrivals do not depend on output lengths (a numeric load rescales by their mean)
    config = SimConfig(workers=2, batch=8, load="backlog", horizon=40, refresh_steps=5)
    first = RecordingPredictor(LEARNERS[learner]())
    result = simulate(trace, make_policy("brh-survival"), config, first)
    k = int(np.median(result.finish_step))
    k -= k % 5  # a refresh step
    unfinished = result.finish_step >= k
    # Lengthen every request that had not finished by step k: nothing before k can change.
    changed = dataclasses.replace(
        trace, output_tokens=np.where(unfinished, trace.output_tokens + 500, trace.output_tokens)
    )
    second = RecordingPredictor(LEARNERS[learner]())
    simulate(changed, make_policy("brh-survival"), config, second)
    if learner == "hazard":  # the model was refit before step k, so it is what answered
        assert first.inner.estimator.n_fits_ >= 2
    refreshes_before_k = k // 5 + 1
    assert len(first.answers) > refreshes_before_k
    for (ids_a, c_a), (ids_b, c_b) in zip(
        first.answers[:refreshes_before_k], second.answers[:refreshes_before_k], strict=True
    ):
        np.testing.assert_array_equal(ids_a, ids_b)
        np.testing.assert_array_equal(c_a, c_b)
    # and the oracle, which does peek, would have differed
    oracle_a = OraclePredictor(trace.output_tokens)
    oracle_b = OraclePredictor(changed.output_tokens)
    from router_client.predictors import ActiveBatch

    ids = np.flatnonzero(unfinished)[:5]
    batch = ActiveBatch(ids, trace.prompt_tokens[ids], np.zeros(5, int), [None] * 5)
    assert not np.array_equal(oracle_a.predict(batch, 8000).c_hat,
                              oracle_b.predict(batch, 8000).c_hat)


def test_brh_fallback_steps_counted_without_predictor():
    trace = synthesize("synth:long:n=200")
    row = simulate(trace, make_policy("brh-oracle"), SimConfig(workers=2, batch=4)).row
    assert row["fallback_steps"] > 0
    row = simulate(trace, make_policy("brh-oracle"), SimConfig(workers=2, batch=4),
                   OraclePredictor(trace.output_tokens)).row
    assert row["fallback_steps"] == 0


class BrokenPolicy:
    name = "broken"
    needs_predictions = False

    def __init__(self, mode):
        self.mode = mode

    def route(self, fleet, pool):
        from router_client.fleet import Assignment
        from router_client.policies import Decision

        if self.mode == "twice":
            return Decision([Assignment(0, 0), Assignment(0, 1)])
        if self.mode == "overfill":
            return Decision([Assignment(i, 0) for i in range(len(pool))])
        return Decision([Assignment(len(pool), 0)])


@pytest.mark.parametrize("mode, message", [("twice", "twice"), ("overfill", "more than B"),
                                           ("outside", "not in the pool")])
def test_simulator_rejects_invariant_violations(mode, message):
    trace = Trace("t", np.array([5, 5, 5]), np.array([3, 3, 3]), np.zeros(3, bool),
                  [None] * 3, np.zeros(3))
    with pytest.raises(ContractError, match=message):
        simulate(trace, BrokenPolicy(mode), SimConfig(workers=2, batch=2))


@pytest.mark.parametrize("field, value", [("workers", 0), ("load", 0.0), ("load", "full"),
                                          ("refresh_steps", 0), ("step_cost", (0.0, 0.0))])
def test_config_validation(field, value):
    with pytest.raises(ParameterError, match=field):
        SimConfig(**{field: value})


def test_contended_steps_count_the_steps_where_requests_waited_beyond_the_free_slots():
    # four requests at step 0 on 2 x 1 slots, by hand: step 0, 4 waiting > 2 free (r0 and r1
    # start, r1 ends after its 1 token); step 1, 2 waiting > 1 free (r2 starts, r0 ends);
    # step 2, 1 waiting, 1 free: not contended (r3 starts)
    trace = parse_trace("arrival_s,prompt_tokens,output_tokens\n0,10,2\n0,4,1\n0,6,3\n"
                        "0,5,1\n")
    config = SimConfig(workers=2, batch=1, load=1.0, step_cost=(1.0, 0.5))
    row = simulate(trace, make_policy("ltl"), config).row
    assert row["contended_steps"] == 2


def test_rounds_at_gamma_0_are_counted_and_routed_as_br0():
    """`gamma_zero_rounds` counts BR-H's rounds whose turnover discount came out 0: with
    one-token outputs at backlog every slot turns over each step, every round is one, and the
    whole run is BR-0's to the last field; with long outputs none is; BR-0 has no lookahead
    rounds at all."""
    config = SimConfig(workers=4, batch=8, load="backlog")
    short = synthesize("synth:long:n=400,output_mean=1,output_sigma=0.01")
    br0 = simulate(short, make_policy("br0"), config).row
    brh = simulate(short, make_policy("brh-oracle"), config,
                   OraclePredictor(short.output_tokens)).row
    assert br0["lookahead_rounds"] == br0["gamma_zero_rounds"] == 0
    assert brh["gamma_zero_rounds"] == brh["lookahead_rounds"] > 0
    assert brh["gamma_mean"] == 0.0
    ignored = {"policy", "sim_wall_s", "gamma_mean", "lookahead_rounds", "gamma_zero_rounds",
               "br0_check_rounds"}
    assert {k: v for k, v in brh.items() if k not in ignored} == \
        {k: v for k, v in br0.items() if k not in ignored}
    long = synthesize("synth:long:n=400")
    brh = simulate(long, make_policy("brh-oracle"), config,
                   OraclePredictor(long.output_tokens)).row
    assert brh["lookahead_rounds"] > 0 and brh["gamma_zero_rounds"] <= 1
    assert brh["gamma_mean"] > 0.5
