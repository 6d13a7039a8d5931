"""CDF plots for the benchmarks (PNG, matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def cdf_plot(
    path: Path,
    series: Mapping[str, Sequence[float]],
    *,
    xlabel: str,
    title: str,
    vline: float | None = None,
    vline_label: str = "",
    log_x: bool = False,
) -> Path:
    """One empirical CDF per series (its name in the legend) on one axes, written to
    `path`. Empty series are left out. `vline` draws a dashed vertical line (an SLO)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for name, values in series.items():
        if len(values) == 0:
            continue
        xs = np.sort(np.asarray(values, dtype=float))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.step(xs, ys, where="post", label=f"{name} (n={len(xs)})")
    if vline is not None:
        ax.axvline(vline, color="grey", linestyle="--", linewidth=1, label=vline_label or None)
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
