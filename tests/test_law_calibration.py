"""tools/law_calibration.py: the law BR-H reads, against the completions that came."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = [sys.executable, str(ROOT / "tools" / "law_calibration.py")]


def test_law_calibration_tabulates_both_shapes():
    """A short templated run under each end shape: four buckets of elapsed steps, each with
    requests counted and four ratios; by 80 steps (the whole window, where the shape does
    not matter) the law's expected completions are within 2x of those that came."""
    tables = {}
    for shape in ("exponential", "uniform"):
        out = subprocess.run([*TOOL, "--trace", "synth:templated", "--requests", "1500",
                              "--workers", "4", "--policy", "brh-survival", "--end-shape",
                              shape], check=True, capture_output=True, text=True,
                             cwd=ROOT).stdout
        rows = [line.strip("| ").split(" | ") for line in out.splitlines()
                if line.startswith("| ") and line[2].isdigit()]
        assert [r[0] for r in rows] == ["0", "1-3", "4-6", "7+"]
        assert all(int(r[1]) > 0 for r in rows)
        tables[shape] = rows
    for rows in tables.values():
        assert all(0.5 < float(r[5]) < 2.0 for r in rows)
