"""tools/run_length.py: imbalance and fleet load by tenth of the routing window."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def test_a_trace_with_parameters_is_refused():
    result = subprocess.run([*TOOL, "run", "--json", "unused.jsonl", "--trace",
                             "synth:long:n=5"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and "synth:NAME workload" in result.stderr
