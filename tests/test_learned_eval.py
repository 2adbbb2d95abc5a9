"""tools/learned_eval.py: replicated learned-BR-H rows, resumable, and their table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = [sys.executable, str(ROOT / "tools" / "learned_eval.py")]


def test_learned_eval_runs_resumes_and_tabulates(tmp_path):
    out = tmp_path / "rows.jsonl"
    args = ["--json", str(out), "--cells", "tpl:backlog", "--seeds", "2", "--requests", "300"]
    subprocess.run([*TOOL, "run", *args], check=True, capture_output=True, cwd=ROOT)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["cell"], r["seed"], r["requests"]) for r in lines] == [
        ("tpl:backlog", 1, 300), ("tpl:backlog", 2, 300)]
    assert {r["policy"] for r in lines[0]["rows"]} == {
        "br0", "brh-survival", "brh-exactmatch", "brh-hazard", "brh-oracle"}
    subprocess.run([*TOOL, "run", *args], check=True, capture_output=True, cwd=ROOT)
    assert len(out.read_text().splitlines()) == 2  # resumed: nothing run twice
    table = subprocess.run([*TOOL, "table", "--json", str(out)], check=True,
                           capture_output=True, text=True, cwd=ROOT).stdout
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| tpl")]
    assert len(rows) == 4
    by = {r["policy"]: r for r in lines[0]["rows"]}
    by2 = {r["policy"]: r for r in lines[1]["rows"]}
    expected = [by[p]["throughput_tok_s"] / by["br0"]["throughput_tok_s"] for p in ("brh-hazard",)]
    expected += [by2["brh-hazard"]["throughput_tok_s"] / by2["br0"]["throughput_tok_s"]]
    hazard = next(r for r in rows if r[2] == "brh-hazard")
    assert hazard[1] == "2"
    assert hazard[4].startswith(f"{sum(expected) / 2:.4f} ({min(expected):.4f}..")


def test_learned_eval_several_fleet_sizes_and_a_variant(tmp_path):
    """--workers 4,8: one run, a table row per (cell, G); --ab-args reaches `ab`."""
    out = tmp_path / "rows.jsonl"
    subprocess.run([*TOOL, "run", "--json", str(out), "--cells", "tpl:0.8", "--seeds", "1",
                    "--requests", "300", "--workers", "4,8", "--policies", "br0,brh-oracle",
                    "--ab-args", "--stage1 lpt --horizon 20"],
                   check=True, capture_output=True, cwd=ROOT)
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["ab_args"] == ["--stage1", "lpt", "--horizon", "20"]
    assert sorted((r["workers"], r["policy"]) for r in line["rows"]) == [
        (4, "br0"), (4, "brh-oracle"), (8, "br0"), (8, "brh-oracle")]
    table = subprocess.run([*TOOL, "table", "--json", str(out)], check=True,
                           capture_output=True, text=True, cwd=ROOT).stdout
    cells = [row.split(" | ")[0] for row in table.splitlines() if row.startswith("| tpl")]
    assert cells == ["| tpl:0.8:G4", "| tpl:0.8:G8"]
    g8 = {r["policy"]: r for r in line["rows"] if r["workers"] == 8}
    ratio = g8["brh-oracle"]["throughput_tok_s"] / g8["br0"]["throughput_tok_s"]
    assert f"| {ratio:.4f} (" in table.splitlines()[-1]


def test_gap_closed_says_how_many_replicates_it_rests_on(tmp_path):
    """A replicate where the oracle's imbalance is not below BR-0's has no gap: it is left
    out of "gap closed", and the cell says on how many of its replicates the figure rests."""
    def row(policy, imbalance):
        return {"policy": policy, "workers": 8, "imbalance_maxmin_mean": imbalance,
                "throughput_tok_s": 100.0}

    lines = [{"cell": "tpl:1.0", "seed": 1, "rows": [row("br0", 10.0), row("brh-x", 8.0),
                                                     row("brh-oracle", 6.0)]},
             {"cell": "tpl:1.0", "seed": 2, "rows": [row("br0", 10.0), row("brh-x", 9.0),
                                                     row("brh-oracle", 11.0)]}]
    out = tmp_path / "rows.jsonl"
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    table = subprocess.run([*TOOL, "table", "--json", str(out)], check=True,
                           capture_output=True, text=True, cwd=ROOT).stdout
    x = next(line for line in table.splitlines() if "| brh-x |" in line)
    assert x.split(" | ")[1] == "2"
    closed, pooled = [c.strip() for c in x.rstrip(" |").split(" | ")[-2:]]
    assert closed == "0.50 (0.50..0.50; 1 of 2)"  # (10 - 8) / (10 - 6)
    # ratio of means: (1 - mean(0.8, 0.9)) / (1 - mean(0.6, 1.1)), standard error of the
    # mean of 0.8 and 0.9 (0.05) over the same 0.15
    assert pooled == "1.00 (+- 0.33)"


def test_table_pools_files_and_the_ratio_of_means_resists_a_small_gap(tmp_path):
    """Several --json files are one pool of replicates. A replicate whose own gap is tiny
    makes the mean of the per-replicate shares swing; the ratio of the mean imbalance ratios
    does not divide by it."""
    def line(seed, x, oracle):
        return json.dumps({"cell": "mooncake:backlog", "seed": seed, "rows": [
            {"policy": p, "workers": 8, "imbalance_maxmin_mean": i, "throughput_tok_s": 100.0}
            for p, i in (("br0", 100.0), ("brh-x", x), ("brh-oracle", oracle))]}) + "\n"

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(line(1, 90.0, 80.0) + line(2, 90.0, 80.0))
    b.write_text(line(1, 101.0, 99.0))  # gap 1: this replicate's share is -1
    table = subprocess.run([*TOOL, "table", "--json", str(a), str(b)], check=True,
                           capture_output=True, text=True, cwd=ROOT).stdout
    x = next(row for row in table.splitlines() if "| brh-x |" in row)
    cells = [c.strip() for c in x.strip(" |").split(" | ")]
    assert cells[1] == "3"
    assert cells[-2].startswith("0.00 (-1.00..0.50")  # (0.5 + 0.5 - 1) / 3
    # (1 - mean(0.9, 0.9, 1.01)) / (1 - mean(0.8, 0.8, 0.99)) = 0.0633 / 0.1367
    assert cells[-1].startswith("0.46 (+- ")
    run = subprocess.run([*TOOL, "run", "--json", str(a), str(b)], capture_output=True,
                         text=True, cwd=ROOT)
    assert run.returncode != 0 and "one --json" in run.stderr
