import json
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from predictor.app import create_app
from predictor.cli import bundled_trace, main
from predictor.settings import Settings
from router_client.synth import synthesize
from router_client.traces import load_trace

POLICIES = ["jsq", "ltl", "br0", "brh-survival", "brh-oracle"]


def csv_trace(n=300, seed=2):
    trace = synthesize(f"synth:templated:n={n},seed={seed}")
    lines = ["arrival_s,prompt_tokens,output_tokens,prompt_key"]
    lines += [f"{a:.6f},{p},{o},{k}" for a, p, o, k in zip(
        trace.arrival_s, trace.prompt_tokens, trace.output_tokens, trace.prompt_keys,
        strict=True)]
    return "\n".join(lines) + "\n"


def wait(client, job_id, seconds=120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        job = client.get(f"/v1/ab-comparisons/{job_id}").json()
        if job["status"] in ("done", "failed"):
            return job
        time.sleep(0.1)
    pytest.fail(f"job {job_id} did not finish: {job}")


def timeless(rows):
    """The rows without their wall time (the one field in which identical runs differ)."""
    return [{k: v for k, v in r.items() if k != "sim_wall_s"} for r in rows]


def brh_rows(client, content, **fields):
    """``brh-oracle`` at G = 4, B = 8, backlog over REST on a CSV trace, with ``fields``."""
    job = wait(client, client.post("/v1/ab-comparisons", json={
        "policies": ["brh-oracle"], "workers": [4], "batch": 8, "load": "backlog", **fields,
        "trace": {"format": "csv", "content": content}}).json()["id"])
    assert job["status"] == "done", job
    return timeless(job["results"])


def brh_cli_rows(trace, out, *options):
    """The same run as :func:`brh_rows` from the CLI, with ``options``."""
    main(["ab", "--trace", str(trace), "--policies", "brh-oracle", "--workers", "4", "--batch",
          "8", "--load", "backlog", *options, "--quiet", "--json", str(out)])
    return timeless(json.loads(out.read_text()))


def test_rest_comparison_equals_the_cli(tmp_path):
    content = csv_trace()
    (tmp_path / "t.csv").write_text(content)
    body = {"policies": POLICIES, "workers": [2, 4], "batch": 8, "load": 1.2, "seed": 3,
            "horizon": 40, "trace": {"format": "csv", "content": content}}
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'ab.db'}"))) as c:
        started = c.post("/v1/ab-comparisons", json=body)
        assert started.status_code == 202
        job = wait(c, started.json()["id"])
    assert job["status"] == "done" and job["progress"] == 1.0 and job["error"] is None
    main(["ab", "--trace", str(tmp_path / "t.csv"), "--policies", ",".join(POLICIES),
          "--workers", "2,4", "--batch", "8", "--load", "1.2", "--seed", "3", "--horizon", "40",
          "--quiet", "--json", str(tmp_path / "cli.json")])
    cli = json.loads((tmp_path / "cli.json").read_text())
    rest = job["results"]
    for row in cli + rest:
        row.pop("sim_wall_s")
    assert rest == cli


@pytest.mark.parametrize("field, other, value", [
    # below saturation the two short-pool rules place short pools differently
    ("short_pool", "lpt", "best-pair"),
    # and so do the two projections of the workers' growth there (by F)
    ("short_pool_growth", "requests", "slots"),
])
def test_rest_comparison_takes_the_short_pool_rules_as_the_cli_does(tmp_path, field, other,
                                                                    value):
    """``short_pool`` and ``short_pool_growth`` reach BR-H as ``--short-pool`` and
    ``--short-pool-growth`` do: the REST rows with ``value`` equal the CLI's with the flag
    set to it, and differ from the REST rows with ``other``."""
    content = csv_trace(n=400, seed=5)
    (tmp_path / "t.csv").write_text(content)
    rows = {}
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'sp.db'}"))) as c:
        for rule in (other, value):
            body = {"policies": ["brh-oracle"], "workers": [4], "batch": 8, "load": 0.8,
                    field: rule, "trace": {"format": "csv", "content": content}}
            job = wait(c, c.post("/v1/ab-comparisons", json=body).json()["id"])
            assert job["status"] == "done", job
            rows[rule] = job["results"]
    main(["ab", "--trace", str(tmp_path / "t.csv"), "--policies", "brh-oracle", "--workers",
          "4", "--batch", "8", "--load", "0.8", "--" + field.replace("_", "-"), value,
          "--quiet", "--json", str(tmp_path / "cli.json")])
    cli = json.loads((tmp_path / "cli.json").read_text())
    for row in cli + rows[value] + rows[other]:
        row.pop("sim_wall_s")
    assert rows[value] == cli
    assert rows[other] != rows[value]


def write_csv(trace, path) -> str:
    """``trace`` written to ``path`` in the generic CSV format (its arrivals, prompt and output
    tokens); returns the CSV text."""
    content = "arrival_s,prompt_tokens,output_tokens\n" + "".join(
        f"{a:.6f},{p},{o}\n" for a, p, o in zip(trace.arrival_s, trace.prompt_tokens,
                                                trace.output_tokens, strict=True))
    path.write_text(content)
    return content


def short_output_csv(path) -> str:
    """400 requests of 20 output tokens on average (backlog: several slots free a step, so
    Stage 2 and the rounds of a short horizon decide), written to ``path`` as CSV; returns
    the CSV text."""
    return write_csv(synthesize("synth:long:n=400,seed=5,output_mean=20,prompt_mean=800"), path)


def test_rest_comparison_takes_the_stage2_order_as_the_cli_does(tmp_path):
    """``stage2_order``, ``stage2_fill`` and ``guard`` reach BR-0 and BR-H as
    ``--stage2-order``, ``--stage2-fill`` and ``--guard`` do: the REST rows with ``margin``,
    fill and the guard ``always`` (BR-H's default is ``idle``) equal the CLI's (and differ
    from the paper's Stage 2 at backlog, where Stage 2
    decides: short outputs free several slots a step)."""
    content = short_output_csv(tmp_path / "t.csv")
    rows = {}
    other_guard = "always"  # BR-H's default is idle (BR-0's always): BR-H's rows change
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'so.db'}"))) as c:
        for order in ("slots", "margin"):
            body = {"policies": ["br0", "brh-oracle"], "workers": [4], "batch": 8,
                    "load": "backlog", "stage2_order": order, "stage2_fill": order == "margin",
                    "trace": {"format": "csv", "content": content}}
            if order == "margin":
                body["guard"] = other_guard
            job = wait(c, c.post("/v1/ab-comparisons", json=body).json()["id"])
            assert job["status"] == "done", job
            rows[order] = job["results"]
    main(["ab", "--trace", str(tmp_path / "t.csv"), "--policies", "br0,brh-oracle",
          "--workers", "4", "--batch", "8", "--load", "backlog", "--stage2-order", "margin",
          "--stage2-fill", "--guard", other_guard, "--quiet", "--json",
          str(tmp_path / "cli.json")])
    cli = json.loads((tmp_path / "cli.json").read_text())
    for row in cli + rows["margin"] + rows["slots"]:
        row.pop("sim_wall_s")
    assert rows["margin"] == cli
    assert rows["slots"][0] != rows["margin"][0]
    # the guard reaches BR-0 and BR-H: with no fixed step cost (B = 0) nothing pays for an
    # overflowing admission, and "idle" leaves slots empty where "always" fills them
    guarded = {}
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'g.db'}"))) as c:
        for guard in ("always", "idle"):
            job = wait(c, c.post("/v1/ab-comparisons", json={
                "policies": ["br0", "brh-oracle"], "workers": [4], "batch": 8,
                "load": "backlog", "guard": guard, "step_cost": [1.5e-7, 0.0],
                "trace": {"format": "csv", "content": content}}).json()["id"])
            assert job["status"] == "done", job
            guarded[guard] = timeless(job["results"])
    for br0, brh in (guarded["always"], guarded["idle"]):  # the setting reaches both
        assert (br0["policy"], brh["policy"]) == ("br0", "brh-oracle")
    assert guarded["always"][0] != guarded["idle"][0]
    assert guarded["always"][1] != guarded["idle"][1]
    # a patience of 0 rounds: "idle" never holds a worker back, the rows are "always"'s, from
    # REST and from the CLI alike
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'p.db'}"))) as c:
        job = wait(c, c.post("/v1/ab-comparisons", json={
            "policies": ["br0", "brh-oracle"], "workers": [4], "batch": 8,
            "load": "backlog", "guard": "idle", "patience": 0, "step_cost": [1.5e-7, 0.0],
            "trace": {"format": "csv", "content": content}}).json()["id"])
    assert job["status"] == "done", job

    def decisions(rows):  # the rows but the wall time and who forced the guard's admissions
        return [{k: v for k, v in r.items() if k not in ("sim_wall_s", "patience_admissions")}
                for r in rows]

    assert decisions(job["results"]) == decisions(guarded["always"])
    # where "idle" would have held a worker back, patience forced the admission: counted
    assert all(r["patience_admissions"] > 0 and r["guard_waits"] == 0 for r in job["results"])
    assert all(r["patience_admissions"] == 0 and r["guard_waits"] > 0 for r in guarded["idle"])
    main(["ab", "--trace", str(tmp_path / "t.csv"), "--policies", "br0,brh-oracle",
          "--workers", "4", "--batch", "8", "--load", "backlog", "--guard", "idle",
          "--patience", "0", "--step-cost", "1.5e-7,0", "--quiet", "--json",
          str(tmp_path / "patient.json")])
    cli = json.loads((tmp_path / "patient.json").read_text())
    assert decisions(cli) == decisions(guarded["always"])
    assert [r["patience_admissions"] for r in cli] == \
        [r["patience_admissions"] for r in job["results"]]


def test_rest_comparison_takes_the_myopic_horizon_as_the_cli_does(tmp_path):
    """``myopic_horizon`` reaches BR-H as ``--myopic-horizon`` does: with 1 (only rounds at
    gamma 0 are BR-0's, the rule before) the REST rows equal the CLI's, and fewer rounds are
    routed as BR-0 than under the default 1.5; a value below 1 step is refused, naming the
    field."""
    content = short_output_csv(tmp_path / "t.csv")
    rows = {}
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'm.db'}"))) as c:
        for steps in (1.0, 1.5):
            rows[steps] = brh_rows(c, content, myopic_horizon=steps)
        refused = c.post("/v1/ab-comparisons", json={
            "policies": ["brh-oracle"], "workers": [4], "myopic_horizon": 0.5,
            "trace": {"format": "csv", "content": content}})
        assert refused.status_code == 422
        assert "myopic_horizon" in refused.text
        refused = c.post("/v1/ab-comparisons", json={
            "policies": ["brh-oracle"], "workers": [4], "own_wait_horizon": 0.5,
            "trace": {"format": "csv", "content": content}})
        assert refused.status_code == 422
        assert "own_wait_horizon" in refused.text
    assert rows[1.0][0]["gamma_zero_rounds"] < rows[1.5][0]["gamma_zero_rounds"]
    assert brh_cli_rows(tmp_path / "t.csv", tmp_path / "cli.json",
                        "--myopic-horizon", "1") == rows[1.0]


def test_own_wait_horizon_never_is_the_rule_before_over_rest_and_cli(tmp_path):
    """``own_wait_horizon: null`` (REST) and ``--own-wait-horizon never`` (CLI) turn the own
    wait off: their rows are equal, and on long outputs at backlog (effective horizons of
    about 15 steps) the default of 12 steps holds workers back more often, so the two
    settings route differently."""
    long_outputs = synthesize("synth:long:n=300")
    path = tmp_path / "long.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(
        f"{i * 0.01:.2f},{int(p)},{int(o)}\n" for i, (p, o) in
        enumerate(zip(long_outputs.prompt_tokens, long_outputs.output_tokens, strict=True))))
    rows = {}
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'w.db'}"))) as c:
        for key, value in (("never", None), ("default", 12)):
            rows[key] = brh_rows(c, path.read_text(), own_wait_horizon=value)
    assert rows["default"][0]["guard_waits"] > rows["never"][0]["guard_waits"]
    assert rows["never"] != rows["default"]
    for value, key in (("never", "never"), ("12", "default")):
        assert brh_cli_rows(path, tmp_path / f"cli-{key}.json",
                            "--own-wait-horizon", value) == rows[key]


def option_rows(tmp_path, trace_csv, field, settings, refused=(), load="backlog",
                policies=("brh-survival", "brh-oracle")):
    """G = 4, B = 8 comparisons of ``policies`` on the CSV trace at ``trace_csv``: for each
    ``(key, value, cli_options)`` of ``settings`` one over REST with ``field: value`` and one
    from the CLI with ``cli_options``, whose rows must be equal; each of ``refused`` for
    ``field`` must get a 422 naming it. Returns the rows by key."""
    common = {"policies": list(policies), "workers": [4], "batch": 8, "load": load,
              "trace": {"format": "csv", "content": trace_csv.read_text()}}
    rows = {}
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'opt.db'}"))) as c:
        for key, value, _ in settings:
            job = wait(c, c.post("/v1/ab-comparisons",
                                 json={**common, field: value}).json()["id"])
            assert job["status"] == "done", job
            rows[key] = timeless(job["results"])
        for value in refused:
            refusal = c.post("/v1/ab-comparisons", json={**common, field: value})
            assert refusal.status_code == 422
            assert field in refusal.text
    for key, _, options in settings:
        out = tmp_path / f"{key}.json"
        main(["ab", "--trace", str(trace_csv), "--policies", ",".join(policies), "--workers",
              "4", "--batch", "8", "--load", str(load), *options, "--quiet", "--json", str(out)])
        assert timeless(json.loads(out.read_text())) == rows[key]
    return rows


def test_own_wait_learned_over_rest_and_cli(tmp_path):
    """The own wait leaves learned BR-H alone by default; ``own_wait_learned`` (REST) and
    ``--own-wait-learned`` (CLI) bring it back there (equal rows, more waits on long outputs,
    so the learned rows move), and the oracle's rows are the same either way."""
    long_outputs = synthesize("synth:long:n=300")
    (tmp_path / "long.csv").write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(
        f"{i * 0.01:.2f},{int(p)},{int(o)}\n" for i, (p, o) in
        enumerate(zip(long_outputs.prompt_tokens, long_outputs.output_tokens, strict=True))))
    rows = option_rows(tmp_path, tmp_path / "long.csv", "own_wait_learned", (
        ("default", False, ["--no-own-wait-learned"]),
        ("learned", True, ["--own-wait-learned"])))
    assert rows["learned"][0]["guard_waits"] > rows["default"][0]["guard_waits"]
    assert rows["learned"][1] == rows["default"][1]  # brh-oracle


def test_br0_check_over_rest_and_cli(tmp_path):
    """``br0_check`` reaches BR-H as ``--br0-check`` does (equal rows, some rounds taken as
    BR-0's), ``never``/null is no check, and a negative value is refused naming the field."""
    content = short_output_csv(tmp_path / "t.csv")
    rows = {}
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}"))) as c:
        for key, value in (("never", None), ("zero", 0.0)):
            rows[key] = brh_rows(c, content, myopic_horizon=1.0, br0_check=value)
        refused = c.post("/v1/ab-comparisons", json={
            "policies": ["brh-oracle"], "workers": [4], "br0_check": -1,
            "trace": {"format": "csv", "content": content}})
        assert refused.status_code == 422
        assert "br0_check" in refused.text
    assert rows["zero"][0]["br0_check_rounds"] > 0 == rows["never"][0]["br0_check_rounds"]
    for value, key in (("never", "never"), ("0", "zero")):
        assert brh_cli_rows(tmp_path / "t.csv", tmp_path / f"cli-{key}.json",
                            "--myopic-horizon", "1", "--br0-check", value) == rows[key]


def test_learned_beta_scale_over_rest_and_cli(tmp_path):
    """``learned_beta_scale`` reaches learned BR-H as ``--learned-beta-scale`` does (equal rows;
    at 2 the learned rows move, the oracle's do not), and 0 or true is refused naming the field."""
    (tmp_path / "t.csv").write_text(csv_trace())
    rows = option_rows(tmp_path, tmp_path / "t.csv", "learned_beta_scale", (
        ("one", 1.0, ["--learned-beta-scale", "1"]),
        ("two", 2.0, ["--learned-beta-scale", "2"])),
        refused=(0, True))  # true is not the number 1
    assert rows["two"][0] != rows["one"][0]  # brh-survival
    assert rows["two"][1] == rows["one"][1]  # brh-oracle: true lengths are not scaled


def test_learned_short_pool_over_rest_and_cli(tmp_path):
    """``learned_short_pool`` reaches learned BR-H as ``--learned-short-pool`` does (equal
    rows; on, the learned rows move, the oracle's do not), and a number for it is refused
    naming the field."""
    (tmp_path / "t.csv").write_text(csv_trace())
    rows = option_rows(tmp_path, tmp_path / "t.csv", "learned_short_pool", (
        ("off", False, ["--no-learned-short-pool"]),
        ("on", True, ["--learned-short-pool"])),
        refused=(1,), load=1.0, policies=("brh-exactmatch", "brh-oracle"))
    assert rows["on"][0] != rows["off"][0]  # brh-exactmatch
    assert rows["on"][1] == rows["off"][1]  # brh-oracle: true lengths use the lookahead anyway


def test_marginal_overflow_over_rest_and_cli(tmp_path):
    """``marginal_overflow`` reaches learned BR-H as ``--marginal-overflow`` does (equal rows):
    on, fewer of its rounds go to the starvation guard (F of a worker near the envelope is
    no longer <= 0 for its own spread), and the oracle's rows do not move."""
    (tmp_path / "t.csv").write_text(csv_trace())
    rows = option_rows(tmp_path, tmp_path / "t.csv", "marginal_overflow", (
        ("off", False, ["--no-marginal-overflow"]),
        ("on", True, ["--marginal-overflow"])))
    assert (rows["on"][0]["starvation_guard_admissions"]
            < rows["off"][0]["starvation_guard_admissions"])
    assert rows["on"][1] == rows["off"][1]  # brh-oracle: true lengths have no spread


def test_replaying_the_services_own_observations(tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'obs.db'}")
    with TestClient(create_app(settings)) as c:
        empty = wait(c, c.post("/v1/ab-comparisons", json={"source": "observations"}).json()["id"])
        assert empty["status"] == "failed" and "no stored observations" in empty["error"]
        trace = synthesize("synth:long:n=200,output_mean=100")
        c.post("/v1/observations", json={"observations": [
            {"request_id": f"r{i}", "prompt_tokens": int(p), "output_tokens": int(o)}
            for i, (p, o) in enumerate(zip(trace.prompt_tokens, trace.output_tokens,
                                           strict=True))]})
        job = wait(c, c.post("/v1/ab-comparisons", json={
            "source": "observations", "policies": ["jsq", "br0"], "workers": [2],
            "batch": 8}).json()["id"])
        # more to warm on than is stored: the job fails saying so, the service goes on
        short = wait(c, c.post("/v1/ab-comparisons", json={
            "source": "observations", "warm_requests": 200}).json()["id"])
        assert short["status"] == "failed"
        assert "warm_requests: 200: must be at least 1 and below the 200" in short["error"]
    assert job["status"] == "done"
    assert [r["policy"] for r in job["results"]] == ["jsq", "br0"]
    assert all(r["completed"] == 200 for r in job["results"])


@pytest.mark.parametrize("body, fragment", [
    ({"policies": ["nope"], "source": "observations"}, "unknown policies"),
    ({"source": "observations", "trace": {"content": "x"}}, "exactly one"),
    ({}, "exactly one"),
    ({"source": "observations", "load": 0}, "load"),
    ({"source": "observations", "workers": [0]}, "workers"),
    ({"source": "observations", "short_pool": "largest"}, "short_pool"),
    ({"source": "observations", "short_pool_growth": "tokens"}, "short_pool_growth"),
    ({"source": "observations", "stage2_order": "load"}, "stage2_order"),
    ({"source": "observations", "stage2_fill": "maybe"}, "stage2_fill"),
    ({"source": "observations", "guard": "never"}, "guard"),
    ({"source": "observations", "patience": -1}, "patience"),
    ({"source": "observations", "patience": True}, "patience"),
    ({"source": "observations", "patience": "3"}, "patience"),
    ({"trace": {"format": "csv",
                "content": "arrival_s,prompt_tokens,output_tokens\n0,1,2\n1,x,3\n"}},
     "line 3"),
])
def test_bad_requests_are_422(tmp_path, body, fragment):
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'b.db'}"))) as c:
        got = c.post("/v1/ab-comparisons", json=body)
        assert got.status_code == 422
        assert fragment in got.text


def test_token_unknown_id_and_restart_marks_running_jobs_failed(tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'r.db'}", api_token="t")
    with TestClient(create_app(settings)) as c:
        assert c.post("/v1/ab-comparisons", json={"source": "observations"}).status_code == 401
        assert c.get("/v1/ab-comparisons/nope").status_code == 404
        app = c.app
        from datetime import UTC, datetime

        from models import AbJob

        with app.state.service.sessions() as session:
            now = datetime.now(UTC)
            session.add(AbJob(id="x" * 32, status="running", progress=0.3, request="{}",
                              created_at=now, updated_at=now))
            session.commit()
    with TestClient(create_app(settings)) as c:
        job = c.get("/v1/ab-comparisons/" + "x" * 32).json()
        assert job["status"] == "failed" and "interrupted" in job["error"]


def test_jobs_list_cancel_and_limits(tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'jobs.db'}", max_queued_jobs=2)
    slow = {"policies": ["br0", "brh-survival"], "workers": [8], "batch": 64, "load": 1.0,
            "trace": {"format": "csv", "content": csv_trace(n=3000)}}
    with TestClient(create_app(settings)) as c:
        huge = "arrival_s,prompt_tokens,output_tokens\n0,10,1000000000\n"
        refused = c.post("/v1/ab-comparisons", json={**slow, "trace": {
            "format": "csv", "content": huge}})
        assert refused.status_code == 422
        assert refused.json()["detail"][0]["loc"] == ["body", "trace", "content"]
        first = c.post("/v1/ab-comparisons", json=slow).json()["id"]
        second = c.post("/v1/ab-comparisons", json=slow).json()["id"]
        full = c.post("/v1/ab-comparisons", json=slow)
        assert full.status_code == 422 and "at most 2" in full.json()["detail"][0]["msg"]
        listed = c.get("/v1/ab-comparisons").json()
        assert {j["id"] for j in listed} == {first, second}
        assert all("content" not in j["request"]["trace"] for j in listed)
        assert c.get(f"/v1/ab-comparisons/{first}").json()["request"]["trace"]["bytes"] > 0
        for job_id in (second, first):
            assert c.delete(f"/v1/ab-comparisons/{job_id}").status_code == 200
        for job_id in (first, second):
            deadline = time.monotonic() + 60
            while c.get(f"/v1/ab-comparisons/{job_id}").json()["status"] != "cancelled":
                assert time.monotonic() < deadline, "the job was not cancelled"
                time.sleep(0.1)
        assert c.delete("/v1/ab-comparisons/nope").status_code == 404


def test_stage2_revisit_over_rest_and_cli(tmp_path):
    """``stage2_revisit`` reaches BR-0 as ``--stage2-revisit`` does (equal rows; on a saturated
    fleet some rounds revisit a worker, so the rows move), and a string is refused naming the
    field."""
    # the bundled Azure trace's first 1,200 requests: at B = 8 and load 1.0 some rounds
    # revisit (the synthetic workloads at this scale never do)
    write_csv(load_trace(str(bundled_trace()), requests=1200), tmp_path / "t.csv")
    rows = option_rows(tmp_path, tmp_path / "t.csv", "stage2_revisit", (
        ("off", False, ["--no-stage2-revisit"]),
        ("on", True, ["--stage2-revisit"])),
        refused=("yes", 1), load=1.0, policies=("br0",))
    assert rows["on"][0] != rows["off"][0]


def test_warm_requests_over_rest_and_cli(tmp_path):
    """``warm_requests`` (REST) and ``--warm`` (CLI) replay only the requests after the first
    N, every learner knowing those N as finished: equal rows, each saying how many; BR-0
    ignores the past (its row is a plain replay of the rest) while the learner uses it (its
    row is the replay of the rest with a learner warmed on the past, not one starting empty);
    a count that leaves nothing to replay is a 422 naming the field."""
    from predictor.tuning import replay
    from router_client.admission import BalanceRouteParams
    from router_client.simulator import SimConfig

    content = csv_trace(n=600)
    (tmp_path / "t.csv").write_text(content)
    common = {"policies": ["br0", "brh-exactmatch"], "workers": [4], "batch": 8,
              "load": "backlog", "trace": {"format": "csv", "content": content}}
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'w.db'}"))) as c:
        job = wait(c, c.post("/v1/ab-comparisons", json={**common, "warm_requests": 250})
                   .json()["id"])
        assert job["status"] == "done", job
        for fields in ({"warm_requests": 600}, {"warm_requests": 0},
                       {"warm_requests": 200, "requests": 200}):
            refused = c.post("/v1/ab-comparisons", json={**common, **fields})
            assert refused.status_code == 422, fields
            assert refused.json()["detail"][0]["loc"] == ["body", "warm_requests"], fields
        refused = c.post("/v1/ab-comparisons", json={**common, "warm_requests": 600})
        assert "600: must be at least 1 and below the 600 requests it splits" in refused.text
    rows = timeless(job["results"])
    assert [(r["warm_requests"], r["requests"]) for r in rows] == [(250, 350)] * 2
    main(["ab", "--trace", str(tmp_path / "t.csv"), "--policies", "br0,brh-exactmatch",
          "--workers", "4", "--batch", "8", "--load", "backlog", "--warm", "250", "--quiet",
          "--json", str(tmp_path / "cli.json")])
    assert timeless(json.loads((tmp_path / "cli.json").read_text())) == rows
    past, rest = load_trace(str(tmp_path / "t.csv"), "csv").split(250, "--warm")
    config = SimConfig(workers=4, batch=8, load="backlog")
    params = BalanceRouteParams()

    def same(row, expected):
        return all(row[k] == expected[k] for k in ("throughput_tok_s", "imbalance_maxmin_mean",
                                                    "completed", "requests"))

    assert same(rows[0], replay(rest, "br0", params, config))
    assert same(rows[1], replay(rest, "brh-exactmatch", params, config, warm=past))
    assert not same(rows[1], replay(rest, "brh-exactmatch", params, config))


def test_warm_learners_know_the_past_before_the_first_answer_and_nothing_after_it():
    """No peeking with a warmed learner: before its first answer it has been told exactly the
    past's requests, and afterwards only the replayed requests that finished."""
    from predictor import abtest
    from router_client.simulator import SimConfig

    trace = synthesize("synth:templated:n=400,seed=3")
    past, rest = trace.split(150, "--warm")
    told, answers = [], []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def observe(self, finished):
            told.append((len(answers), finished))
            self.inner.observe(finished)

        def predict(self, batch, horizon):
            answers.append(batch.request_ids.copy())
            return self.inner.predict(batch, horizon)

    def factory(policy, replayed):
        return Spy(abtest.make_predictor(policy, replayed))

    comparison = abtest.run_comparison(rest, ["brh-exactmatch"], [4],
                                       SimConfig(batch=8, load="backlog"),
                                       predictor_factory=factory, warm=past)
    assert comparison.rows[0]["warm_requests"] == 150
    first_answer, first = told[0]
    assert first_answer == 0 and answers  # told before it answered anything
    np.testing.assert_array_equal(first.output_tokens, past.output_tokens)
    np.testing.assert_array_equal(first.prompt_tokens, past.prompt_tokens)
    assert first.prompt_keys == past.prompt_keys
    np.testing.assert_array_equal(first.censored, past.censored)
    later = np.concatenate([f.request_ids for _, f in told[1:]])  # the replay's own ids
    assert sorted(later.tolist()) == list(range(len(rest)))  # each once, as it finished
    np.testing.assert_array_equal(
        np.concatenate([f.output_tokens for _, f in told[1:]]), rest.output_tokens[later])
