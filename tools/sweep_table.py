"""Markdown table from tools/sweep_defaults.py output: each config against ltl, same trace,
G and load: I(k) how many times lower, throughput gain, share of the balanced bound."""

from __future__ import annotations

import json
import sys
from pathlib import Path

PEER = {("Azure", 4): "6.5x / +4.1%", ("Azure", 8): "6.5x / +5.9%",
        ("Azure", 16): "5.6x / +7.0%", ("Mooncake", 4): "15.6x / +13.8%",
        ("Mooncake", 8): "23.7x / +21.4%", ("Mooncake", 16): "32.5x / +29.1%"}


def short(trace: str) -> str:
    for key, name in (("Azure", "Azure"), ("conversation", "Mooncake"), ("sharegpt", "ShareGPT"),
                      ("synth", "synth:long")):
        if key in trace:
            return name
    return trace


def main() -> None:
    rows = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line]
    peer = len(sys.argv) > 2 and sys.argv[2] == "--peer"
    base = {(r["trace"], r["workers"], r["load"]): r for r in rows if r["config"] == "ltl"}
    head = ("| trace | G | config | I(k) x lower | tok/s vs ltl | share of bound "
            "| ceiling (ltl at x of bound) |")
    print(head + (" peer (I(k) / tok/s) |" if peer else ""))
    print("|---" * (8 if peer else 7) + "|")
    for r in rows:
        if r["config"] == "ltl":
            continue
        b = base[(r["trace"], r["workers"], r["load"])]
        ratio = b["imbalance_total_mean"] / max(r["imbalance_total_mean"], 1e-9)
        gain = r["throughput_tok_s"] / b["throughput_tok_s"] - 1
        share = r["throughput_tok_s"] / r["balanced_bound_tok_s"]
        base_share = b["throughput_tok_s"] / b["balanced_bound_tok_s"]
        ceiling = 1 / base_share - 1  # the gain at 100% of the bound (same tokens)
        line = (f"| {short(r['trace'])} | {r['workers']} | {r['config']} | {ratio:.1f}x | "
                f"{gain:+.2%} | {share:.2%} | {ceiling:+.2%} ({base_share:.2%}) |")
        if peer:
            line += f" {PEER.get((short(r['trace']), r['workers']), '')} |"
        print(line)


if __name__ == "__main__":
    main()
