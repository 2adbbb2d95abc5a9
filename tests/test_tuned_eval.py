"""tools/tuned_eval.py: tuning's pick judged on later traffic, resumable, and its table."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from predictor.tuning import GRIDS, Candidate, candidate_of, choose, chosen_row, replay, tune
from router_client.admission import TURNOVER, BalanceRouteParams
from router_client.simulator import SimConfig
from router_client.traces import load_trace

ROOT = Path(__file__).resolve().parents[1]
TOOL = [sys.executable, str(ROOT / "tools" / "tuned_eval.py")]


def test_tuned_eval_judges_the_pick_on_the_later_half_only(tmp_path):
    out = tmp_path / "rows.jsonl"
    args = ["--json", str(out), "--cells", "tpl:backlog", "--workers", "2", "--seeds", "1",
            "--requests", "300", "--batch", "8"]
    subprocess.run([*TOOL, "run", *args], check=True, capture_output=True, cwd=ROOT)
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert (line["cell"], line["workers"], line["seed"], line["requests"]) == (
        "tpl:backlog", 2, 1, [300, 300])
    assert set(line["later"]) == {"br0", "tuned", "brh-exactmatch", "brh-oracle"}

    # the same split by hand: tuning on the first 300 only, the four replays on the last 300
    whole = load_trace("synth:templated:seed=1", requests=600)
    config = SimConfig(workers=2, batch=8, load="backlog", seed=1)
    result = tune(whole, config, holdout=0.5)  # the default rule, the tool's
    assert line["recommendation"] == result.recommendation
    assert [r["setting"] for r in line["tuning"]] == [r["setting"] for r in result.rows]
    later, past = whole.take(np.arange(300, 600)), whole.head(300)
    for name, row in (("br0", result.evaluation[0]), ("tuned", result.evaluation[-1])):
        assert line["later"][name]["throughput_tok_s"] == row["throughput_tok_s"]
    learned = replay(later, "brh-exactmatch", BalanceRouteParams(), config, warm=past)
    assert line["later"]["brh-exactmatch"]["throughput_tok_s"] == learned["throughput_tok_s"]
    assert learned["requests"] == 300

    subprocess.run([*TOOL, "run", *args], check=True, capture_output=True, cwd=ROOT)
    assert len(out.read_text().splitlines()) == 1  # resumed: nothing run twice
    table = subprocess.run([*TOOL, "table", "--json", str(out)], check=True,
                           capture_output=True, text=True, cwd=ROOT).stdout
    rows = {r.split(" | ")[2]: r.split(" | ") for r in table.splitlines()
            if r.startswith("| tpl")}
    assert set(rows) == {"tuned, turnover grid", "brh-exactmatch", "brh-oracle"}
    ratio = line["later"]["tuned"]["throughput_tok_s"] / line["later"]["br0"]["throughput_tok_s"]
    assert rows["tuned, turnover grid"][5].startswith(f"{ratio:.4f} (")
    assert (line["confirm"], line["grid"]) == (False, "turnover")
    # the pooled summary: each draw once, the share's mean and the count below 0.999x
    pooled = {r.split(" | ")[0]: r.split(" | ") for r in table.splitlines()
              if r.startswith(("| tuned", "| brh"))}
    share = line["later"]["brh-oracle"]["bound_share"] / line["later"]["br0"]["bound_share"]
    assert pooled["| brh-oracle"][1] == "1"
    assert pooled["| brh-oracle"][2] == f"{share:.4f} ({share:.4f})"
    assert pooled["| brh-oracle"][4].startswith(f"{int(share < 0.999)} / ")

    # the same draw tuned with the pick confirmed pools with it: one draw, both picks
    other = tmp_path / "confirmed.jsonl"
    subprocess.run([*TOOL, "run", *args[:1], str(other), *args[2:], "--confirm"],
                   check=True, capture_output=True, cwd=ROOT)
    (before,) = [json.loads(x) for x in other.read_text().splitlines()]
    assert before["confirm"] is True and before["confirmation"] == []  # one window: none
    assert before["later"]["br0"] == line["later"]["br0"]  # the rule moves only the pick
    table = subprocess.run([*TOOL, "table", "--json", str(out), str(other)], check=True,
                           capture_output=True, text=True, cwd=ROOT).stdout
    rows = {r.split(" | ")[2]: r.split(" | ") for r in table.splitlines()
            if r.startswith("| tpl")}
    assert set(rows) == {"tuned, turnover grid", "tuned, turnover grid, confirmed",
                         "brh-exactmatch", "brh-oracle"}
    assert all(r[3] == "1" for r in rows.values())  # the draw counts once
    ratio = (before["later"]["tuned"]["throughput_tok_s"]
             / before["later"]["br0"]["throughput_tok_s"])
    assert rows["tuned, turnover grid, confirmed"][5].startswith(f"{ratio:.4f} (")
    imb = (line["later"]["brh-oracle"]["imbalance_maxmin_mean"]
           / line["later"]["br0"]["imbalance_maxmin_mean"])
    assert rows["brh-oracle"][7] == f"{imb:.3f}"

    # a draw replayed without the oracle pools too: the gap is over the draws with one
    lone = tmp_path / "lone.jsonl"
    lone.write_text(json.dumps({**line, "seed": line["seed"] + 100, "later": {
        k: v for k, v in line["later"].items() if k != "brh-oracle"}}) + "\n")
    table = subprocess.run([*TOOL, "table", "--json", str(out), str(lone)], check=True,
                           capture_output=True, text=True, cwd=ROOT).stdout
    rows = {r.split(" | ")[2]: r.split(" | ") for r in table.splitlines()
            if r.startswith("| tpl")}
    assert (rows["brh-exactmatch"][3], rows["brh-oracle"][3]) == ("2", "1")
    learned = (line["later"]["brh-exactmatch"]["imbalance_maxmin_mean"]
               / line["later"]["br0"]["imbalance_maxmin_mean"])
    expected = ("n/a (oracle not below BR-0)" if imb >= 1.0
                else f"{(1.0 - learned) / (1.0 - imb):.2f}")
    assert rows["brh-exactmatch"][8].rstrip(" |") == expected


def test_runs_of_other_sizes_stay_apart_and_a_draw_must_agree_with_itself(tmp_path):
    """The table pools a draw's runs only when they replayed the same halves: runs of another
    N are another draw (their own rows), and two runs of one draw whose shared replays differ
    are refused, naming the file and line."""
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    base = ["--cells", "tpl:backlog", "--workers", "2", "--seeds", "1", "--batch", "8"]
    for out, n in ((small, "200"), (large, "300")):
        subprocess.run([*TOOL, "run", "--json", str(out), *base, "--requests", n],
                       check=True, capture_output=True, cwd=ROOT)
    table = subprocess.run([*TOOL, "table", "--json", str(small), str(large)], check=True,
                           capture_output=True, text=True, cwd=ROOT).stdout
    cells = {r.split(" | ")[0] for r in table.splitlines() if r.startswith("| tpl")}
    assert cells == {"| tpl:backlog (halves of 200)", "| tpl:backlog (halves of 300)"}
    (row,) = [json.loads(x) for x in small.read_text().splitlines()]
    row["later"]["br0"]["throughput_tok_s"] += 1.0  # the same draw, another BR-0 replay
    row["confirm"] = True
    forged = tmp_path / "forged.jsonl"
    forged.write_text(json.dumps(row) + "\n")
    failed = subprocess.run([*TOOL, "table", "--json", str(small), str(forged)],
                            capture_output=True, text=True, cwd=ROOT)
    assert failed.returncode != 0 and f"{forged}:1: br0" in failed.stderr


@pytest.fixture
def tuned_eval():
    """The tool's module (tools/ is not a package)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import tuned_eval
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return tuned_eval


def test_the_tool_tunes_by_the_rule_asked(tmp_path, monkeypatch, capsys, tuned_eval):
    """--confirm and --min-gain reach tune (a spy on the real function), a run of another rule
    or gate on the same draw is not skipped as done, and the table names each pick."""
    seen = []

    def spy(*a, **k):
        seen.append((k["confirm"], k["min_gain"]))
        return tune(*a, **k)

    monkeypatch.setattr(tuned_eval, "tune", spy)
    out = tmp_path / "rows.jsonl"
    for confirm, gain in ((True, 0.001), (False, 0.001), (True, 0.001), (False, 0.0)):
        tuned_eval.run(argparse.Namespace(
            json=out, cells=["tpl:backlog"], workers=[2], seeds=1, requests=200, batch=8,
            estimator="exact_match", confirm=confirm, first_seed=1, grid="turnover",
            subgrid=None, min_gain=gain))
    assert seen == [(True, 0.001), (False, 0.001), (False, 0.0)]  # the third was done
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["confirm"], x.get("min_gain")) for x in lines] == [
        (True, None), (False, None), (False, 0.0)]
    tuned_eval.table(argparse.Namespace(json=[out]))
    names = {r.split(" | ")[2] for r in capsys.readouterr().out.splitlines()
             if r.startswith("| tpl")}
    assert {"tuned, turnover grid", "tuned, turnover grid, confirmed",
            "tuned, turnover grid, min gain 0"} < names


def test_the_subgrid_pick_is_tunings_rule_over_that_part_replayed_on_the_later_half(
        tmp_path, monkeypatch, capsys, tuned_eval):
    """--grid wide --subgrid turnover: the pick tuning's rule makes over the turnover grid's
    rows of the wide grid's ranking (a spy keeps the real tune's result), replayed on the later
    half like the wide grid's pick and shown as its own row, agreeing with a run over the
    turnover grid alone; --first-seed draws fresh replicates; a subgrid must be a part of the
    grid, and not with --confirm."""
    results = []

    def spy(*a, **k):
        results.append(tune(*a, **k))
        return results[-1]

    monkeypatch.setattr(tuned_eval, "tune", spy)
    out = tmp_path / "rows.jsonl"
    args = argparse.Namespace(json=out, cells=["long:backlog"], workers=[2], seeds=1,
                              first_seed=3, requests=300, batch=8, estimator="exact_match",
                              confirm=False, grid="wide", subgrid="turnover", min_gain=0.001)
    tuned_eval.run(args)
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    (result,) = results
    assert (line["seed"], line["grid"], line["subgrid"]) == (3, "wide", "turnover")
    assert len(result.rows) == len({c.params(BalanceRouteParams()) for c in GRIDS["wide"]})
    part = [r for r in result.rows if r["policy"] == "br0" or r["gamma"] == TURNOVER]
    assert 2 <= len(part) < len(result.rows)
    pick = choose(part)
    assert line["subgrid_pick"] == pick.label
    whole = load_trace("synth:long:seed=3", requests=600)
    later, past = whole.take(np.arange(300, 600)), whole.head(300)
    config = SimConfig(workers=2, batch=8, load="backlog", seed=3)
    name = "br0" if pick.policy == "br0" else "brh-exactmatch"
    again = replay(later, name, pick.params(BalanceRouteParams()), config, warm=past)
    assert line["later"]["tuned, turnover grid"]["throughput_tok_s"] == again["throughput_tok_s"]
    if pick == candidate_of(result.recommendation):
        assert line["later"]["tuned, turnover grid"] == line["later"]["tuned"]

    tuned_eval.table(argparse.Namespace(json=[out]))
    rows = {r.split(" | ")[2]: r.split(" | ") for r in capsys.readouterr().out.splitlines()
            if r.startswith("| long")}
    assert rows["tuned, turnover grid"][4] == pick.label
    ratio = again["throughput_tok_s"] / line["later"]["br0"]["throughput_tok_s"]
    assert rows["tuned, turnover grid"][5].startswith(f"{ratio:.4f} (")
    tuned_eval.run(args)
    assert len(out.read_text().splitlines()) == 1 and len(results) == 1  # resumed
    # the same draw tuned over the turnover grid alone: the same pick and replay, one draw
    tuned_eval.run(argparse.Namespace(**{**vars(args), "grid": "turnover", "subgrid": None}))
    alone = json.loads(out.read_text().splitlines()[1])
    default = BalanceRouteParams()
    assert candidate_of(alone["recommendation"]).params(default) == pick.params(default)
    assert alone["later"]["tuned"] == line["later"]["tuned, turnover grid"]
    tuned_eval.table(argparse.Namespace(json=[out]))
    rows = [r.split(" | ") for r in capsys.readouterr().out.splitlines()
            if r.startswith("| long")]
    assert all(r[3] == "1" for r in rows)  # one draw
    for bad in (["--confirm"], ["--grid", "turnover"]):
        refused = subprocess.run([*TOOL, "run", "--json", str(out), "--subgrid", "turnover",
                                  *bad], capture_output=True, text=True, cwd=ROOT)
        assert refused.returncode != 0 and "a part of --grid" in refused.stderr


def test_a_subgrid_pick_of_its_own_is_replayed_on_the_later_half(tmp_path, monkeypatch,
                                                                   tuned_eval):
    """Where the subgrid's pick is neither the grid's pick, BR-0 nor the defaults, it is
    replayed on the later half with the learner warmed on the past (the pick forced: a spy
    keeps what tuning's rule chose)."""
    forced = Candidate("brh", 200, None, TURNOVER)
    chosen = []

    forced_rows = []

    def forcing(rows, min_gain):
        chosen.append(chosen_row(rows, min_gain))
        forced_rows.append(next(r for r in rows if r["setting"] == forced.label))
        return forced_rows[-1]

    monkeypatch.setattr(tuned_eval, "chosen_row", forcing)
    out = tmp_path / "rows.jsonl"
    tuned_eval.run(argparse.Namespace(
        json=out, cells=["tpl:backlog"], workers=[2], seeds=1, first_seed=1, requests=200,
        batch=8, estimator="exact_match", confirm=False, grid="wide", subgrid="turnover",
        min_gain=0.001))
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    # named with the short-pool rule it replayed (the base's, where the point left it)
    assert len(chosen) == 1 and line["subgrid_pick"] == candidate_of(forced_rows[0]).label
    assert line["subgrid_pick"] == f"{forced.label} short-pool=br0"
    default = BalanceRouteParams()
    assert forced.params(default) not in (
        default, candidate_of(line["recommendation"]).params(default))
    whole = load_trace("synth:templated:seed=1", requests=400)
    config = SimConfig(workers=2, batch=8, load="backlog", seed=1)
    again = replay(whole.take(np.arange(200, 400)), "brh-exactmatch", forced.params(default),
                   config, warm=whole.head(200))
    mine = line["later"]["tuned, turnover grid"]
    assert (mine["throughput_tok_s"], mine["requests"]) == (again["throughput_tok_s"], 200)
    cold = replay(whole.take(np.arange(200, 400)), "brh-exactmatch", forced.params(default),
                  config)
    assert mine["throughput_tok_s"] != cold["throughput_tok_s"]  # the learner was warmed


def test_several_learners_judge_each_learners_own_pick_too(tmp_path, tuned_eval):
    """``--estimator exact_match,hazard``: tuning ranks both learners' rows; each learner's
    own pick (its rows and BR-0's) is replayed on the later half beside the pick over both,
    and each learner's untuned BR-H too; the table names the rules (``exact_match`` alone is
    the default's, a pooled run of it on the same draw must agree) and refuses nothing it
    pooled; ``--confirm`` is refused with several learners."""
    out = tmp_path / "rows.jsonl"
    common = dict(cells=["tpl:backlog"], workers=[4], seeds=1, first_seed=2, requests=400,
                  batch=8, confirm=False, grid="turnover", subgrid=None, min_gain=0.0)
    tuned_eval.run(argparse.Namespace(json=out, estimator="exact_match, hazard", **common))
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert set(line["learner_picks"]) == {"exact_match", "hazard"}
    assert {"brh-exactmatch", "brh-hazard", "tuned, turnover grid, min gain 0, hazard only",
            "tuned, turnover grid, min gain 0"} < set(line["later"])
    whole = load_trace("synth:templated:seed=2", requests=800)
    config = SimConfig(workers=4, batch=8, load="backlog", seed=2)
    for learner, name in (("exact_match", "tuned, turnover grid, min gain 0"),
                          ("hazard", "tuned, turnover grid, min gain 0, hazard only")):
        alone = tune(whole, config, estimator=learner, min_gain=0.0, holdout=0.5)
        assert line["learner_picks"][learner] == candidate_of(alone.recommendation).label
        mine = line["later"][name]
        assert mine["throughput_tok_s"] == alone.evaluation[-1]["throughput_tok_s"]
    # the default's own run of the same draw pools with it: its pick is the same rule's
    single = tmp_path / "single.jsonl"
    tuned_eval.run(argparse.Namespace(json=single, estimator="exact_match", **common))
    (one,) = [json.loads(x) for x in single.read_text().splitlines()]
    assert one["later"]["tuned"] == line["later"]["tuned, turnover grid, min gain 0"]
    table = tuned_eval_table(out, single)
    pooled = [r.split(" | ") for r in table.splitlines() if r.startswith("| tpl")]
    assert {r[2] for r in pooled} == {
        "tuned, turnover grid, min gain 0", "tuned, turnover grid, min gain 0, hazard only",
        "tuned, turnover grid, min gain 0, exact_match+hazard", "brh-exactmatch",
        "brh-hazard", "brh-oracle"}
    assert all(r[3] == "1" for r in pooled)  # one draw, counted once
    with pytest.raises(SystemExit, match="several learners"):
        tuned_eval.run(argparse.Namespace(json=out, estimator="exact_match,hazard",
                                          **{**common, "confirm": True}))


def tuned_eval_table(*paths: Path) -> str:
    return subprocess.run([*TOOL, "table", "--json", *map(str, paths)], check=True,
                          capture_output=True, text=True, cwd=ROOT).stdout
