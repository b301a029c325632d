"""What the porting examples share: the report printed, and the picture of
several ports of one model (`port_from_pytorch.py`, `port_transformer.py`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np


def show(title: str, report) -> None:
    print(f"\n== {title}")
    print(report)
    first = report.first_divergence
    if first is None:
        print("-> the port agrees with PyTorch at every layer")
    else:
        print(f"-> first divergence: PyTorch {first.site_a!r} / Linen {first.site_b!r}")


def plot(
    reports: dict,
    path: Path,
    *,
    title: str,
    xlabel: str,
    short: Callable[[str], str],
    rtol: float,
) -> None:
    """Per paired layer, in call order, the largest relative difference of
    activations (top) and activation gradients (bottom), one line per port;
    a star and a dotted line at each port's first divergence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 1e-10  # an exact 0 is drawn here, at the bottom of the log scale
    reference = next(iter(reports.values()))
    names = [short(row.site_a) for row in reference.rows]
    positions = np.arange(len(names))
    fig, axes = plt.subplots(2, 1, figsize=(11, 6.8), sharex=True, layout="constrained")
    fields = ("activation_rel", "grad_rel")
    for k, (label, report) in enumerate(reports.items()):
        color = f"C{k}"
        first = report.first_divergence
        at = None if first is None else report.rows.index(first)
        for ax, field in zip(axes, fields, strict=True):
            values = np.maximum([getattr(row, field) for row in report.rows], floor)
            ax.plot(positions, values, "o-", color=color, ms=3, lw=1.2, label=label)
            if at is not None:
                ax.axvline(at, color=color, ls=":", lw=1)
                ax.plot(at, values[at], "*", ms=15, color=color, mec="black", mew=0.8)
    for ax, what in zip(axes, ("activations", "d loss / d activation"), strict=True):
        ax.set_yscale("log")
        ax.set_ylim(floor / 3, 30)
        ax.axhline(rtol, color="gray", ls="--", lw=0.8)
        ax.set_ylabel(f"largest relative\ndifference of {what}")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].annotate(
        f"rtol {rtol:.0e}",
        (len(names) - 1, rtol),
        xytext=(0, 3),
        textcoords="offset points",
        ha="right",
        color="gray",
        fontsize=7,
    )
    axes[0].annotate(
        "0 (identical)",
        (0, floor),
        xytext=(6, 0),
        textcoords="offset points",
        va="center",
        fontsize=7,
    )
    axes[0].set_title(title, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=4, fontsize=8)
    axes[1].set_xticks(positions, names, rotation=75, fontsize=7)
    axes[1].set_xlabel(xlabel)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
