"""tools/run_length.py: imbalance and fleet load by tenth of the routing window."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = [sys.executable, str(ROOT / "tools" / "run_length.py")]


def test_tenths_add_up_to_the_ab_row_and_the_plot_is_drawn(tmp_path):
    """The tenths' step-weighted imbalance is the run's own ``imbalance_maxmin_mean`` (what
    ``ab`` reports), their steps are its routing steps, and the plot is written."""
    out = tmp_path / "rows.jsonl"
    subprocess.run([*TOOL, "run", "--json", str(out), "--workers", "4", "--requests", "300",
                    "--seeds", "1"], check=True, capture_output=True, cwd=ROOT)
    (line,) = [json.loads(text) for text in out.read_text().splitlines()]
    assert (line["requests"], line["seed"], line["workers"]) == (300, 1, 4)
    for name in ("br0", "brh-oracle"):
        run = line[name]
        steps, imbalance = np.array(run["steps"]), np.array(run["imbalance"])
        assert len(steps) == len(imbalance) == len(run["fleet_load"]) == 10
        assert steps.sum() == pytest.approx(run["routing_steps"])
        assert (steps * imbalance).sum() / steps.sum() == pytest.approx(
            run["imbalance_maxmin_mean"])
        assert run["fleet_load"][-1] > run["fleet_load"][0] > 0  # filling from empty
    png = tmp_path / "plot.png"
    subprocess.run([*TOOL, "plot", "--json", str(out), "--out", str(png)], check=True,
                   capture_output=True, cwd=ROOT)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_by_tenth_weighs_steps_and_counts_an_idle_stretch_as_zero():
    """Hand-made records over a window of 20 steps (0-19; the last admission at 19): 2 steps
    per tenth, an idle stretch of steps 4-6 (one record of weight 3, spread 0) counted in
    the tenth where it starts (steps 4-5), a record past the window (the drain) left out."""
    sys.path.insert(0, str(ROOT / "tools"))
    import run_length

    records = []  # (step, weight, top, low, total)
    for step in range(20):
        if step in (4, 5, 6):
            if step == 4:
                records.append((4, 3, 0.0, 0.0, 0.0))
            continue
        records.append((step, 1, 10.0 + step, 10.0, 100.0 + step))
    records.append((20, 1, 999.0, 0.0, 999.0))  # the drain: after the last admission
    m = SimpleNamespace(steps=[r[0] for r in records], weight=[r[1] for r in records],
                        top=[r[2] for r in records], low=[r[3] for r in records],
                        total=[r[4] for r in records], last_admission_step=19)
    out = run_length.by_tenth(SimpleNamespace(metrics=m))
    assert out["window_steps"] == 20
    assert out["steps"] == [2, 2, 3, 1, 2, 2, 2, 2, 2, 2]  # the idle 4-6 in tenth 2 (4-5)
    assert out["imbalance"][0] == pytest.approx(0.5)  # spreads 0 and 1
    assert out["imbalance"][2] == 0  # the idle stretch only
    assert out["imbalance"][3] == pytest.approx(7)  # step 7 alone
    assert out["imbalance"][9] == pytest.approx(18.5)
    assert out["fleet_load"][9] == pytest.approx(118.5)


def test_a_trace_with_parameters_and_a_mixed_file_are_refused(tmp_path):
    result = subprocess.run([*TOOL, "run", "--json", str(tmp_path / "unused.jsonl"), "--trace",
                             "synth:long:n=5"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and "synth:NAME workload" in result.stderr
    assert not (tmp_path / "unused.jsonl").exists()
    mixed = tmp_path / "mixed.jsonl"
    line = {"trace": "synth:long", "workers": 4, "load": "1.0", "requests": 10, "seed": 1}
    mixed.write_text(json.dumps(line) + "\n" + json.dumps({**line, "workers": 8}) + "\n")
    result = subprocess.run([*TOOL, "plot", "--json", str(mixed), "--out",
                             str(tmp_path / "x.png")], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode != 0 and "plot one at a time" in result.stderr
