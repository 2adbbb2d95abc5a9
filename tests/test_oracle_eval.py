"""tools/oracle_eval.py: BR-H with true lengths against BR-0 under variants, and the table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = [sys.executable, str(ROOT / "tools" / "oracle_eval.py")]
sys.path.insert(0, str(ROOT / "tools"))

import oracle_eval  # noqa: E402


def test_variants_parse_into_balance_route_params_and_bad_ones_fail():
    assert oracle_eval.parse_variant("lpt=") == ("lpt", {})
    assert oracle_eval.parse_variant("bp=short_pool=best-pair,turnover_scale=0.5,refill=true") == (
        "bp", {"short_pool": "best-pair", "turnover_scale": 0.5, "refill": True})
    with pytest.raises(Exception, match="short_pool"):
        oracle_eval.parse_variant("x=short_pool=largest")
    assert oracle_eval.parse_variant("w=r_max=16") == ("w", {"r_max": 16})
    assert isinstance(oracle_eval.parse_variant("w=r_max=16")[1]["r_max"], int)
    with pytest.raises(SystemExit, match="horizon"):
        oracle_eval.parse_variant("h=horizon=20")


def test_replicates_are_disjoint_windows_then_seeded_samples():
    """Replicate k of a file trace is its k-th window while the trace holds one, then a
    seeded sample in trace order: never a shifted copy of another replicate."""
    full = oracle_eval.load_trace(oracle_eval.TRACES["azure"], "auto", None)
    n = 6000  # the bundled Azure trace holds 19,366: windows 0, 1, 2, then samples
    reps = [oracle_eval.replicate("azure", k, n) for k in range(5)]
    assert all(len(r) == n for r in reps)
    for k in range(3):
        np.testing.assert_array_equal(reps[k].prompt_tokens,
                                      full.prompt_tokens[k * n:(k + 1) * n])
    for k in (3, 4):
        np.testing.assert_array_equal(reps[k].prompt_tokens,
                                      full.sample(n, k).prompt_tokens)
        assert np.all(np.diff(reps[k].arrival_s) >= 0)  # trace order, arrivals kept
    assert not np.array_equal(reps[3].prompt_tokens, reps[4].prompt_tokens)


def test_families_share_br0_and_the_table_flags_what_misses(tmp_path):
    """Two variants on one small family cell: BR-0 runs once and is the reference of both;
    the ratios in a row are its oracle's throughput and imbalance over BR-0's; the table's
    cell is their mean (one run) and flags a throughput ratio below 0.999."""
    out = tmp_path / "rows.jsonl"
    subprocess.run([*TOOL, "families", "--json", str(out), "--output-means", "60",
                    "--prompt-means", "3000", "--loads", "0.8", "--workers", "4",
                    "--requests", "400", "--variant", "lpt=",
                    "--variant", "bp=short_pool=best-pair"],
                   check=True, capture_output=True, cwd=ROOT)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["variant"], r["trace"], r["load"], r["workers"]) for r in rows] == [
        ("lpt", "long-o60-p3000", "0.8", 4), ("bp", "long-o60-p3000", "0.8", 4)]
    assert rows[0]["br0"] == rows[1]["br0"]
    assert rows[0]["oracle"] != rows[1]["oracle"]  # the short-pool rules decide differently
    for r in rows:
        assert r["throughput_ratio"] == pytest.approx(
            r["oracle"]["throughput_tok_s"] / r["br0"]["throughput_tok_s"])
        assert r["oracle"]["completed"] == r["br0"]["completed"] == 400
    table = subprocess.run([*TOOL, "table", "--json", str(out)], check=True,
                           capture_output=True, text=True, cwd=ROOT).stdout
    line = next(x for x in table.splitlines() if x.startswith("| long-o60-p3000"))
    cells = [c.strip() for c in line.strip("|").split("|")][3:]
    for cell, r in zip(cells, rows, strict=True):
        assert cell.startswith(f"{r['throughput_ratio']:.4f}, {r['imbalance_ratio']:.3f}")
        assert ("**T**" in cell) == (r["throughput_ratio"] < 0.999)


def test_table_measures_throughput_three_ways(tmp_path):
    """--measure picks the ratio the T flag judges: tok/s over the routing window, the share
    of each run's own balanced bound, or the whole run; a row without the fields a measure
    needs is an error naming its line."""
    def row(seed, tok, bound, run):
        return {"variant": "v", "trace": "t", "load": "1.5", "workers": 8, "seed": seed,
                "throughput_ratio": tok / 100.0, "imbalance_ratio": 0.9,
                "br0": {"throughput_tok_s": 100.0, "balanced_bound_tok_s": 101.0,
                        "run_throughput_tok_s": 50.0},
                "oracle": {"throughput_tok_s": tok, "balanced_bound_tok_s": bound,
                           "run_throughput_tok_s": run}}

    out = tmp_path / "rows.jsonl"
    # a window that held heavier work: 1.5% fewer tokens a second, a bound 1.6% lower
    out.write_text(json.dumps(row(0, 98.5, 99.4, 50.4)) + "\n"
                   + json.dumps(row(1, 98.7, 99.6, 50.2)) + "\n")

    def cell(measure):
        table = subprocess.run([*TOOL, "table", "--json", str(out), "--measure", measure],
                               check=True, capture_output=True, text=True, cwd=ROOT).stdout
        return next(x for x in table.splitlines() if x.startswith("| t |")).split(" | ")[3]

    assert cell("tok/s").startswith("0.9860, 0.900 **T")
    share = np.mean([(98.5 / 99.4) / (100 / 101), (98.7 / 99.6) / (100 / 101)])
    assert cell("share").startswith(f"{share:.4f}, 0.900") and share > 0.999
    assert "T" not in cell("share")
    assert cell("run").startswith(f"{np.mean([50.4 / 50, 50.2 / 50]):.4f}")
    bare = dict(row(0, 98.5, 99.4, 50.4))
    del bare["oracle"]["run_throughput_tok_s"]
    out.write_text(json.dumps(bare) + "\n")
    failed = subprocess.run([*TOOL, "table", "--json", str(out), "--measure", "run"],
                            capture_output=True, text=True, cwd=ROOT)
    assert failed.returncode != 0 and f"{out}:1" in failed.stderr
