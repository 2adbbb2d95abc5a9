"""bench proxy-ab reads the emulator's step log the way ab counts its rows."""

from __future__ import annotations

import numpy as np
import pytest

from proxy.fleetbench import FleetBenchConfig, step_log_summary, step_wall_s
from router_client.traces import Trace


def step(loads, active, tokens, admitted, dt=0.5):
    return {"loads": loads, "active": active, "tokens": tokens, "admitted": admitted, "dt": dt}


def test_window_ends_at_the_last_admission():
    steps = [step([10, 4], [2, 1], 3, 3), step([12, 2], [2, 1], 3, 0),
             step([20, 8], [3, 1], 4, 1), step([22, 0], [3, 0], 3, 0)]  # drain: not counted
    summary = step_log_summary(steps)
    assert summary["steps"] == 3 and summary["tokens"] == 10
    assert summary["throughput_tok_s"] == pytest.approx(10 / 1.5)
    assert summary["imbalance_maxmin_mean"] == pytest.approx((6 + 10 + 12) / 3)
    assert summary["imbalance_total_mean"] == pytest.approx((6 + 10 + 12) / 3)  # G = 2
    assert summary["running_mean"] == pytest.approx(10 / 3)


def test_empty_log_and_step_estimate():
    assert step_log_summary([])["throughput_tok_s"] == 0.0
    trace = Trace("t", np.array([100, 300]), np.array([10, 30]), np.zeros(2, dtype=bool),
                  [None, None])
    config = FleetBenchConfig(batch=4, step_cost=(1e-3, 0.01), time_scale=2.0)
    assert step_wall_s(trace, config) == pytest.approx((1e-3 * 4 * (200 + 10) + 0.01) / 2)


def test_unknown_proxy_policies_are_refused_naming_them(capsys):
    from predictor.cli import main

    assert main(["bench", "proxy-ab", "--trace", "synth:long", "--policies",
                 "br0,brh-oracle,ltl"]) == 2
    err = capsys.readouterr().err
    assert "--policies: brh-oracle" in err and "br0, brh, jsq, rr, ltl" in err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_brh_through_the_proxy_asks_a_fresh_service_that_learns_from_the_run():
    """``brh`` in ``bench proxy-ab``: a fresh service started for the run answers the proxy's
    refreshes and learns from what the proxy reports; the row compares it with ab's BR-H with
    the service's auto estimator."""
    from proxy.fleetbench import compare
    from router_client.traces import load_trace

    trace = load_trace("synth:long:n=60,output_mean=40,output_sigma=0.5,prompt_mean=200",
                       "auto", 60)
    config = FleetBenchConfig(workers=2, batch=4, time_scale=4.0)
    rows = compare(trace, ["br0", "brh"], config, progress=False)
    br0, brh = rows
    assert br0["ab_policy"] == "br0" and brh["ab_policy"] == "brh-exactmatch"
    assert brh["completed"] == br0["completed"] == 60 and brh["failed"] == 0
    assert brh["invariants"] == "ok" and not brh["errors"]
    assert brh["service_observations"] > 0 and brh["service_drifted"] is False
    assert brh["brh_active"]  # it routed with the service's answers at the end
    assert brh["fallback_rounds"] < brh["router_rounds"]
