"""Tuning: offline (``balanceroute tune``), over REST from stored observations, and the
recommendation reaching routers."""

import dataclasses
import json
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from predictor.app import create_app
from predictor.cli import main
from predictor.settings import Settings
from predictor.tuning import (
    DEFAULT_GRID,
    GRIDS,
    Candidate,
    _beats,
    _choose,
    candidate_of,
    choose,
    chosen_row,
    parse_grid,
    points_of,
    recommendation_of,
    replay,
    tune,
)
from router_client.admission import TURNOVER, BalanceRouteParams
from router_client.client import RouterClient, RouterConfig
from router_client.errors import ParameterError
from router_client.predictors import Prediction
from router_client.simulator import SimConfig
from router_client.synth import synthesize

SMALL_GRID = (Candidate("br0"), Candidate("brh", 20, 8.0, 0.9))


def test_tuning_uses_only_the_past():
    """Changing every request after the split leaves the ranking and the advice unchanged."""
    trace = synthesize("synth:templated:n=600,seed=4")
    config = SimConfig(workers=2, batch=8, load="backlog")
    first = tune(trace, config, grid=SMALL_GRID, holdout=0.5)
    later = np.arange(len(trace)) >= 300
    changed = dataclasses.replace(
        trace, output_tokens=np.where(later, trace.output_tokens * 3, trace.output_tokens))
    second = tune(changed, config, grid=SMALL_GRID, holdout=0.5)
    for a, b in zip(first.rows, second.rows, strict=True):
        assert {k: v for k, v in a.items() if k != "sim_wall_s"} == {
            k: v for k, v in b.items() if k != "sim_wall_s"}
    assert first.recommendation == second.recommendation
    assert first.rows[0]["requests"] == 300
    assert [r["requests"] for r in first.evaluation] == [300] * len(first.evaluation)
    assert first.evaluation != second.evaluation  # the held-out window did change


def test_br0_unless_brh_clearly_wins():
    trace = synthesize("synth:long:n=300,seed=1")
    config = SimConfig(workers=2, batch=8, load="backlog")
    result = tune(trace, config, grid=SMALL_GRID, min_gain=0.5)  # an impossible margin
    assert result.recommendation == {"policy": "br0"}
    assert {r["setting"] for r in result.rows} == {"br0", "brh H=20 beta=8 gamma=0.9"}


def test_grid_validation():
    with pytest.raises(ParameterError, match=r"grid\[0\]"):
        parse_grid([{"beta": 10}])
    with pytest.raises(ParameterError, match="gamma"):
        parse_grid([{"horizon": 10, "beta": 5, "gamma": 2}])
    with pytest.raises(ParameterError, match="gamma"):
        parse_grid([{"horizon": 10, "gamma": "slow"}])


def test_turnover_gamma_in_the_grid_and_the_recommendation():
    grid = parse_grid([{"horizon": 20, "gamma": "turnover"}])
    assert grid[1] == Candidate("brh", 20, None, "turnover")
    assert grid[1].label == "brh H=20 beta=G gamma=turnover"
    assert grid[1].params(BalanceRouteParams(gamma=0.5)).gamma is None
    assert recommendation_of(grid[1], "exact_match") == {
        "policy": "brh", "horizon": 20, "beta": None, "gamma": "turnover",
        "estimator": "exact_match", "learned_short_pool": False}
    trace = synthesize("synth:long:n=300,seed=1")
    result = tune(trace, SimConfig(workers=2, batch=8, load="backlog"), grid=grid)
    row = next(r for r in result.rows if r["policy"] != "br0")
    assert row["gamma"] == "turnover" and 0.5 <= row["gamma_mean"] < 1.0


def test_a_setting_that_raises_the_imbalance_is_not_recommended():
    def row(policy, throughput, imbalance, gamma=0.86, bound=1100.0):
        return {"policy": policy, "horizon": 80, "beta": None, "gamma": gamma,
                "throughput_tok_s": throughput, "balanced_bound_tok_s": bound,
                "imbalance_maxmin_mean": imbalance}

    br0 = row("br0", 1000.0, 100.0)
    deferring = row("brh-exactmatch", 1013.0, 155.0, 0.97)  # first by throughput
    balanced = row("brh-exactmatch", 1012.0, 73.0)
    assert _choose([deferring, balanced, br0], 0.001) == Candidate("brh", 80, None, 0.86)
    slight = row("brh-exactmatch", 1000.5, 73.0)  # balanced, but gains less than 0.1%
    assert _choose([deferring, slight, br0], 0.001) == Candidate("br0")
    assert _choose([deferring, br0], 0.001) == Candidate("br0")
    # over two windows of the past it must win in each: +5% then -1% is not enough
    windows = [{"throughput_tok_s": 1050.0, "balanced_bound_tok_s": 1100.0,
                "imbalance_maxmin_mean": 80.0},
               {"throughput_tok_s": 990.0, "balanced_bound_tok_s": 1100.0,
                "imbalance_maxmin_mean": 90.0}]
    br0["windows"] = [{"throughput_tok_s": 1000.0, "balanced_bound_tok_s": 1100.0,
                       "imbalance_maxmin_mean": 100.0}] * 2
    assert _choose([{**balanced, "windows": windows}, br0], 0.001) == Candidate("br0")
    windows[1]["throughput_tok_s"] = 1002.0
    assert _choose([{**balanced, "windows": windows}, br0], 0.001) == Candidate(
        "brh", 80, None, 0.86)


def test_a_gain_from_the_work_left_after_the_window_is_not_recommended():
    """+1.2% tok/s with a bound 1.2% higher (the window held lighter work: heavy requests
    left for the drain) is no better routing: BR-0. The same tok/s on BR-0's bound is."""
    def row(policy, throughput, bound, imbalance=80.0):
        return {"policy": policy, "horizon": 80, "beta": None, "gamma": 0.86,
                "throughput_tok_s": throughput, "balanced_bound_tok_s": bound,
                "imbalance_maxmin_mean": imbalance}

    br0 = row("br0", 1000.0, 1100.0, 100.0)
    deferring = row("brh-exactmatch", 1012.0, 1113.2)  # share 1012 / 1113.2 = BR-0's
    assert _choose([deferring, br0], 0.001) == Candidate("br0")
    routing = row("brh-exactmatch", 1012.0, 1100.0)
    assert _choose([deferring, routing, br0], 0.001) == Candidate("brh", 80, None, 0.86)
    # a better share with less throughput (the window held heavier work) is not taken either
    heavier = row("brh-exactmatch", 995.0, 1080.0)
    assert _choose([heavier, br0], 0.001) == Candidate("br0")


def test_tuning_replays_the_past_in_windows_each_warmed_on_the_ones_before():
    trace = synthesize("synth:templated:n=1200,seed=4")
    result = tune(trace, SimConfig(workers=2, batch=8, load="backlog"), grid=SMALL_GRID,
                  windows=2)
    for row in result.rows:
        assert [w["requests"] for w in row["windows"]] == [600, 600]
        assert row["requests"] == 1200
        assert row["throughput_tok_s"] == pytest.approx(
            np.mean([w["throughput_tok_s"] for w in row["windows"]]))
        assert row["bound_share"] == pytest.approx(np.mean(
            [w["throughput_tok_s"] / w["balanced_bound_tok_s"] for w in row["windows"]]))
    shares = [row["bound_share"] for row in result.rows]
    assert shares == sorted(shares, reverse=True)  # best routing first
    single = tune(trace.head(400), SimConfig(workers=2, batch=8, load="backlog"),
                  grid=SMALL_GRID, windows=2)  # too few requests for two windows
    assert all("windows" not in row for row in single.rows)


def test_the_pick_is_confirmed_on_a_window_that_did_not_rank_it():
    """``confirm``: with two windows the grid is ranked on the first alone (the same rows as
    tuning on it in one window) and its pick recommended only if it wins again on the second:
    BR-0 and the pick replayed there, on requests that played no part in picking it."""
    grid = (Candidate("br0"), Candidate("brh", 20, 8.0, 0.9), Candidate("brh", 80, None, 0.86))
    config = SimConfig(workers=4, batch=8, load="backlog")

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "sim_wall_s"} for r in rows]

    for spec, confirmed in (("synth:long:n=1600,seed=1", True),
                            ("synth:templated:n=1600,seed=1", False)):
        trace = synthesize(spec)
        result = tune(trace, config, grid=grid, confirm=True)
        alone = tune(trace.head(800), config, grid=grid, windows=1)
        assert strip(result.rows) == strip(alone.rows)  # ranked on the first window only
        assert alone.recommendation["policy"] == "brh"  # the first window picks BR-H
        base, pick = result.confirmation
        assert (base["policy"], base["requests"], pick["requests"]) == ("br0", 800, 800)
        assert pick["horizon"] == alone.recommendation["horizon"]
        assert _beats(pick, base, 0.001) is confirmed
        # the pick replayed on the second window with the learner warmed on the first
        again = replay(trace.take(np.arange(800, 1600)), "brh-exactmatch",
                       candidate_of(pick).params(BalanceRouteParams()), config,
                       warm=trace.head(800))
        assert again["throughput_tok_s"] == pick["throughput_tok_s"]
        assert result.recommendation == (alone.recommendation if confirmed
                                         else {"policy": "br0"})
    # the default ranks and gates on both windows, with nothing to confirm
    both = tune(trace, config, grid=grid)
    assert both.confirmation == [] and all(len(r["windows"]) == 2 for r in both.rows)


def test_a_part_of_the_grid_is_chosen_from_the_full_grids_rows():
    """``choose`` over some of a tuning's rows gives what tuning over that part of the grid
    alone recommends, from the same rows: each candidate's replays do not depend on the
    others (what tools/tuned_eval.py --subgrid relies on)."""
    grid = (Candidate("br0"), Candidate("brh", 20, 8.0, 0.9), Candidate("brh", 80, None, 0.86),
            Candidate("brh", 80, None, TURNOVER))
    part = (grid[0], grid[3])
    config = SimConfig(workers=4, batch=8, load="backlog")

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "sim_wall_s"} for r in rows]

    trace = synthesize("synth:long:n=1600,seed=1")
    full = tune(trace, config, grid=grid)
    alone = tune(trace, config, grid=part)
    kept = [r for r in full.rows if candidate_of(r) in {candidate_of(a) for a in alone.rows}]
    assert strip(kept) == strip(alone.rows) and len(kept) == 2
    assert choose(kept) == candidate_of(alone.recommendation)
    assert choose(full.rows) == candidate_of(full.recommendation)
    # here the full grid's pick is a fixed-discount point and the part's is BR-0: the
    # turnover point wins the first window, not the second
    assert (full.recommendation["horizon"], alone.recommendation) == (20, {"policy": "br0"})
    # the ranking, not the order given, decides; rows that tie on every figure keep the order
    assert choose(list(reversed(full.rows))) == choose(full.rows)
    br0 = next(r for r in full.rows if r["policy"] == "br0")

    def ahead(row):  # 1% more throughput against the same bound
        return {**row, "throughput_tok_s": row["throughput_tok_s"] * 1.01,
                "bound_share": row["bound_share"] * 1.01}

    better = {**ahead(br0), "policy": "brh", "horizon": 80, "beta": None, "gamma": TURNOVER,
              "windows": [ahead(w) for w in br0["windows"]]}
    tied = [{**better, "learned_short_pool": pool} for pool in (False, True)]
    assert choose([br0, *tied]).learned_short_pool is False
    assert choose([br0, *reversed(tied)]).learned_short_pool is True


def test_tuning_ranks_each_learner_and_names_the_one_it_picks():
    """With several learners every BR-H setting is replayed with each (BR-0 once, naming
    none); each learner's rows are those of tuning with that learner alone, and the
    recommendation is the pick over all of them, with its own learner."""
    trace = synthesize("synth:templated:n=800,seed=2")
    config = SimConfig(workers=4, batch=8, load="backlog")
    grid = (Candidate("br0"), Candidate("brh", 20, 8.0, 0.9),
            Candidate("brh", 80, None, TURNOVER))
    learners = ["exact_match", "hazard"]
    both = tune(trace, config, estimator=learners, grid=grid, min_gain=0.0, holdout=0.25)
    assert sorted((r["policy"], r["estimator"]) for r in both.rows) == [
        ("br0", None), *sorted((f"brh-{n.replace('_', '')}", n)
                               for n in learners for _ in (1, 2))]

    def figures(rows):
        return sorted((r["estimator"] or "", r["horizon"], r["throughput_tok_s"],
                       r["imbalance_maxmin_mean"]) for r in rows)

    def brh_figures(rows):  # by setting, whichever learner replayed it
        return {candidate_of(r): (r["throughput_tok_s"], r["imbalance_maxmin_mean"])
                for r in rows if r["policy"] != "br0"}

    picks = {}
    for learner in learners:
        alone = tune(trace, config, estimator=learner, grid=grid, min_gain=0.0, holdout=0.25)
        mine = [r for r in both.rows if r["estimator"] in (None, learner)]
        assert figures(mine) == figures(alone.rows)
        assert {r["setting"] for r in mine} == {
            r["setting"] + ("" if r["policy"] == "br0" else f" estimator={learner}")
            for r in alone.rows}
        assert recommendation_of(choose(mine, 0.0), learner) == alone.recommendation
        picks[learner] = brh_figures(alone.rows)
    assert picks["hazard"].keys() == picks["exact_match"].keys()
    assert all(picks["hazard"][c] != picks["exact_match"][c] for c in picks["hazard"])
    row = chosen_row(both.rows, 0.0)
    # here the second learner's row is ranked first, and it is the pick
    assert row is not None and row["policy"] != "br0" and row["estimator"] == "hazard"
    assert both.recommendation == recommendation_of(candidate_of(row), row["estimator"])
    assert [r["estimator"] for r in both.evaluation] == [None, row["estimator"]]
    # the pick's learner, whichever ranks it: a row of the second learner ahead is picked
    br0 = next(r for r in both.rows if r["policy"] == "br0")
    ahead = {**br0, "policy": "brh", "horizon": 20, "beta": 8.0, "gamma": 0.9,
             "learned_short_pool": None, "estimator": "hazard",
             "throughput_tok_s": br0["throughput_tok_s"] * 1.01,
             "bound_share": br0["bound_share"] * 1.01}
    assert chosen_row([br0, {**ahead, "estimator": "exact_match",
                             "bound_share": br0["bound_share"] * 1.005}, ahead]) is ahead
    with pytest.raises(ParameterError, match="estimator"):
        tune(trace, config, estimator=[], grid=grid)
    # confirmed on the last window with the pick's own learner (two windows of 500)
    longer = synthesize("synth:templated:n=1000,seed=2")
    confirmed = tune(longer, config, estimator=learners, grid=grid, min_gain=0.0,
                     confirm=True)
    pick = chosen_row(confirmed.rows, 0.0)
    assert pick is not None and len(confirmed.confirmation) == 2
    assert [r["estimator"] for r in confirmed.confirmation] == [None, pick["estimator"]]
    assert confirmed.confirmation[1]["requests"] == 500


def test_tune_command_ranks_several_learners(tmp_path, capsys):
    """``tune --estimator exact_match,hazard``: the default grid's distinct BR-H settings once
    per learner (its point that states the base's short-pool rule is the plain point: not
    replayed again), BR-0 once; rows and printout name the learner; an unknown name is an
    argument error before any replay."""
    out = tmp_path / "tune.json"
    assert main(["tune", "--trace", "synth:templated:n=300,seed=2", "--workers", "2",
                 "--batch", "8", "--load", "backlog", "--estimator", "exact_match, hazard",
                 "--quiet", "--json", str(out)]) == 0
    shown = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    distinct = {c.params(BalanceRouteParams()) for c in DEFAULT_GRID if c.policy == "brh"}
    assert len(rows) == 1 + 2 * len(distinct) == 9
    assert sorted(r["estimator"] or "" for r in rows) == [""] + ["exact_match"] * 4 + [
        "hazard"] * 4
    assert "estimator exact_match,hazard" in shown
    assert shown.count("estimator=hazard") == 4 and shown.count("estimator=exact_match") == 4
    with pytest.raises(SystemExit):
        main(["tune", "--trace", "synth:templated:n=300,seed=2", "--estimator", "hazard,nope"])
    assert "nope: not an estimator" in capsys.readouterr().err


def test_tune_command_confirm_prints_the_confirmation(tmp_path, capsys, monkeypatch):
    """``tune --confirm`` reaches :func:`tune` and prints the pick's replay on the last window
    against BR-0's and the verdict; ``--json`` carries both rows (the real ``tune``, with the
    small grid of the confirmation test so that the run stays short)."""
    import predictor.tuning as tuning

    grid = (Candidate("br0"), Candidate("brh", 20, 8.0, 0.9), Candidate("brh", 80, None, 0.86))
    real, seen = tuning.tune, []

    def small(trace, config, **kwargs):
        seen.append(kwargs["confirm"])
        return real(trace, config, **{**kwargs, "grid": grid})

    monkeypatch.setattr(tuning, "tune", small)
    out = tmp_path / "tune.json"
    assert main(["tune", "--trace", "synth:long:n=1600,seed=1", "--workers", "4", "--batch", "8",
                 "--load", "backlog", "--confirm", "--quiet", "--json", str(out)]) == 0
    assert seen == [True]
    printed = capsys.readouterr().out
    base, pick = json.loads(out.read_text())["confirmation"]
    line = next(x for x in printed.splitlines() if x.startswith("confirmation"))
    assert line.startswith("confirmation on the last window of the past (800 requests): "
                           f"{pick['setting']} ")
    assert f"{pick['bound_share']:.2%} of bound against {base['bound_share']:.2%}" in line
    assert line.endswith(": confirmed")  # the case the confirmation test works through


def test_tune_command(tmp_path, capsys):
    out = tmp_path / "tune.json"
    assert main(["tune", "--trace", "synth:templated:n=400,seed=2", "--workers", "2",
                 "--batch", "8", "--load", "backlog", "--holdout", "0.25", "--quiet",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "never filled" not in printed  # a backlog: requests always wait
    result = json.loads(out.read_text())
    # the table and the held-out lines show each row's share of its balanced bound
    assert "of bound" in printed.splitlines()[1]
    for row in result["evaluation"]:
        assert f"{row['bound_share']:.2%} of bound" in printed
    assert result["note"] is None
    assert all(row["contended_steps"] > 0 for row in result["rows"])
    assert result["recommendation"]["policy"] in ("br0", "brh")
    # one row per distinct routing: one of the grid's two explicit short-pool rules is the
    # base's and shares its row with the point that leaves the rule to the base
    assert DEFAULT_GRID == GRIDS["turnover"]
    distinct = {c.params(BalanceRouteParams()) for c in DEFAULT_GRID}
    assert len(result["rows"]) == len(distinct) == len(DEFAULT_GRID) - 1
    assert result["evaluation"]
    settings = {r["setting"] for r in result["rows"]}
    assert {"br0", "brh H=80 beta=G gamma=turnover", "brh H=200 beta=G gamma=turnover",
            "brh H=80 beta=43 gamma=turnover"} <= settings
    assert all(s == "br0" or "gamma=turnover" in s for s in settings)


def test_tune_command_wide_grid(tmp_path, capsys):
    """``--grid wide`` replays the turnover points and the fixed discounts."""
    out = tmp_path / "tune.json"
    assert main(["tune", "--trace", "synth:templated:n=200,seed=2", "--workers", "2",
                 "--batch", "8", "--load", "backlog", "--quiet", "--grid", "wide",
                 "--json", str(out)]) == 0
    settings = [r["setting"] for r in json.loads(out.read_text())["rows"]]
    wide = {c.params(BalanceRouteParams()) for c in GRIDS["wide"]}
    assert len(settings) == len(wide) == len(set(settings))
    assert {"brh H=20 beta=G gamma=0.86", "brh H=80 beta=43 gamma=0.86",
            "brh H=80 beta=G gamma=turnover"} <= set(settings)
    assert set(GRIDS["turnover"]) < set(GRIDS["wide"])
    with pytest.raises(SystemExit):
        main(["tune", "--trace", "synth:templated:n=200,seed=2", "--grid", "narrow"])


def wait(client, path, seconds=120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        job = client.get(path).json()
        if job["status"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    pytest.fail(f"{path} did not finish")


def _observations(trace) -> list[dict]:
    """The trace's requests as the body of ``POST /v1/observations``."""
    return [{"request_id": f"r{i}", "prompt_key": k, "prompt_tokens": int(p),
             "output_tokens": int(o)}
            for i, (k, p, o) in enumerate(zip(trace.prompt_keys, trace.prompt_tokens,
                                              trace.output_tokens, strict=True))]


def test_rest_tuning_publishes_its_recommendation(tmp_path):
    trace = synthesize("synth:templated:n=300,seed=5")
    observations = _observations(trace)
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    with TestClient(create_app(Settings(database_url=url))) as client:
        assert client.get("/v1/status").json()["recommendation"] is None
        client.post("/v1/observations", json={"observations": observations}).raise_for_status()
        bad = client.post("/v1/tunings", json={"estimator": "nope"})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "estimator"]
        bad = client.post("/v1/tunings", json={"grid": [
            {"horizon": 80, "gamma": "turnover", "learned_short_pool": "yes"}]})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == [
            "body", "grid", 0, "learned_short_pool"]
        bad = client.post("/v1/tunings", json={"grid": "narrow"})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "grid"]
        assert "known: turnover, wide" in bad.json()["detail"][0]["msg"]
        for grid in ([], 5):  # an empty list is not taken for the default
            bad = client.post("/v1/tunings", json={"grid": grid})
            assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "grid"]
        schema = client.get("/openapi.json").json()["components"]["schemas"]["TuningIn"]
        names = [a["enum"] for a in schema["properties"]["grid"]["anyOf"] if "enum" in a]
        assert names == [list(GRIDS)]  # the names a client may send are the built-in grids
        bad = client.post("/v1/tunings", json={"confirm": "yes"})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "confirm"]
        started = client.post("/v1/tunings", json={
            "workers": [2], "batch": 8, "load": "backlog", "requests": 250,
            "grid": [{"horizon": 20, "beta": 8, "gamma": 0.9, "learned_short_pool": None}],
            "min_gain": 0.5})
        assert started.status_code == 202
        job = wait(client, f"/v1/tunings/{started.json()['id']}")
        assert job["status"] == "done", job["error"]
        assert job["results"]["recommendation"] == {"policy": "br0"}
        assert [r["requests"] for r in job["results"]["rows"]] == [250, 250]
        assert job["results"]["confirmation"] == []  # one window: none kept back
        # the null rule is the service's, and the row says which it replayed
        assert [r["learned_short_pool"] for r in job["results"]["rows"]
                if r["policy"] != "br0"] == [BalanceRouteParams().learned_short_pool]
        status = client.get("/v1/status").json()
        assert status["recommendation"]["policy"] == "br0"
        answer = client.post("/v1/contributions", json={
            "items": [{"request_id": "x", "generated_tokens": 0}]}).json()
        assert answer["recommendation"]["policy"] == "br0"
        assert [j["id"] for j in client.get("/v1/tunings").json()] == [job["id"]]
        assert client.get(f"/v1/ab-comparisons/{job['id']}").status_code == 404
    with TestClient(create_app(Settings(database_url=url))) as client:  # survives a restart
        assert client.get("/v1/status").json()["recommendation"]["policy"] == "br0"


def test_rest_tuning_refuses_a_learner_the_service_does_not_run(tmp_path):
    """A recommendation naming an estimator the service does not run would leave routers
    asking for predictions it cannot give: such a tuning is a 422 at ``body.estimator``."""
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    settings = Settings(database_url=url, estimators="survival,exact_match")
    with TestClient(create_app(settings)) as client:
        for names in ("hazard", ["exact_match", "hazard"]):
            refused = client.post("/v1/tunings", json={"estimator": names})
            assert refused.status_code == 422, names
            detail = refused.json()["detail"][0]
            assert detail["loc"] == ["body", "estimator"]
            assert detail["msg"].startswith("hazard: not run by this service")
            assert "it runs survival, exact_match" in detail["msg"]
        assert client.get("/v1/tunings").json() == []  # nothing queued
        started = client.post("/v1/tunings", json={"estimator": ["exact_match"]})
        assert started.status_code == 202
    # the default left out where the service does not run it: the service's auto estimator
    url = f"sqlite:///{tmp_path / 'survival.db'}"
    with TestClient(create_app(Settings(database_url=url, estimators="survival"))) as client:
        started = client.post("/v1/tunings", json={})
        assert started.status_code == 202
        job = client.get(f"/v1/tunings/{started.json()['id']}").json()
        assert job["request"]["estimator"] == "survival"
        refused = client.post("/v1/tunings", json={"estimator": "exact_match"})
        assert refused.status_code == 422  # named, not defaulted: refused


def test_rest_tuning_passes_confirm_and_the_grid_to_tune(tmp_path, monkeypatch):
    """``"confirm": true`` in the body reaches :func:`tune` (a spy on the real function);
    absent, the default rule runs; ``"grid": "wide"`` stands for the wide grid's points; a
    list of estimators is ranked learner by learner."""
    import predictor.tuning as tuning

    seen = []
    learners = []
    real = tuning.tune

    def spy(*a, **k):
        seen.append((k.get("confirm"), k["grid"]))
        learners.append(k["estimator"])
        return real(*a, **k)

    monkeypatch.setattr(tuning, "tune", spy)
    trace = synthesize("synth:templated:n=120,seed=5")
    observations = _observations(trace)
    url = f"sqlite:///{tmp_path / 'confirm.db'}"
    small = [{"horizon": 20, "beta": 8, "gamma": 0.9}]
    with TestClient(create_app(Settings(database_url=url))) as client:
        client.post("/v1/observations", json={"observations": observations}).raise_for_status()
        for bad_names, said in ((["exact_match", "nope"], "unknown estimator 'nope'"),
                                ([], "a non-empty list"), (5, "a non-empty list")):
            bad = client.post("/v1/tunings", json={"estimator": bad_names})
            assert bad.status_code == 422
            (detail,) = bad.json()["detail"]  # one error, at the field
            assert detail["loc"] == ["body", "estimator"] and said in detail["msg"]
        several = {"estimator": ["exact_match", "hazard"]}
        for body in ({"confirm": True}, {}, {"grid": "wide"}, several, {"grid": None}):
            started = client.post("/v1/tunings", json={
                "workers": [2], "batch": 8, "load": "backlog", "requests": 100,
                "grid": small, **body})
            job = wait(client, f"/v1/tunings/{started.json()['id']}")
            assert job["status"] == "done", job["error"]
            if body is several:
                assert sorted(r["estimator"] or "" for r in job["results"]["rows"]) == [
                    "", "exact_match", "hazard"]
                assert job["request"]["estimator"] == ["exact_match", "hazard"]
        # null is the default grid, and the stored request says which points that was
        assert [{k: p[k] for k in ("horizon", "beta", "gamma", "learned_short_pool")}
                for p in job["request"]["grid"]] == points_of(DEFAULT_GRID)
    assert [c for c, _ in seen] == [True, False, False, False, False]
    assert [g for _, g in seen] == [parse_grid(small)] * 2 + [GRIDS["wide"],
                                                              parse_grid(small), DEFAULT_GRID]
    assert learners == ["exact_match"] * 3 + [["exact_match", "hazard"], "exact_match"]


class Advising:
    """A predictor whose answers carry a recommendation."""

    name = "advising"

    def __init__(self, advice):
        self.advice = advice

    def predict(self, batch, horizon):
        return Prediction(np.full(len(batch.request_ids), 10.0), recommendation=self.advice)

    def observe(self, finished):
        pass


def test_router_client_adopts_the_recommendation_at_a_refresh():
    from prometheus_client import generate_latest

    from router_client.fallback import RouterMetrics

    def gauge() -> str:
        return next(line for line in generate_latest(metrics.registry).decode().splitlines()
                    if line.startswith("balanceroute_router_brh_active "))

    advice = {"policy": "brh", "horizon": 30, "beta": 12.0, "gamma": 0.9,
              "estimator": "exact_match"}
    predictor = Advising(advice)
    own = BalanceRouteParams(short_pool="lpt", fit_horizon=8.0, stage2_order="margin")
    metrics = RouterMetrics()
    router = RouterClient(RouterConfig(workers=2, capacity=4, params=own), predictor,
                          metrics=metrics)
    assert router.policy.params.horizon == 80
    router.on_prefilled("a", 100, now=0.0)
    router.tick(now=0.0)
    assert router.adopted == advice
    assert (router.policy.params.horizon, router.policy.params.beta,
            router.policy.params.gamma) == (30, 12.0, 0.9)
    assert router.predictions.horizon == 30
    assert router.use_predictions and gauge().endswith(" 1.0")
    predictor.advice = {"policy": "br0"}
    for step in range(1, 11):
        router.tick(now=float(step))
    assert router.policy.name == "br0" and not router.policy.needs_predictions
    # BR-0 on the service's advice: BR-H is not using predictions (it still asks, for the
    # next advice), and the gauge says so
    assert not router.use_predictions and gauge().endswith(" 0.0")
    assert router.controller.mode == "brh"  # no fallback: the service is healthy
    predictor.advice = {"policy": "teleport"}
    for step in range(11, 21):
        router.tick(now=float(step))
    assert router.policy.name == "br0"  # an advice it cannot follow is ignored
    predictor.advice = {"policy": "brh", "horizon": 80, "beta": None, "gamma": "turnover",
                        "estimator": "exact_match"}
    for step in range(21, 31):
        router.tick(now=float(step))
    assert router.policy.name == "brh" and router.policy.params.gamma is None
    assert router.use_predictions and gauge().endswith(" 1.0")
    # after BR-0 and back, BR-H keeps the router's own settings the advice does not name
    kept = router.policy.params
    assert (kept.short_pool, kept.fit_horizon, kept.stage2_order) == ("lpt", 8.0, "margin")
    assert not kept.learned_short_pool  # an advice without the key: the router's own rule
    predictor.advice = {**predictor.advice, "learned_short_pool": True}
    for step in range(31, 41):
        router.tick(now=float(step))
    assert router.policy.params.learned_short_pool
    assert router.policy.params.short_pool == "lpt"  # still the router's own rule for it
    predictor.advice = {**predictor.advice, "learned_short_pool": "yes"}
    for step in range(41, 51):
        router.tick(now=float(step))
    assert router.policy.params.learned_short_pool  # a malformed advice is ignored


def test_the_short_pool_rule_in_the_grid_the_choice_and_the_recommendation():
    """A grid point places short pools by the learned law's lookahead (true), as BR-0 places
    them (false) or by the base's rule (absent or null); tuning replays each distinct routing
    once, and its choice and recommendation carry the rule it measured."""
    grid = parse_grid([{"horizon": 80, "gamma": "turnover", "learned_short_pool": True},
                       {"horizon": 80, "gamma": "turnover", "learned_short_pool": False},
                       {"horizon": 80, "gamma": "turnover", "learned_short_pool": None},
                       {"horizon": 80, "gamma": "turnover"}])
    assert grid[1] == Candidate("brh", 80, None, "turnover", learned_short_pool=True)
    assert grid[2].learned_short_pool is False
    assert grid[3].learned_short_pool is None and grid[4] == grid[3]
    assert grid[1].label == "brh H=80 beta=G gamma=turnover short-pool=lookahead"
    assert grid[2].label == "brh H=80 beta=G gamma=turnover short-pool=br0"
    assert grid[3].label == "brh H=80 beta=G gamma=turnover"
    for base_rule in (True, False):
        base = BalanceRouteParams(learned_short_pool=base_rule)
        assert grid[1].params(base).learned_short_pool is True
        assert grid[2].params(base).learned_short_pool is False
        assert grid[3].params(base).learned_short_pool is base_rule
        # the recommendation states the rule that was replayed, never "the router's own"
        assert recommendation_of(grid[3], "hazard", base)["learned_short_pool"] is base_rule
    assert recommendation_of(grid[1], "hazard")["learned_short_pool"] is True
    assert recommendation_of(grid[2], "hazard")["learned_short_pool"] is False
    with pytest.raises(ParameterError, match=r"grid\[0\].learned_short_pool"):
        parse_grid([{"horizon": 80, "gamma": 0.9, "learned_short_pool": "yes"}])
    # the default grid holds both rules, whichever the base's is
    for base_rule in (True, False):
        base = BalanceRouteParams(learned_short_pool=base_rule)
        rules = {c.params(base).learned_short_pool for c in DEFAULT_GRID if c.policy == "brh"}
        assert rules == {True, False}

    def row(pool, throughput):
        return {"policy": "brh-hazard", "horizon": 80, "beta": None, "gamma": "turnover",
                "learned_short_pool": pool, "throughput_tok_s": throughput,
                "balanced_bound_tok_s": 1100.0, "imbalance_maxmin_mean": 80.0}

    br0 = {**row(False, 1000.0), "policy": "br0", "imbalance_maxmin_mean": 100.0}
    assert _choose([row(True, 1010.0), row(False, 1005.0), br0], 0.001) == grid[1]
    assert _choose([row(False, 1010.0), row(True, 1005.0), br0], 0.001) == grid[2]
    assert _choose([row(None, 1010.0), br0], 0.001) == grid[3]
    # replayed: a short pool under load 0.8 is where the two rules part; the null point is
    # the base's rule (here false), the same routing as grid[2], so it is not replayed again
    trace = synthesize("synth:templated:n=600,seed=3")
    result = tune(trace, SimConfig(workers=4, batch=8, load=0.8), estimator="hazard",
                  grid=grid, windows=1, base=BalanceRouteParams(learned_short_pool=False))
    rows = {r["setting"]: r for r in result.rows}
    assert sorted(rows) == sorted(["br0", grid[1].label, grid[2].label])
    assert rows[grid[1].label]["learned_short_pool"] is True
    assert rows[grid[2].label]["learned_short_pool"] is False
    assert (rows[grid[1].label]["imbalance_maxmin_mean"]
            != rows[grid[2].label]["imbalance_maxmin_mean"])


def test_a_fleet_that_never_filled_is_pointed_out(capsys):
    """Tuning on a stretch where every request finds a slot at once gives rows that tie
    (BR-H places as BR-0 in a short pool): the command says why instead of leaving a user
    to read the tie as evidence."""
    assert main(["tune", "--trace", "synth:templated:n=100,seed=2", "--workers", "8",
                 "--batch", "64", "--load", "0.3", "--quiet"]) == 0
    shown = capsys.readouterr().out
    assert "note (G=8): no request ever waited for a slot (the fleet never filled)" in shown


def test_the_never_filled_note_names_the_settings_as_the_caller_takes_them():
    from predictor.tuning import TuningResult

    result = TuningResult([{"workers": 8, "contended_steps": 0}], {"policy": "br0"})
    assert "more requests (--requests) or a higher --load" in result.as_dict()["note"]
    rest = result.as_dict(rest=True)["note"]
    assert "more requests (`requests`) or a higher `load`" in rest and "--" not in rest


def test_a_holdout_that_leaves_nothing_to_replay_fails_before_any_replay(monkeypatch):
    """A holdout that rounds to no request is refused naming it, before the grid is ranked
    (it failed after ranking the whole grid, with an IndexError before that)."""
    import predictor.tuning as tuning

    def no_replay(*args, **kwargs):
        raise AssertionError("replayed before the holdout was checked")

    monkeypatch.setattr(tuning, "_replay", no_replay)
    trace = synthesize("synth:templated:n=200,seed=1")
    with pytest.raises(ParameterError, match=r"holdout: 0.001 of 200 requests leaves none"):
        tune(trace, SimConfig(workers=2, batch=8, load="backlog"), holdout=0.001)
