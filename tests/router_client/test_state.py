import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router_client.state import MirroredFleet

WORKERS, CAPACITY = 3, 2


def events_for(request, worker, steps, end):
    out = [("enqueue", request, 100 + request), ("dispatch", request, worker)]
    out += [("progress", request, k) for k in range(1, steps + 1)]
    out.append((end, request, None))
    return out


@st.composite
def interleavings(draw):
    n = draw(st.integers(1, 12))
    streams = []
    for r in range(n):
        end = draw(st.sampled_from(["stop", "length", "cancel", "cancel_in_pool", "error"]))
        ev = events_for(r, draw(st.integers(0, WORKERS - 1)), draw(st.integers(0, 3)),
                        "cancel" if end.startswith("cancel") else end)
        if end == "cancel_in_pool":  # cancelled before dispatch
            ev = [ev[0], ("cancel", r, None), ev[1]]
        streams.append(ev)
    events = []
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    pointers = [0] * n
    while any(p < len(s) for p, s in zip(pointers, streams, strict=True)):
        r = int(rng.choice([i for i in range(n) if pointers[i] < len(streams[i])]))
        events.append(streams[r][pointers[r]])
        pointers[r] += 1
    # duplicates and local reordering
    for _ in range(draw(st.integers(0, 10))):
        events.insert(int(rng.integers(0, len(events) + 1)),
                      events[int(rng.integers(0, len(events)))])
    for _ in range(draw(st.integers(0, 10))):
        i = int(rng.integers(0, len(events)))
        j = min(len(events) - 1, i + int(rng.integers(1, 4)))
        events[i], events[j] = events[j], events[i]
    return n, events


def apply(fleet, event, now):
    kind, request, arg = event
    rid = f"r{request}"
    if kind == "enqueue":
        fleet.enqueue(rid, arg, now)
    elif kind == "dispatch":
        fleet.dispatch(rid, arg, now)
    elif kind == "progress":
        fleet.progress(rid, arg, now)
    elif kind == "cancel":
        fleet.cancel(rid, now)
    else:
        fleet.finish(rid, kind, now)


@given(interleavings())
def test_invariants_under_duplicated_reordered_cancelled_events(case):
    n, events = case
    fleet = MirroredFleet(WORKERS, CAPACITY, pool_ttl_s=1e9, active_ttl_s=1e9)
    for now, event in enumerate(events):
        apply(fleet, event, float(now))
        fleet.check()  # no request in two places, no worker above B
        for r in range(n):
            assert len(fleet.where(f"r{r}")) <= 1
    # Every request eventually ends (the proxy's end-of-stream or the TTL reaper): all free.
    for r in range(n):
        fleet.finish(f"r{r}", "stop", 1e6)
    fleet.reap(1e12)
    fleet.check()
    assert not fleet.active and not fleet.pool
    assert all(not members for members in fleet.per_worker)
    outcome_ids = [o["request_id"] for o in fleet.take_outcomes()]
    assert len(outcome_ids) == len(set(outcome_ids)), "an outcome reported twice"


def test_dispatch_refused_when_full_ended_or_unknown():
    fleet = MirroredFleet(1, 1)
    fleet.enqueue("a", 10, 0.0)
    fleet.enqueue("b", 10, 0.0)
    assert fleet.dispatch("a", 0, 0.0)
    assert not fleet.dispatch("b", 0, 0.0)  # worker full
    assert fleet.counters.rejected_dispatches == 1
    assert not fleet.dispatch("a", 0, 0.0)  # already dispatched
    assert not fleet.dispatch("zzz", 0, 0.0)  # unknown
    fleet.cancel("b", 1.0)
    assert not fleet.enqueue("b", 10, 2.0)  # a late duplicate enqueue of a cancelled request
    fleet.finish("a", "stop", 3.0, generated=7)
    assert fleet.take_outcomes() == [{"request_id": "a", "prompt_key": None,
                                      "prompt_tokens": 10, "output_tokens": 7,
                                      "finish_reason": "stop"}]


def test_ttl_reaping_and_reconciliation():
    fleet = MirroredFleet(2, 4, pool_ttl_s=10, active_ttl_s=30)
    fleet.enqueue("waiting", 5, 0.0)
    fleet.enqueue("silent", 5, 0.0)
    fleet.enqueue("ghost", 5, 0.0)
    fleet.enqueue("alive", 5, 0.0)
    for rid, worker in (("silent", 0), ("ghost", 1), ("alive", 1)):
        fleet.dispatch(rid, worker, 1.0)
    fleet.progress("alive", 3, 25.0)
    fleet.progress("ghost", 2, 25.0)
    assert fleet.reap(20.0) == ["waiting"]
    assert fleet.reap(40.0) == ["silent"]
    assert fleet.reconcile(1, {"alive"}, 41.0) == ["ghost"]
    assert list(fleet.active) == ["alive"]
    assert fleet.counters.pool_expired == 1 and fleet.counters.active_expired == 1
    assert fleet.counters.ghosts_removed == 1
    reasons = {o["request_id"]: o["finish_reason"] for o in fleet.take_outcomes()}
    assert reasons == {"silent": "error", "ghost": "error"}


def test_view_feeds_the_router():
    fleet = MirroredFleet(2, 4)
    fleet.enqueue("a", 100, 0.0, prompt_key="k")
    fleet.enqueue("b", 50, 0.0)
    fleet.dispatch("a", 1, 0.0)
    fleet.progress("a", 5, 1.0)
    view, pool = fleet.view(np.array([12.0]))
    assert list(view.loads) == [0.0, 105.0] and list(view.active_counts) == [0, 1]
    assert list(view.active_c_hat) == [12.0]
    assert [p.request_id for p in pool] == ["b"]
    with pytest.raises(ValueError):
        fleet.finish("a", "exploded", 2.0)
