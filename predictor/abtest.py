"""A/B comparison of routing policies by trace replay (composition root for the simulator).

Wires each policy name to its predictor (``brh-oracle``: true lengths; ``brh-survival``,
``brh-exactmatch`` and any ``brh-<estimator>``: in-process online learners that see only
requests that finished earlier in the same run) and runs the simulator for every
(workers, policy) pair. Used by ``balanceroute ab`` and the REST A/B endpoint.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from router_client.admission import BalanceRouteParams
from router_client.errors import UnknownPolicyError
from router_client.policies import make_policy, policy_specs
from router_client.predictors import FinishedBatch, OraclePredictor, Predictor
from router_client.simulator import SimConfig, SimResult, bound_share, simulate
from router_client.traces import Trace

from .estimators import estimator_specs, spec_for_policy
from .estimators.in_process import LearnerPredictor
from .settings import Settings

log = logging.getLogger(__name__)

BASELINE_FOR_RATIOS = "jsq"


ORACLE_POLICY = "brh-oracle"


def known_policies() -> list[str]:
    """Every policy an A/B comparison can run: the registered policies that need no
    predictor, one ``brh-<name>`` per registered estimator, and the oracle."""
    plain = [p.name for p in policy_specs() if not p.needs_predictions]
    return [*plain, *(e.policy for e in estimator_specs()), ORACLE_POLICY]


def default_policies() -> list[str]:
    """What ``ab`` runs when not told: every known policy but ``random`` and the bare ``brh``
    (which needs a predictor named by its suffix)."""
    return [p for p in known_policies() if p not in ("random", "brh")]


def estimator_name(policy: str) -> str:
    """The estimator behind a learned ``brh-*`` policy (``brh-exactmatch`` -> ``exact_match``)."""
    spec = spec_for_policy(policy)
    if spec is None:
        raise UnknownPolicyError(policy, known_policies())
    return spec.name


def validate_policies(names: Sequence[str]) -> list[str]:
    known = known_policies()
    for name in names:
        if name not in known:
            raise UnknownPolicyError(name, known)
    return list(names)


def make_predictor(policy: str, trace: Trace, settings: Settings | None = None
                   ) -> Predictor | None:
    """The in-process predictor of ``policy``: true lengths for the oracle, a fresh estimator
    (the service's settings) for ``brh-<estimator>``, none for the rest."""
    if policy == ORACLE_POLICY:
        return OraclePredictor(trace.output_tokens)
    spec = spec_for_policy(policy)
    return LearnerPredictor(spec.build(settings)) if spec is not None else None


def warm_up(predictor: Predictor | None, past: Trace | None) -> None:
    """Teach ``predictor`` the requests of ``past`` as finished, before a replay of the
    traffic after them (a running service's state); nothing without a learner or a past."""
    if predictor is None or past is None:
        return
    predictor.observe(FinishedBatch(
        np.arange(len(past)), past.prompt_tokens, past.output_tokens, past.censored,
        list(past.prompt_keys)))


def http_predictor_factory(url: str, run_tag: str, timeout_s: float = 0.5,
                           token: str | None = None) -> Callable[[str, Trace], Predictor | None]:
    """BR-H policies query a running prediction service (the production code path);
    ``brh-oracle`` keeps true lengths. Each run gets its own request-id prefix, so replays
    do not collide on the service's idempotency key; the service keeps learning across them."""
    from router_client.http_predictor import HttpPredictor

    counter = iter(range(1_000_000))

    def factory(policy: str, trace: Trace) -> Predictor | None:
        if policy == ORACLE_POLICY or spec_for_policy(policy) is None:
            return make_predictor(policy, trace)
        predictor = HttpPredictor(url, estimator_name(policy), timeout_s=timeout_s, token=token,
                                  id_prefix=f"{run_tag}-{next(counter)}-{policy}-",
                                  report="sync", follow_recommendation=False)
        created.append(predictor)
        return predictor

    created: list = []
    factory.created = created  # type: ignore[attr-defined]  # the caller checks config_error
    return factory


@dataclass
class Comparison:
    rows: list[dict]
    trajectories: dict[tuple[int, str], np.ndarray]
    switches: dict[tuple[int, str], list] = field(default_factory=dict)


def run_comparison(
    trace: Trace,
    policies: Sequence[str],
    workers: Sequence[int],
    config: SimConfig,
    progress: Callable[[float, str], None] | None = None,
    predictor_factory: Callable[[str, Trace], Predictor | None] = make_predictor,
    params: BalanceRouteParams | None = None,
    warm: Trace | None = None,
) -> Comparison:
    """Replay ``trace`` through every (workers, policy); rows in that order.

    ``params`` configures BR-0 and BR-H (its horizon is the simulation's ``config.horizon``).
    ``warm``: requests that finished before ``trace`` began; every run's learner knows them
    before its replay starts, as a running service's would (true lengths and the policies
    without a predictor ignore them). Each row then says how many (``warm_requests``).
    """
    validate_policies(policies)
    params = replace(params or BalanceRouteParams(), horizon=config.horizon)
    runs = [(g, p) for g in workers for p in policies]
    rows: list[dict] = []
    trajectories: dict[tuple[int, str], np.ndarray] = {}
    switches: dict[tuple[int, str], list] = {}
    for number, (g, name) in enumerate(runs):
        label = f"[{number + 1}/{len(runs)}] G={g} {name}"

        def report(fraction: float, number: int = number, label: str = label) -> None:
            if progress is not None:
                progress((number + fraction) / len(runs), label)

        policy = make_policy(name, seed=config.seed, params=params)
        predictor = predictor_factory(name, trace)
        try:
            warm_up(predictor, warm)
            result: SimResult = simulate(trace, policy, replace(config, workers=g), predictor,
                                         report)
        finally:
            close = getattr(predictor, "close", None)
            if close is not None:
                close()
        result.row["fallback_switches"] = len(result.switches)
        if warm is not None:
            result.row["warm_requests"] = len(warm)
        rows.append(result.row)
        if result.switches:
            switches[(g, name)] = result.switches
        if result.loads is not None:
            trajectories[(g, name)] = result.loads
        log.info("%s done in %.1fs", label, result.row["sim_wall_s"])
    _add_ratios(rows)
    return Comparison(rows, trajectories, switches)


def _add_ratios(rows: list[dict]) -> None:
    reference = {r["workers"]: r for r in rows if r["policy"] == BASELINE_FOR_RATIOS}
    for row in rows:
        row["bound_fraction"] = bound_share(row)
        ref = reference.get(row["workers"])
        if ref is not None and ref["throughput_tok_s"] and ref["imbalance_maxmin_mean"]:
            row["throughput_vs_jsq"] = row["throughput_tok_s"] / ref["throughput_tok_s"]
            row["imbalance_vs_jsq"] = row["imbalance_maxmin_mean"] / ref["imbalance_maxmin_mean"]


TABLE_COLUMNS = [
    ("G", "workers", "{:>3}"),
    ("policy", "policy", "{:<15}"),
    ("tok/s", "throughput_tok_s", "{:>9.1f}"),
    ("x jsq", "throughput_vs_jsq", "{:>6.3f}"),
    ("of bound", "bound_fraction", "{:>8.2%}"),
    ("run tok/s", "run_throughput_tok_s", "{:>9.1f}"),
    ("max-min", "imbalance_maxmin_mean", "{:>9.0f}"),
    ("x jsq", "imbalance_vs_jsq", "{:>6.3f}"),
    ("I(k)", "imbalance_total_mean", "{:>9.0f}"),
    ("I(k) end", "imbalance_total_after_step_mean", "{:>9.0f}"),
    ("idle", "barrier_idle_fraction", "{:>6.2%}"),
    ("TPOT p95", "tpot_p95_ms", "{:>8.1f}"),
    ("TTFT p95", "ttft_p95_ms", "{:>9.0f}"),
    ("guard", "starvation_guard_admissions", "{:>6}"),
    ("fallback", "fallback_steps", "{:>8}"),
    ("switches", "fallback_switches", "{:>8}"),
    ("sim s", "sim_wall_s", "{:>6.1f}"),
]


def format_table(rows: Sequence[dict]) -> str:
    """A plain-text table, one line per (workers, policy)."""
    header = []
    for title, _, fmt in TABLE_COLUMNS:
        width = len(fmt.format(0.0)) if "f" in fmt or "%" in fmt else None
        header.append(title.rjust(width) if width else fmt.replace(".1f", "").format(title))
    lines = [" ".join(header)]
    for row in rows:
        cells = []
        for _, key, fmt in TABLE_COLUMNS:
            value = row.get(key)
            if value is None:
                width = len(fmt.format(0.0)) if ("f" in fmt or "%" in fmt) else 6
                cells.append("-".rjust(width))
            else:
                cells.append(fmt.format(value))
        lines.append(" ".join(cells))
    return "\n".join(lines)


def uncontended_note(rows: Sequence[dict], requests: str = "--requests",
                     load: str = "--load") -> str | None:
    """A warning when, at some fleet size, no run ever had more requests waiting than free
    slots (``contended_steps`` 0): every request found a slot at once, so the policies
    differ only in where they put it, and BR-H's settings all place as BR-0 does (a short
    pool). Users tuning on a quiet stretch of their trace should know their table says so.
    ``requests`` and ``load`` name the settings to change, as the caller takes them (the CLI's
    flags by default; a REST job's fields)."""
    quiet = sorted({row["workers"] for row in rows}
                   - {row["workers"] for row in rows if row.get("contended_steps", 0) > 0})
    if not quiet or any("contended_steps" not in row for row in rows):
        return None
    fleets = ", ".join(f"G={g}" for g in quiet)
    return (f"note ({fleets}): no request ever waited for a slot (the fleet never filled), so "
            "the rows differ only in where requests were placed and BR-H's settings route as "
            f"BR-0; compare on a busier stretch, more requests ({requests}) or a higher {load}")


# A bound this far from BR-0's (either way) means the windows held different work.
WINDOW_WORK_NOTED = 0.005


def window_note(rows: Sequence[dict]) -> str | None:
    """A warning naming the rows whose routing window held noticeably lighter or heavier work
    than BR-0's in the same replay (balanced bound more than 0.5% apart): their ``tok/s``
    ratio then mixes that work with the routing, and ``of bound`` is the routing's share
    (README, "What a throughput ratio is made of")."""
    reference = {r["workers"]: r for r in rows if r["policy"] == "br0"}
    parts = []
    for row in rows:
        ref = reference.get(row["workers"])
        if row["policy"] == "br0" or ref is None or not (
                ref["balanced_bound_tok_s"] and ref["throughput_tok_s"]
                and row["balanced_bound_tok_s"]):
            continue
        bound = row["balanced_bound_tok_s"] / ref["balanced_bound_tok_s"]
        if abs(bound - 1.0) < WINDOW_WORK_NOTED:
            continue
        throughput = row["throughput_tok_s"] / ref["throughput_tok_s"]
        parts.append(f"{row['policy']} at G={row['workers']}: tok/s {throughput - 1:+.2%} = "
                     f"its window's work {bound - 1:+.2%} x its routing "
                     f"{throughput / bound - 1:+.2%}")
    if not parts:
        return None
    return ("note: against BR-0 in the same replay, " + "; ".join(parts) + " (the work a "
            "window holds: a policy that leaves heavy requests for the drain runs a lighter "
            "one; the routing is 'of bound', the whole run 'run tok/s')")


def write_csv(rows: Sequence[dict], path: Path) -> None:
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def write_plots(comparison: Comparison, out: Path, title: str) -> list[Path]:
    """Per-worker load trajectories and throughput/imbalance by policy and worker count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    rows = comparison.rows
    for g in sorted({k[0] for k in comparison.trajectories}):
        names = [k[1] for k in comparison.trajectories if k[0] == g]
        fig, axes = plt.subplots(len(names), 1, figsize=(10, 2.2 * len(names)), sharex=True,
                                 squeeze=False)
        top = max(float(comparison.trajectories[(g, n)].max()) for n in names) or 1.0
        for ax, name in zip(axes[:, 0], names, strict=True):
            loads = comparison.trajectories[(g, name)]
            stride = max(1, loads.shape[0] // 3000)
            ax.plot(np.arange(0, loads.shape[0], stride), loads[::stride] / 1000.0, lw=0.5)
            ax.set_ylim(0, top / 1000.0 * 1.05)
            ax.set_ylabel("KV k-tokens")
            ax.set_title(f"{name}: per-worker KV load (G={g})", fontsize=9, loc="left")
        axes[-1, 0].set_xlabel("decode step")
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        path = out / f"trajectories_G{g}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    policies = list(dict.fromkeys(r["policy"] for r in rows))
    workers = sorted({r["workers"] for r in rows})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(policies))
    for i, name in enumerate(policies):
        xs = np.arange(len(workers)) + i * width
        by_g = {r["workers"]: r for r in rows if r["policy"] == name}
        ax1.bar(xs, [by_g[g]["bound_fraction"] * 100 if g in by_g else 0 for g in workers],
                width, label=name)
        ax2.bar(xs, [by_g[g]["imbalance_maxmin_mean"] / 1000 if g in by_g else 0
                     for g in workers], width, label=name)
    for ax, label in ((ax1, "throughput, % of balanced bound"),
                      (ax2, "mean max-min KV load (k tokens)")):
        ax.set_xticks(np.arange(len(workers)) + 0.4 - width / 2)
        ax.set_xticklabels([f"G={g}" for g in workers])
        ax.set_ylabel(label)
    low = min(r["bound_fraction"] for r in rows) * 100
    ax1.set_ylim(max(0.0, low - 2), 100.5)
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = out / "throughput_imbalance.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
