"""Is the law BR-H reads calibrated at the moment it reads it? Completions expected against
those that come, by the steps since the answer was given.

    python tools/law_calibration.py --trace mooncake --policy brh-hazard [--end-shape uniform]

Replays a trace with a learned BR-H (``balanceroute ab``'s defaults; ``--end-shape`` picks
the end-time law and how an answer ages between refreshes). Every third round after the
first 200 steps it records, for each running request, the law the round reads (``p_fin``
and ``mu_rem`` as the prediction cache aged them), the steps since the answer was asked
for, and the request's true remaining life. It prints, per bucket of elapsed steps, the
completions the law expects within k = 1, 5, 20 and 80 steps over those that came (1.00:
calibrated); requests without an answer (no law) are left out. The README's "An answer's
law, aged" section quotes it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tracepaths import trace_file  # noqa: E402  (tools/ beside this script)

from predictor.cli import main as balanceroute  # noqa: E402
from router_client import simulator  # noqa: E402
from router_client.projection import end_cdf, end_law, end_rate, end_window  # noqa: E402

BUCKETS = [("0", 0, 0), ("1-3", 1, 3), ("4-6", 4, 6), ("7+", 7, 10**9)]
WITHIN = (1, 5, 20, 80)


class Recording(simulator.Simulation):
    """A simulation that records the law each sampled round reads (see the module doc)."""

    records: list[tuple[np.ndarray, ...]] = []

    def _route(self) -> None:
        if self.policy.needs_predictions and self.step > 200 and self.step % 3 == 0:
            active = self.engine.active
            ids = self.engine.request[active]
            generated = self.engine.generated[active]
            view = self.cache.annotate(self.engine.view(), ids.tolist(), [], self.step,
                                       generated)
            if view.active_p_fin is not None:
                elapsed = self.cache._elapsed(ids.tolist(), self.step, generated)
                self.records.append((view.active_p_fin.copy(), view.active_mu_rem.copy(),
                                     elapsed, self.outputs[ids] - generated))
        super()._route()


def expected_within(p: np.ndarray, mu: np.ndarray, k: int, horizon: int, shape: str
                    ) -> np.ndarray:
    """``p_fin * P(T <= k)`` under the end-time law of ``shape`` with mean ``mu``."""
    if shape == "exponential":
        return p * end_cdf(np.minimum(k / horizon, 1.0), end_rate(mu, horizon))
    low, high = end_window(mu, horizon)
    return p * np.clip((k - low) / np.maximum(high - low, 1e-9), 0.0, 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True,
                    help="azure, mooncake, sharegpt, or synth:<name> (with --requests)")
    ap.add_argument("--policy", default="brh-hazard")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--load", default="backlog")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--end-shape", default="exponential", choices=["exponential", "uniform"])
    args = ap.parse_args()
    horizon = 80  # ab's default
    source = (["--trace", f"{args.trace}:seed={args.seed}", "--requests", str(args.requests)]
              if args.trace.startswith("synth:") else
              ["--trace", trace_file(args.trace), "--sample", str(args.requests)])
    simulator.Simulation = Recording  # simulate() builds the module's Simulation
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        code = balanceroute(["ab", *source, "--seed", str(args.seed), "--workers",
                             str(args.workers), "--load", args.load, "--policies", args.policy,
                             "--end-shape", args.end_shape, "--horizon", str(horizon),
                             "--quiet", "--json", str(Path(tmp) / "rows.json")])
    if code != 0:
        raise SystemExit(f"ab failed ({code})")
    p_fin, mu_rem, elapsed, remaining = (np.concatenate(column)
                                         for column in zip(*Recording.records, strict=True))
    p, mu = end_law(p_fin, mu_rem, horizon)
    known = ~((p == 0) & (mu >= horizon - 1e-6))
    print(f"{args.trace} {args.load} G = {args.workers}, {args.policy}, end shape "
          f"{args.end_shape}: completions expected within k steps / those that came")
    print("| steps since the answer | requests x rounds | "
          + " | ".join(f"k = {k}" for k in WITHIN) + " |")
    print("|---|---:|" + "---:|" * len(WITHIN))
    for label, low, high in BUCKETS:
        mask = known & (elapsed >= low) & (elapsed <= high)
        cells = []
        for k in WITHIN:
            came = int((remaining[mask] <= k).sum())
            expected = float(expected_within(p[mask], mu[mask], k, horizon,
                                             args.end_shape).sum())
            cells.append(f"{expected / came:.2f}" if came else "n/a")
        print(f"| {label} | {int(mask.sum())} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
