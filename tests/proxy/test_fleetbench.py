"""bench proxy-ab reads the emulator's step log the way ab counts its rows."""

from __future__ import annotations

import numpy as np
import pytest

from proxy.fleetbench import FleetBenchConfig, format_rows, step_log_summary, step_wall_s
from router_client.traces import Trace


def step(loads, active, tokens, admitted, dt=0.5):
    return {"loads": loads, "active": active, "tokens": tokens, "admitted": admitted, "dt": dt}


def test_window_ends_at_the_last_admission():
    steps = [step([10, 4], [2, 1], 3, 3), step([12, 2], [2, 1], 3, 0),
             step([20, 8], [3, 1], 4, 1), step([22, 0], [3, 0], 3, 0)]  # drain: not counted
    summary = step_log_summary(steps, 0.01)
    assert summary["steps"] == 3 and summary["tokens"] == 10
    assert summary["throughput_tok_s"] == pytest.approx(10 / 1.5)
    # every step at the mean load instead of the maximum: 0.01 * (6 + 10 + 12) / 2 s less
    assert summary["balanced_bound_tok_s"] == pytest.approx(10 / (1.5 - 0.14))
    assert summary["imbalance_maxmin_mean"] == pytest.approx((6 + 10 + 12) / 3)
    assert summary["imbalance_total_mean"] == pytest.approx((6 + 10 + 12) / 3)  # G = 2
    assert summary["running_mean"] == pytest.approx(10 / 3)


def test_empty_log_and_step_estimate():
    assert step_log_summary([], 0.01)["throughput_tok_s"] == 0.0
    trace = Trace("t", np.array([100, 300]), np.array([10, 30]), np.zeros(2, dtype=bool),
                  [None, None])
    config = FleetBenchConfig(batch=4, step_cost=(1e-3, 0.01), time_scale=2.0)
    assert step_wall_s(trace, config) == pytest.approx((1e-3 * 4 * (200 + 10) + 0.01) / 2)


def test_unknown_proxy_policies_are_refused_naming_them(capsys):
    from predictor.cli import main

    assert main(["bench", "proxy-ab", "--trace", "synth:long", "--policies",
                 "br0,brh-hazard,ltl"]) == 2
    err = capsys.readouterr().err
    assert "--policies: brh-hazard" in err and "br0, brh, jsq, rr, ltl, brh-oracle" in err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_brh_through_the_proxy_asks_a_service_that_learns_the_runs_lengths(tmp_path):
    """``brh`` in ``bench proxy-ab``: the service answers the proxy's refreshes and learns
    from what the proxy reports, as complete outputs (the replay's ``ignore_eos`` ends are
    the lengths it chose, not cuts: reported as cuts, the service learned that no request
    ever ends and answered c_hat = H for all); ``brh-oracle`` takes ``max_tokens`` as the
    lengths; each row names its ``ab`` counterpart."""
    import httpx

    from predictor.livesrv import live_server
    from proxy.fleetbench import compare
    from router_client.traces import load_trace

    trace = load_trace("synth:long:n=60,output_mean=30,output_sigma=0.3,prompt_mean=200",
                       "auto", 60)
    with live_server(f"sqlite:///{tmp_path / 'service.db'}") as url:
        config = FleetBenchConfig(workers=2, batch=4, time_scale=4.0, predictor_url=url)
        rows = compare(trace, ["br0", "brh", "brh-oracle"], config, progress=False)
        asked = {"horizon": 80, "estimator": "survival",
                 "items": [{"request_id": "probe", "prompt_tokens": 200,
                            "generated_tokens": 0}]}
        answer = httpx.post(url + "/v1/contributions", json=asked, timeout=10.0).json()
    br0, brh, oracle = rows
    assert [r["ab_policy"] for r in rows] == ["br0", "brh-exactmatch", "brh-oracle"]
    for row in rows:
        assert row["completed"] == 60 and row["failed"] == 0
        assert row["invariants"] == "ok" and not row["errors"]
    assert brh["service_observations"] > 0 and brh["service_drifted"] is False
    assert brh["brh_active"] and oracle["brh_active"]  # routing with predictions at the end
    assert brh["fallback_rounds"] < brh["router_rounds"] and oracle["fallback_rounds"] == 0
    # the lengths were learned: a new request's expected life is near the mean 30, not H
    assert answer["items"][0]["c_hat"] < 50


def test_replayed_prompts_are_distinct_per_request_at_their_exact_length():
    """Two requests of one prompt length must not share a prompt text (the proxy keys a
    request by its text, and the service's ExactMatch would learn from the coincidence)."""
    from proxy.loadgen import token_ids

    prompts = [tuple(token_ids(64, i)) for i in (0, 1, 29_999, 30_000, 30_001, 123_456)]
    assert len(set(prompts)) == len(prompts) and all(len(p) == 64 for p in prompts)
    assert [len(token_ids(n, 5)) for n in (0, 1, 2, 3)] == [0, 1, 2, 3]


def test_the_table_shows_each_sides_share_of_its_bound_and_the_pool():
    row = {"policy": "brh-oracle", "throughput_tok_s": 2900.0, "balanced_bound_tok_s": 3000.0,
           "ratio": 1.01, "imbalance_maxmin_mean": 22000.0, "round_pool_mean": 31.8,
           "ab_throughput_tok_s": 2800.0, "ab_ratio": 1.03, "ab_imbalance_maxmin_mean": 20000.0,
           "ab_bound_share": 0.9723, "agreement": -0.0156, "failed": 0, "wall_s": 281.0}
    line = format_rows([row]).splitlines()[1].split()
    assert line[0] == "brh-oracle"
    assert line[4:6] == ["96.67", "31.8"]  # 2900 / 3000, the mean pool a round saw
    assert line[9] == "97.23"  # ab's share
