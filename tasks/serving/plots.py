"""The canary report's chart (``canary.png``): the shadow stage and each traffic step."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tasks.serving.canary import CanaryReport, ShadowResult


def plot_report(report: CanaryReport, path: Any) -> None:
    """The shadow (paired TTFT and inter-token latency p50, stable vs the new version, its
    verdict) and, per step: requests by version, p50/p99 latency of canary vs stable, and the
    text endpoint's TTFT/ITL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (1 if report.shadow else 0) + (3 if report.steps else 0)
    fig, grid = plt.subplots(1, max(panels, 1), figsize=(5 * max(panels, 1), 4), squeeze=False)
    axes: list[Any] = list(grid[0])
    if report.shadow:
        plot_shadow(axes.pop(0), report.shadow[-1])
    if report.steps:
        plot_steps(axes[0], axes[1], axes[2], report)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_shadow(ax: Any, shadow: ShadowResult) -> None:
    x = np.arange(2)
    ax.bar(x - 0.2, [shadow.stable.ttft_p50_ms, shadow.stable.itl_p50_ms], 0.4, label=f"stable v{shadow.stable_version}")
    ax.bar(x + 0.2, [shadow.shadow.ttft_p50_ms, shadow.shadow.itl_p50_ms], 0.4, label=f"shadow v{shadow.shadow_version}")
    ax.set_xticks(x, ["TTFT p50", "ITL p50"])
    ax.set_ylabel("ms (same requests, paired)")
    agreement = shadow.agreement
    ax.set_title(f"shadow: {shadow.verdict}; {shadow.served} pairs, {shadow.shadow_errors} failed copies\n"
                 f"text = reference {agreement.reference:.0%}, = stable's {agreement.stable_exact:.0%}", fontsize=9)
    ax.legend()


def plot_steps(left: Any, right: Any, text: Any, report: CanaryReport) -> None:
    steps = report.steps
    labels = [f"{s.weight:g}%" + (f" #{s.analysis}" if s.analysis > 1 else "") for s in steps]
    x = np.arange(len(steps))
    left.bar(x - 0.2, [s.stable.requests for s in steps], 0.4, label=f"stable v{report.stable}")
    left.bar(x + 0.2, [s.canary.requests for s in steps], 0.4, label=f"canary v{report.canary}")
    left.set_xticks(x, labels)
    left.set_title("requests per version; " + ", ".join(f"{lab} {s.verdict}"
                                                        for lab, s in zip(labels, steps, strict=True)), fontsize=9)
    left.legend()
    for who, style in (("stable", "-"), ("canary", "--")):
        right.plot(x, [getattr(s, who).p50_ms for s in steps], style, marker="o", label=f"{who} p50")
        right.plot(x, [getattr(s, who).p99_ms for s in steps], style, marker="x", label=f"{who} p99")
    right.set_xticks(x, labels)
    right.set_ylabel("ms")
    right.set_title(f"latency; verdict: {report.verdict}")
    right.legend()
    for who, style in (("stable", "-"), ("canary", "--")):
        text.plot(x, [getattr(s.text, who).ttft_p50_ms if s.text else math.nan for s in steps], style, marker="o",
                  label=f"{who} TTFT p50")
        text.plot(x, [getattr(s.text, who).itl_p50_ms if s.text else math.nan for s in steps], style, marker="x",
                  label=f"{who} ITL p50")
    text.set_xticks(x, labels)
    text.set_ylabel("ms")
    text.set_title("text endpoint (streamed completions)")
    text.legend()
