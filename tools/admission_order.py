"""Which requests a policy serves early and which it leaves for the drain.

    python tools/admission_order.py --trace mooncake --sample 4000 --seed 1 --workers 8 \
        --load 1.0 [--policies br0,brh-oracle] [--variant NAME=k=v,k=v ...] [--parts 10]

Replays one trace sample per policy (``balanceroute ab``'s simulator and defaults) and prints,
for each tenth of the admissions in the order they were made, the mean prompt of the
requests admitted in it, then how many requests ran past the routing window (finished after
the last admission) and their mean prompt, and the 95th percentile of the wait from arrival
to admission (in steps; at backlog from the start) with the mean prompt of the requests that
waited that long or longer. A policy whose later tenths hold heavier prompts than BR-0's
has left work for the drain: its window held less KV, which raises its ``tok/s`` without
better balance (README, "What a throughput ratio is made of"). A ``--variant``
(``tools/oracle_eval.py``'s syntax: :class:`BalanceRouteParams` fields) adds a
``brh-oracle`` run with those fields.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oracle_eval import parse_variant  # noqa: E402  (tools/ beside this script)
from tracepaths import FILES  # noqa: E402

from predictor import abtest  # noqa: E402
from router_client.admission import BalanceRouteParams  # noqa: E402
from router_client.simulator import SimConfig, arrival_steps, simulate  # noqa: E402
from router_client.traces import Trace, load_trace  # noqa: E402


def admission_profile(trace: Trace, policy: str, config: SimConfig, parts: int,
                      fields: dict[str, object] | None = None) -> dict[str, object]:
    """Mean prompt per ``parts``-quantile of the admission order, and the requests that ran
    past the window (finished after the last admission step)."""
    params = BalanceRouteParams(**{**(fields or {}),  # type: ignore[arg-type]
                                   "horizon": config.horizon})
    result = simulate(trace, abtest.make_policy(policy, seed=config.seed, params=params), config,
                      abtest.make_predictor(policy, trace))
    admitted = np.flatnonzero(result.admit_step >= 0)
    order = admitted[np.argsort(result.admit_step[admitted], kind="stable")]
    prompts = trace.prompt_tokens.astype(np.float64)
    tenths = [float(prompts[chunk].mean()) for chunk in np.array_split(order, parts)]
    last = int(result.admit_step.max())
    past = np.flatnonzero(result.finish_step > last)
    # the longest waits (arrival to admission, in steps; at a numeric load) and their prompts
    arrived = (np.zeros(len(trace)) if config.backlog else arrival_steps(trace, config))
    wait = (result.admit_step - arrived)[admitted]
    slowest = admitted[wait >= np.percentile(wait, 95)]
    return {"policy": policy, "parts": tenths, "past_window": int(past.size),
            "wait_p95_steps": float(np.percentile(wait, 95)),
            "slowest_prompt": float(prompts[slowest].mean()),
            "past_window_prompt": float(prompts[past].mean()) if past.size else 0.0,
            "throughput_tok_s": result.row["throughput_tok_s"],
            "balanced_bound_tok_s": result.row["balanced_bound_tok_s"],
            "makespan_s": result.row["makespan_s"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default="mooncake",
                        help=f"{', '.join(FILES)} or a trace file (default mooncake)")
    parser.add_argument("--sample", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--load", default="1.0")
    parser.add_argument("--policies", default="br0,brh-oracle")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=k=v,k=v: brh-oracle with these BalanceRouteParams fields")
    parser.add_argument("--parts", type=int, default=10)
    args = parser.parse_args(argv)
    path = str(FILES.get(args.trace, args.trace))
    trace = load_trace(path).sample(args.sample, args.seed)
    load = args.load if args.load == "backlog" else float(args.load)
    config = SimConfig(workers=args.workers, batch=args.batch, load=load, seed=args.seed,
                       record_trajectory=False)
    policies = abtest.validate_policies(args.policies.split(","))
    print(f"{path}: a sample of {args.sample} (seed {args.seed}), G={args.workers}, "
          f"B={args.batch}, load {args.load}; mean prompt per {args.parts}-quantile of the "
          "admission order")
    runs = [(policy, policy, {}) for policy in policies]
    runs += [(name, "brh-oracle", fields) for name, fields in map(parse_variant, args.variant)]
    for label, policy, fields in runs:
        p = admission_profile(trace, policy, config, args.parts, fields)
        parts = " ".join(f"{value:7.0f}" for value in p["parts"])  # type: ignore[union-attr]
        print(f"{label:<15} {parts} | past the window {p['past_window']} (mean prompt "
              f"{p['past_window_prompt']:.0f}) | tok/s {p['throughput_tok_s']:.0f}, bound "
              f"{p['balanced_bound_tok_s']:.0f}, makespan {p['makespan_s']:.1f} s | wait p95 "
              f"{p['wait_p95_steps']:.0f} steps, the slowest 5% mean prompt "
              f"{p['slowest_prompt']:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
