import numpy as np

from router_client.fleet import FleetView, WaitingRequest
from router_client.policies import make_policy
from router_client.predictors import OraclePredictor
from router_client.shadow import ShadowPolicy
from router_client.simulator import SimConfig, simulate
from router_client.synth import synthesize


def test_shadow_records_what_others_would_do_without_changing_the_decision():
    rng = np.random.default_rng(4)
    fleet = FleetView.from_active(4, 6, rng.integers(0, 4, 10), rng.integers(100, 3000, 10),
                                  rng.uniform(1, 80, 10))
    pool = [WaitingRequest(f"r{i}", int(s)) for i, s in enumerate(rng.integers(50, 4000, 9))]
    shadow = ShadowPolicy(make_policy("jsq"), [make_policy("br0"), make_policy("brh-oracle")])
    used = shadow.route(fleet, pool)
    assert used.assignments == make_policy("jsq").route(fleet, pool).assignments
    by_policy = {r.policy: r for r in shadow.records}
    assert by_policy["jsq"].used and not by_policy["br0"].used
    br0 = make_policy("br0").route(fleet, pool)
    assert by_policy["br0"].assignments == tuple(
        (pool[a.pool_index].request_id, a.worker) for a in br0.assignments)
    loads = fleet.loads.astype(float).copy()
    for a in br0.assignments:
        loads[a.worker] += pool[a.pool_index].prompt_tokens
    assert by_policy["br0"].predicted_maxmin == loads.max() - loads.min()


def test_shadow_in_a_replay_reports_lower_predicted_imbalance_for_br0():
    trace = synthesize("synth:long:n=600,seed=9")
    shadow = ShadowPolicy(make_policy("jsq"), [make_policy("br0"), make_policy("brh-oracle")])
    plain = simulate(trace, make_policy("jsq"), SimConfig(workers=4, batch=8, load="backlog"))
    shadowed = simulate(trace, shadow, SimConfig(workers=4, batch=8, load="backlog"),
                        OraclePredictor(trace.output_tokens))
    # the run itself is JSQ's: shadowing changes nothing that happens
    assert np.array_equal(plain.assigned_worker, shadowed.assigned_worker)
    summary = shadow.summary()
    assert set(summary) == {"jsq", "br0", "brh-oracle"}
    assert summary["br0"]["predicted_total_mean"] < summary["jsq"]["predicted_total_mean"]
