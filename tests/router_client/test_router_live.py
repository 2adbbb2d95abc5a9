"""The router client in the loop with a real prediction service on 127.0.0.1."""

from contextlib import ExitStack

import httpx
import numpy as np

from predictor.livesrv import free_port, live_server
from router_client.http_predictor import HttpPredictor
from router_client.policies import make_policy
from router_client.predictors import Prediction
from router_client.simulator import SimConfig, simulate
from router_client.synth import synthesize


class ConstantPrior:
    """What BR-H would do with a service that never learns: c_hat = H for everyone."""

    name = "prior"

    def predict(self, batch, horizon):
        return Prediction(np.full(batch.request_ids.shape[0], float(horizon)))

    def observe(self, finished):
        return None


class Recording(HttpPredictor):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.answers = []

    def predict(self, batch, horizon):
        prediction = super().predict(batch, horizon)
        self.answers.append(prediction.c_hat)
        return prediction


def test_service_learns_from_the_run_and_changes_brh_decisions(tmp_path):
    trace = synthesize("synth:templated:n=1500,templates=6,seed=1")
    config = SimConfig(workers=4, batch=16, load=1.0, horizon=40, refresh_steps=10)
    with live_server(f"sqlite:///{tmp_path / 'learn.db'}") as url:
        predictor = Recording(url, "auto", report="sync")  # a replay: reproducible
        live = simulate(trace, make_policy("brh-exactmatch"), config, predictor)
        predictor.close()
        status = httpx.get(url + "/v1/status").json()
    assert live.row["completed"] == 1500
    assert status["observations"] == 1500  # every outcome reached the service
    answers = [a for a in predictor.answers if a is not None and a.size]
    assert np.all(answers[0] == 40)  # nothing learned yet: the conservative prior
    assert np.any(answers[-1] < 40)  # learned: shorter lives predicted
    assert live.row["fallback_steps"] == 0
    prior = simulate(trace, make_policy("brh-exactmatch"), config, ConstantPrior())
    assert not np.array_equal(live.assigned_worker, prior.assigned_worker)


def test_outage_falls_back_within_one_refresh_and_returns_after_restart(tmp_path):
    trace = synthesize("synth:long:n=1200,output_mean=200,seed=3")
    config = SimConfig(workers=4, batch=16, load="backlog", horizon=40, refresh_steps=10,
                       healthy_to_return=3)
    database = f"sqlite:///{tmp_path / 'outage.db'}"
    port = free_port()
    stop_at, restart_at = 400, 700
    with ExitStack() as stack:
        server = live_server(database, port=port)
        url = server.__enter__()
        predictor = HttpPredictor(url, "survival", timeout_s=0.5, report="sync")

        def hook(step):
            nonlocal server
            if step == stop_at:
                server.__exit__(None, None, None)
            if step == restart_at:
                server = live_server(database, port=port)
                server.__enter__()
                stack.callback(server.__exit__, None, None, None)

        result = simulate(trace, make_policy("brh-survival"), config, predictor, step_hook=hook)
        predictor.close()
        status = httpx.get(url + "/v1/status").json()
    switches = [(s.step, s.to, s.reason) for s in result.switches]
    down = [s for s in switches if s[1] == "br0"]
    up = [s for s in switches if s[1] == "brh"]
    assert down and stop_at <= down[0][0] < stop_at + config.refresh_steps
    assert down[0][2] == "unavailable"
    assert up and restart_at <= up[0][0] <= restart_at + 3 * config.refresh_steps
    assert all(stop_at <= s <= up[0][0] for s in result.fallback_rounds)
    assert result.fallback_rounds  # it kept routing, as BR-0, during the outage
    assert result.row["completed"] == 1200  # nothing lost; the simulator refuses doubles
    assert (result.admit_step >= 0).all()
    assert status["observations"] == 1200  # outcomes buffered during the outage arrived
    assert predictor.reporter.failures > 0 and predictor.reporter.dropped == 0


def test_shift_raises_drift_and_triggers_fallback(tmp_path):
    trace = synthesize("synth:shift:n=5000,before_mean=30,after_mean=150,shift_at=0.5,"
                       "max_output=2000,seed=5")
    config = SimConfig(workers=4, batch=32, load="backlog", horizon=40, refresh_steps=10)
    env = {"BALANCEROUTE_CALIBRATION_SAMPLE_RATE": "0.2"}
    with live_server(f"sqlite:///{tmp_path / 'drift.db'}", env=env) as url:
        predictor = HttpPredictor(url, "auto", report="sync")
        result = simulate(trace, make_policy("brh-survival"), config, predictor)
        predictor.close()
        drift = httpx.get(url + "/v1/calibration").json()["drift"]
    assert drift["drifted"] is True and "output_length" in drift["detector"]
    drifted = [s for s in result.switches if s.reason == "drifted"]
    assert drifted, result.switches
    shift_step = int(np.min(result.admit_step[2500:]))  # first post-shift request admitted
    assert drifted[0].step > shift_step
    assert result.row["fallback_steps"] > 0 and result.row["completed"] == 5000


def test_reporter_buffer_is_bounded_and_retries_until_the_service_is_back(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    predictor = HttpPredictor(url, timeout_s=0.3)
    predictor.reporter.max_buffer = 5
    predictor.reporter.backoff_initial_s = 60.0  # no retry can come due during the test
    outcomes = [{"request_id": f"x{i}", "output_tokens": 3 + i} for i in range(8)]
    predictor.reporter.add(outcomes)
    assert predictor.reporter.dropped == 3 and predictor.reporter.pending() == 5
    assert predictor.reporter.flush_due() == 0  # nobody listens
    assert predictor.reporter.failures == 1 and predictor.reporter.pending() == 5
    assert predictor.reporter.flush_due() == 0  # backing off: no attempt yet
    assert predictor.reporter.failures == 1
    with live_server(f"sqlite:///{tmp_path / 'rep.db'}", port=port):
        assert predictor.reporter.flush_due(force=True) == 5
        assert httpx.get(url + "/v1/status").json()["observations"] == 5
    predictor.close()


def test_reporter_thread_delivers_in_the_background(tmp_path):
    with live_server(f"sqlite:///{tmp_path / 'thread.db'}") as url:
        predictor = HttpPredictor(url, flush_on_predict=False)
        predictor.reporter.start(interval_s=0.05)
        predictor.reporter.add([{"request_id": f"t{i}", "output_tokens": 5} for i in range(30)])
        import time

        deadline = time.monotonic() + 10
        while predictor.reporter.sent < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert predictor.reporter.sent == 30 and predictor.reporter.pending() == 0
        predictor.close()
        assert httpx.get(url + "/v1/status").json()["observations"] == 30
