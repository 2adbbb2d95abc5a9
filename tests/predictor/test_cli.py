import json
import subprocess
import sys

import numpy as np
import pytest

from predictor.cli import main

API_FIELDS = {
    "policy", "workers", "batch", "requests", "completed", "imbalance_maxmin_mean",
    "imbalance_total_mean", "barrier_idle_fraction", "throughput_tok_s",
    "balanced_bound_tok_s", "tpot_p50_ms", "tpot_p95_ms", "ttft_p95_ms", "pool_wait_p95_steps",
    "starvation_guard_admissions", "fallback_steps", "drain_steps", "makespan_s", "sim_wall_s",
}


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["ab", "--help"],
                                  ["bench", "router", "--help"],
                                  ["bench", "predictor", "--help"],
                                  ["bench", "calibration", "--help"], ["demo", "--help"]])
def test_every_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert "usage: balanceroute" in capsys.readouterr().out


def test_ab_writes_rows_csv_and_plots(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["ab", "--trace", "synth:long:n=300", "--workers", "2,4", "--batch", "8",
                 "--policies", "jsq,ltl,br0,brh-survival,brh-oracle", "--json",
                 str(tmp_path / "rows.json"), "--out", str(out), "--quiet"])
    assert code == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["workers"], r["policy"]) for r in rows] == [
        (g, p) for g in (2, 4) for p in ("jsq", "ltl", "br0", "brh-survival", "brh-oracle")
    ]
    for row in rows:
        assert API_FIELDS <= set(row)
        assert row["completed"] == 300
        assert 0 < row["throughput_tok_s"] <= row["balanced_bound_tok_s"] * (1 + 1e-9)
    text = capsys.readouterr().out
    assert "x jsq" in text and "brh-oracle" in text
    for name in ("results.csv", "trajectories_G2.png", "trajectories_G4.png",
                 "throughput_imbalance.png"):
        assert (out / name).stat().st_size > 0


def test_ab_same_seed_same_rows(tmp_path):
    argv = ["ab", "--trace", "synth:templated:n=300", "--workers", "2", "--batch", "8",
            "--policies", "p2c,br0,brh-exactmatch", "--quiet", "--seed", "3", "--json"]
    main([*argv, str(tmp_path / "a.json")])
    main([*argv, str(tmp_path / "b.json")])
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    for row in a + b:
        row.pop("sim_wall_s")
    assert a == b


def test_malformed_trace_is_one_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,prompt_tokens,output_tokens\n0,1,2\n1,two,3\n")
    assert main(["ab", "--trace", str(bad), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "line 3" in err and "prompt_tokens" in err and "Traceback" not in err


def test_unknown_policy_is_an_error(capsys):
    assert main(["ab", "--trace", "synth:long:n=10", "--policies", "jsq,nope"]) == 1
    assert "unknown policy 'nope'" in capsys.readouterr().err


def test_ab_with_an_unreachable_service_routes_as_br0(tmp_path, capsys):
    from predictor.livesrv import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    code = main(["ab", "--trace", "synth:long:n=200", "--workers", "2", "--batch", "8",
                 "--policies", "br0,brh-survival", "--predictor-url", url, "--quiet",
                 "--json", str(tmp_path / "rows.json")])
    assert code == 0
    rows = {r["policy"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert rows["brh-survival"]["completed"] == 200
    assert rows["brh-survival"]["fallback_steps"] > 0
    # routed entirely as BR-0: the same numbers
    for key in ("throughput_tok_s", "imbalance_maxmin_mean", "makespan_s"):
        assert rows["brh-survival"][key] == rows["br0"][key]
    assert "to BR0 (unavailable)" in capsys.readouterr().out


def test_console_script_runs():
    done = subprocess.run([sys.executable, "-m", "predictor.cli", "ab", "--trace",
                           "synth:long:n=50", "--workers", "2", "--batch", "4", "--policies",
                           "br0", "--quiet"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "br0" in done.stdout


def test_bench_router_writes_api_fields(tmp_path):
    path = tmp_path / "bench.json"
    assert main(["bench", "router", "--workers", "2", "--batch", "4", "--pool", "16",
                 "--rounds", "20", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert {"workers", "rmax", "pool", "rounds", "p50_ms", "p99_ms", "mean_ms",
            "stage2_share"} <= set(result)
    assert result["rounds"] == 20 and result["p50_ms"] <= result["p99_ms"]
    assert len(result["load_average"]) == 2  # the machine load the figures were taken at


def test_bench_router_times_learned_states(tmp_path, capsys):
    """--predictor: the states come from a run whose estimator learns online, and the timed
    rounds project its law with the spread (the fast path still agrees with the reference,
    or the bench raises)."""
    path = tmp_path / "bench.json"
    assert main(["bench", "router", "--workers", "2", "--batch", "4", "--pool", "16",
                 "--rounds", "20", "--predictor", "survival", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["policy"] == "brh-survival" and result["rounds"] == 20
    assert main(["bench", "router", "--rounds", "5", "--predictor", "nope"]) != 0
    assert "unknown estimator 'nope'" in capsys.readouterr().err
    assert main(["bench", "router", "--rounds", "5", "--horizon", "0",
                 "--predictor", "survival"]) != 0
    assert "--predictor: applies to BR-H" in capsys.readouterr().err


def test_bench_calibration_small(tmp_path):
    path = tmp_path / "cal.json"
    assert main(["bench", "calibration", "--scored", "2000", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["scored"] == 2000 and result["report"]["p50_ms"] > 0


def test_bench_predictor_small_reports_queries_while_ingesting(tmp_path):
    path = tmp_path / "pred.json"
    assert main(["bench", "predictor", "--items", "16", "--rounds", "20",
                 "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    for part in ("in_process", "in_process_fits_done", "http", "http_columns", "http_fits_done",
                 "http_columns_fits_done", "one_item_http", "one_item_http_while_ingesting"):
        assert result[part]["p99_ms"] >= result[part]["p50_ms"] > 0, part
    assert result["http_fits_wait_s"] >= 0
    assert result["ingested_meanwhile"] >= 1000  # the writer really ran during the queries


def test_ab_brh_parameters_reach_the_policy(tmp_path):
    argv = ["ab", "--trace", "synth:long:n=300", "--workers", "2", "--batch", "8",
            "--policies", "br0,brh-oracle", "--quiet", "--json"]
    main([*argv, str(tmp_path / "a.json")])
    main([*argv, str(tmp_path / "b.json"), "--beta", "2", "--gamma", "1.0"])
    main([*argv, str(tmp_path / "c.json"), "--rmax", "1", "--s-greedy", "0"])
    a, b, c = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json", "c.json"))
    assert a[0]["throughput_tok_s"] == b[0]["throughput_tok_s"]  # BR-0 ignores beta/gamma
    assert a[1]["imbalance_total_mean"] != b[1]["imbalance_total_mean"]
    assert a[0]["imbalance_total_mean"] != c[0]["imbalance_total_mean"]  # stages: both


def test_ab_rejects_bad_parameters(capsys):
    assert main(["ab", "--trace", "synth:long:n=10", "--gamma", "0", "--quiet"]) == 1
    assert "gamma" in capsys.readouterr().err
    assert main(["ab", "--trace", "synth:long:n=10", "--seed", "-1", "--quiet"]) == 1
    assert "seed: must be >= 0" in capsys.readouterr().err
    for load in ("1e-42", "inf", "nan", "0"):  # a replay's step count would overflow, or none
        with pytest.raises(SystemExit):
            main(["ab", "--trace", "synth:long:n=10", "--load", load, "--quiet"])
        assert "argument --load: must be in [0.001, 100]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ab", "--trace", "synth:long:n=10", "--step-cost", "0,0", "--quiet"])
    assert "A and B cannot both be 0" in capsys.readouterr().err
    # a subnormal cost made every step time ~0 and the rows' tok/s inf (null over REST)
    with pytest.raises(SystemExit):
        main(["ab", "--trace", "synth:long:n=10", "--step-cost", "1e-320,0", "--quiet"])
    assert "--step-cost: A must be 0 or from 1e-12 to 1 s per KV token, not 1e-320" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ab", "--trace", "synth:long:n=10", "--step-cost", "1e-7,100", "--quiet"])
    assert "B must be 0 or from 1e-12 to 10 s per step, not 100.0" in capsys.readouterr().err
    for scale in ("2e6", "nan", "0"):  # the service's bound (REST refuses the same)
        assert main(["ab", "--trace", "synth:long:n=10", "--learned-beta-scale", scale,
                     "--quiet"]) == 1
        assert "learned_beta_scale: must be a number > 0 and at most 1e+06" in \
            capsys.readouterr().err
    for warm in ("0", "10", "-3"):  # nothing would be left to replay, or no past
        assert main(["ab", "--trace", "synth:long:n=10", "--warm", warm, "--quiet"]) == 1
        assert f"--warm: {warm}: must be at least 1 and below the 10 requests" in \
            capsys.readouterr().err
    assert main(["ab", "--trace", "synth:long:n=10", "--warm", "5", "--predictor-url",
                 "http://127.0.0.1:9", "--quiet"]) == 1
    assert "--warm: warms the in-process learners" in capsys.readouterr().err
    for options, fragment in ((["--skip", "0"], "--skip: 0: must be at least 1"),
                              (["--skip", "10"], "--skip: 10: must be at least 1 and below the 10"),
                              (["--skip", "6", "--warm", "4"],
                               "--warm: 4: must be at least 1 and below the 4 requests"),
                              (["--peer", "--warm", "4"], "--warm: not with --peer"),
                              (["--peer", "--skip", "4"], "--skip: not with --peer")):
        assert main(["ab", "--trace", "synth:long:n=10", *options, "--quiet"]) == 1, options
        assert fragment in capsys.readouterr().err


def test_ab_peer_setting_and_sampling(tmp_path):
    from predictor.cli import main
    from router_client.synth import synthesize

    out = tmp_path / "rows.json"
    assert main(["ab", "--trace", "synth:long:n=400,seed=3", "--sample", "150", "--peer",
                 "--workers", "2", "--policies", "ltl,br0", "--quiet", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["requests"]) for r in rows] == [(72, 150), (72, 150)]
    trace = synthesize("synth:long:n=400,seed=3")
    picked = trace.sample(150, seed=0)
    assert len(picked) == 150 and picked.sample(150, 0) is picked
    assert set(picked.output_tokens.tolist()) <= set(trace.output_tokens.tolist())


def test_peer_sample_draws_as_the_peer_does(tmp_path):
    """``--peer --sample N`` draws as BF-IO's simulator: in random order, and with
    replacement past the trace's length (20,000 from Mooncake's 12,031), so the run has N
    requests; without ``--peer`` a sample keeps trace order and never exceeds the trace."""
    from predictor.cli import main
    from router_client.synth import synthesize

    trace = synthesize("synth:long:n=300,seed=3")
    more = trace.draw(500, seed=1)
    assert len(more) == 500 and more.arrival_s is None
    assert set(more.output_tokens.tolist()) <= set(trace.output_tokens.tolist())
    assert len(np.unique(more.prompt_tokens * 100_000 + more.output_tokens)) < 300  # repeats
    fewer = trace.draw(200, seed=1)
    rows = np.random.default_rng(1).choice(300, size=200, replace=False)
    assert np.array_equal(fewer.output_tokens, trace.output_tokens[rows])  # the order drawn
    assert not np.all(np.diff(rows) > 0)
    assert len(trace.sample(500, seed=1)) == 300
    out = tmp_path / "rows.json"
    assert main(["ab", "--trace", "synth:long:n=300,seed=3", "--sample", "500", "--peer",
                 "--workers", "2", "--policies", "br0", "--quiet", "--json", str(out)]) == 0
    assert [r["requests"] for r in json.loads(out.read_text())] == [500]


def test_serve_logs_each_request_only_when_asked(tmp_path, monkeypatch):
    """uvicorn's access log (a line per query) is off unless ``--access-log`` is given."""
    import uvicorn

    calls: list[dict] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append(kwargs))
    url = f"sqlite:///{tmp_path / 's.db'}"
    assert main(["serve", "--database-url", url, "--port", "9"]) == 0
    assert main(["serve", "--database-url", url, "--port", "9", "--access-log"]) == 0
    assert [c["access_log"] for c in calls] == [False, True]
    assert calls[0]["port"] == 9 and calls[0]["log_level"] == "info"


def test_serve_with_a_database_it_cannot_use_says_so_without_the_password(capsys):
    for url in ("postgresql+psycopg://user:s3cret@127.0.0.1:1/db",  # nothing listens there
                "postgresql://user:s3cret@127.0.0.1:notaport/db"):  # does not parse
        assert main(["serve", "--database-url", url, "--port", "9"]) == 1
        err = capsys.readouterr().err
        assert "error: cannot use the database" in err and "user:***@127.0.0.1" in err, err
        assert "s3cret" not in err


def test_a_database_urls_password_is_hidden_wherever_it_is_written():
    from predictor.cli import url_without_password as shown

    assert shown("postgresql://u:p@h/db") == "postgresql://u:***@h/db"
    assert "s3cret" not in shown("postgresql://u@h/db?password=s3cret&sslmode=require")
    hidden = shown("postgresql://u@h/db?sslmode=require&PASSWORD=x")
    assert "PASSWORD=***" in hidden and "sslmode=require" in hidden and "=x" not in hidden
    assert "p@ss" not in shown("postgresql://u:p@ss@h:notaport/db")
    assert shown("sqlite:///x.db") == "sqlite:///x.db"


def test_serve_help_gives_each_settings_default_derived_ones_in_words(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = capsys.readouterr().out
    assert "BALANCEROUTE_DEFAULT_HORIZON" in shown and "[80]" in shown
    assert "[536870912, or max_body_bytes if larger]" in shown
    assert "[a quarter of calibration_max_pending]" in shown
    assert "BALANCEROUTE_API_TOKEN                      [unset]" in shown


def test_ab_skip_replays_the_rest_with_learners_starting_empty(tmp_path):
    """``--skip N`` replays what follows the first N requests, as a replay of that part alone
    (learners empty); with ``--warm M`` the past is the M right after the skipped ones."""
    from predictor.tuning import replay
    from router_client.admission import BalanceRouteParams
    from router_client.simulator import SimConfig
    from router_client.synth import synthesize

    spec = "synth:templated:n=500,seed=4"
    common = ["ab", "--trace", spec, "--policies", "brh-exactmatch", "--workers", "4",
              "--batch", "8", "--load", "backlog", "--quiet", "--json"]
    assert main([*common, str(tmp_path / "skip.json"), "--skip", "200"]) == 0
    assert main([*common, str(tmp_path / "both.json"), "--skip", "200", "--warm", "100"]) == 0
    _, rest = synthesize(spec).split(200, "--skip")
    past, after = rest.split(100, "--warm")
    config, params = SimConfig(workers=4, batch=8, load="backlog"), BalanceRouteParams()
    for name, expected in (("skip", replay(rest, "brh-exactmatch", params, config)),
                           ("both", replay(after, "brh-exactmatch", params, config,
                                           warm=past))):
        row = json.loads((tmp_path / f"{name}.json").read_text())[0]
        assert (row["requests"], row["throughput_tok_s"], row["imbalance_maxmin_mean"]) == (
            expected["requests"], expected["throughput_tok_s"],
            expected["imbalance_maxmin_mean"]), name
