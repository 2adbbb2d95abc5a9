"""Which rounds of a BR-H replay decide differently from BR-0 on the same state, by gamma.

    python tools/gamma_rounds.py --trace PATH --workers 4 --load 1.5 [--requests N]

Replays the trace with BR-H and true lengths (``brh-oracle``, the default parameters); at
every round it also routes the same fleet state and pool as BR-0 and compares the two
decisions. Prints the rounds in all, how many differ, and the differing ones by the round's
turnover discount (rounded to 0.1) and by whether the pool was short (every waiting request
admitted this round), with the first and last differing round numbers. The README's "Short
outputs" section quotes it on the Azure 2023 code trace.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router_client.admission import route_round  # noqa: E402
from router_client.policies import Decision, make_policy  # noqa: E402
from router_client.predictors import OraclePredictor  # noqa: E402
from router_client.simulator import SimConfig, simulate  # noqa: E402
from router_client.traces import load_trace  # noqa: E402


class Compared:
    """BR-H that also routes each round as BR-0 and counts where they differ."""

    name = "brh-oracle"
    needs_predictions = True

    def __init__(self) -> None:
        self.brh = make_policy("brh-oracle")
        self.br0 = self.brh.params.as_br0()
        self.rounds = 0
        self.differ: collections.Counter = collections.Counter()
        self.where: list[int] = []

    def route(self, fleet, pool) -> Decision:
        decision = self.brh.route(fleet, pool)
        self.rounds += 1
        if decision.assignments != route_round(fleet, pool, self.br0)[0]:
            gamma = decision.stats.extra["gamma"]  # the discount the round used
            short = len(pool) <= int(fleet.free_slots.sum())
            self.differ[(round(gamma, 1), short)] += 1
            self.where.append(self.rounds)
        return decision


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", required=True)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--load", default="1.0")
    ap.add_argument("--requests", type=int, default=None)
    args = ap.parse_args()
    trace = load_trace(args.trace, "auto", args.requests)
    load: float | str = args.load if args.load == "backlog" else float(args.load)
    policy = Compared()
    simulate(trace, policy, SimConfig(workers=args.workers, load=load),  # type: ignore[arg-type]
             OraclePredictor(trace.output_tokens))
    print(f"{policy.rounds} rounds, {len(policy.where)} decide differently from BR-0")
    for (gamma, short), count in sorted(policy.differ.items()):
        print(f"  gamma {gamma:.1f}, {'short pool' if short else 'saturated'}: {count}")
    if policy.where:
        print(f"  first differing rounds {policy.where[:10]}, last {policy.where[-3:]}")


if __name__ == "__main__":
    main()
