"""Headless plots served by the service."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def reliability_png(report: dict) -> bytes:
    """Reliability diagram: observed frequency of ending within H against predicted p_fin."""
    fig, (ax, hist) = plt.subplots(2, 1, figsize=(6, 6.5), sharex=True,
                                   gridspec_kw={"height_ratios": [3, 1]})
    ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--", label="perfectly calibrated")
    for entry in report["estimators"]:
        bins = [b for b in entry["bins"] if b["count"]]
        label = f"{entry['estimator']} (n={entry['scored']}"
        label += f", ECE={entry['ece']:.3f})" if entry["ece"] is not None else ")"
        ax.plot([b["mean_pred"] for b in bins], [b["observed"] for b in bins], marker="o",
                label=label)
        centers = [(b["lo"] + b["hi"]) / 2 for b in entry["bins"]]
        hist.bar(centers, [b["count"] for b in entry["bins"]], width=0.09, alpha=0.5,
                 label=entry["estimator"])
    ax.set_ylabel("observed: ended within H")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, loc="upper left")
    title = "Reliability of p_fin"
    if report.get("horizon"):
        title += f", H={report['horizon']}"
    if report.get("drift", {}).get("drifted"):
        title += " (DRIFT)"
    ax.set_title(title)
    hist.set_xlabel("predicted p_fin")
    hist.set_ylabel("count")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()
