"""tools/bound_share.py: a throughput ratio split into the bound ratio and the share ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = [sys.executable, str(ROOT / "tools" / "bound_share.py")]


def _row(policy: str, throughput: float, bound: float, makespan: float = 100.0) -> dict:
    return {"workers": 8, "policy": policy, "throughput_tok_s": throughput,
            "balanced_bound_tok_s": bound, "makespan_s": makespan}


def test_bound_share_splits_hand_worked_ratios(tmp_path):
    # Replay 1: BR-H 1.03x BR-0's tok/s, all of it from a 3% higher bound (share 1.0).
    # Replay 2: 1.02x tok/s on a 1% higher bound: share 1.02 / 1.01.
    learned = tmp_path / "learned.jsonl"
    learned.write_text("\n".join(json.dumps({"cell": "mooncake:1.0", "rows": rows}) for rows in (
        [_row("br0", 1000.0, 1050.0), _row("brh-oracle", 1030.0, 1081.5, makespan=102.0)],
        [_row("br0", 1000.0, 1000.0), _row("brh-oracle", 1020.0, 1010.0)])) + "\n")
    oracle = tmp_path / "oracle.jsonl"
    oracle.write_text(json.dumps({
        "trace": "azure", "load": "backlog", "workers": 4, "variant": "default",
        "br0": _row("br0", 500.0, 520.0), "oracle": _row("brh-oracle", 499.0, 520.0)}) + "\n")
    out = subprocess.run([*TOOL, str(learned), str(oracle)], check=True, capture_output=True,
                         text=True, cwd=ROOT).stdout
    lines = {line.split()[0] + line.split()[1]: line.split() for line in out.splitlines()[1:]
             if line.startswith(("mooncake", "azure"))}
    moon = lines["mooncake:1.08"]
    assert moon[2:4] == ["brh-oracle", "2"]
    assert float(moon[4]) == round((1.03 + 1.02) / 2, 4)
    assert float(moon[5]) == round((1.03 + 1.01) / 2, 4)
    assert float(moon[6]) == round((1.0 + 1.02 / 1.01) / 2, 4)
    assert float(moon[7]) == round((100 / 102 + 1.0) / 2, 4)  # finished later in replay 1
    azure = lines["azure:backlog4"]
    assert azure[2] == "brh-oracle:default" and float(azure[6]) == round(499 / 500, 4)
    assert ("2 cells; share ratio below 0.999 in 1, lowest 0.9980; whole run below 0.999 in 1, "
            f"lowest {(100 / 102 + 1.0) / 2:.4f}") in out


def test_admission_order_reads_every_admission_in_order(tmp_path):
    """tools/admission_order.py: the quarters' mean prompts average to the trace's mean (every
    request admitted once), and a variant runs beside the policies."""
    from router_client.traces import load_trace

    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "admission_order.py"), "--trace",
         "synth:templated:n=400", "--sample", "400", "--workers", "2", "--batch", "8",
         "--load", "backlog", "--parts", "4", "--variant", "always=guard=always"],
        check=True, capture_output=True, text=True, cwd=ROOT).stdout
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {"br0", "brh-oracle", "always"}
    trace = load_trace("synth:templated:n=400").sample(400, 1)
    for line in rows.values():
        quarters = [float(v) for v in line.split("|")[0].split()[1:]]
        assert len(quarters) == 4
        assert abs(sum(quarters) / 4 - float(trace.prompt_tokens.mean())) < 1.0
        past = int(line.split("past the window ")[1].split()[0])
        assert 0 < past <= 2 * 8  # at most a full fleet runs on after the last admission


def test_ab_names_a_ratio_made_of_the_windows_work():
    """ab's note splits a tok/s ratio into the window's work (the bound) and the routing (the
    share), for rows whose bound is 0.5% or more from BR-0's; none when all are within."""
    from predictor.abtest import window_note

    def row(policy, throughput, bound, workers=8):
        return {"policy": policy, "workers": workers, "throughput_tok_s": throughput,
                "balanced_bound_tok_s": bound}

    rows = [row("br0", 1000.0, 1050.0), row("brh-oracle", 1030.0, 1071.0),
            row("jsq", 900.0, 1052.0), row("br0", 500.0, 520.0, 4)]
    note = window_note(rows)
    assert note is not None
    assert "brh-oracle at G=8: tok/s +3.00% = its window's work +2.00% x its routing " \
           f"{1.03 / 1.02 - 1:+.2%}" in note
    assert "jsq" not in note  # its bound 0.19% from BR-0's
    assert window_note([row("br0", 1000.0, 1050.0), row("jsq", 900.0, 1052.0)]) is None
    assert window_note([row("brh-oracle", 1030.0, 1071.0)]) is None  # no BR-0 to compare
