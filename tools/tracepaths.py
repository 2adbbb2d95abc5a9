"""Where the evaluation tools find the traces: one table for every script under ``tools/``.

The Azure conversation trace ships with the package (``router_client/data``); Mooncake
conversation and ShareGPT are read from ``../shared/traces`` beside the repository (CI has
it; a user passes their own files to ``balanceroute ab --trace``).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "traces"
FILES = {
    "azure": ROOT / "router_client" / "data" / "AzureLLMInferenceTrace_conv.csv",
    "mooncake": SHARED / "conversation_trace.jsonl",
    "sharegpt": SHARED / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
}


def trace_file(name: str) -> str:
    """The path of the trace file called ``name`` (``azure``, ``mooncake``, ``sharegpt``)."""
    return str(FILES[name])


SYNTH = {"tpl": "templated", "long": "long"}  # the evaluation tools' names of synth traces


def synth_spec(name: str, seed: int) -> str | None:
    """The synth trace ``name`` (``tpl``, ``long``) as synthesized with ``seed``; None for a
    trace file."""
    return f"synth:{SYNTH[name]}:seed={seed}" if name in SYNTH else None
