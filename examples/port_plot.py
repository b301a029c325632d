"""What the porting examples share: the report printed, and the picture of
several ports of one model (`port_from_pytorch.py`, `port_transformer.py`)."""

from __future__ import annotations

import textwrap
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
    a star and a dotted line at each port's first divergence.

    Drawn 8.5 inches wide with 11-point text, so that the docs page (about
    690 pixels) shows it at about 0.8 scale, every label readable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 1e-10  # an exact 0 is drawn here, at the bottom of the log scale
    reference = next(iter(reports.values()))
    names = [short(row.site_a) for row in reference.rows]
    positions = np.arange(len(names))
    with plt.rc_context({"font.size": 11}):
        fig, axes = plt.subplots(
            2, 1, figsize=(8.5, 8.2), sharex=True, layout="constrained"
        )
        fields = ("activation_rel", "grad_rel")
        for k, (label, report) in enumerate(reports.items()):
            color = f"C{k}"
            first = report.first_divergence
            at = None if first is None else report.rows.index(first)
            for ax, field in zip(axes, fields, strict=True):
                values = np.maximum([getattr(row, field) for row in report.rows], floor)
                ax.plot(positions, values, "o-", color=color, ms=3, lw=1.4, label=label)
                if at is not None:
                    ax.axvline(at, color=color, ls=":", lw=1.2)
                    ax.plot(
                        at, values[at], "*", ms=16, color=color, mec="black", mew=0.8
                    )
        for ax, what in zip(
            axes, ("activations", "d loss / d activation"), strict=True
        ):
            ax.set_yscale("log")
            ax.set_ylim(floor / 3, 30)
            ax.set_yticks([1e-10, 1e-8, 1e-6, 1e-4, 1e-2, 1])
            ax.axhline(rtol, color="gray", ls="--", lw=1)
            ax.set_ylabel(f"largest relative\ndifference of {what}")
            ax.grid(True, which="major", alpha=0.3)
        axes[0].annotate(
            f"rtol {rtol:.0e}",
            (len(names) - 1, rtol),
            xytext=(0, 3),
            textcoords="offset points",
            ha="right",
            va="bottom",
            color="dimgray",
        )
        axes[0].annotate(
            "0 (identical)",
            (0, floor),
            xytext=(8, 0),
            textcoords="offset points",
            va="center",
        )
        # The title is long: two lines, split after its colon where it has one.
        head, colon, rest = title.partition(": ")
        heading = f"{head}:\n{rest}" if colon else textwrap.fill(title, 70)
        axes[0].set_title(heading, fontsize=12)
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncols=2)
        axes[1].set_xticks(positions, names, rotation=90)
        axes[1].tick_params(axis="x", labelsize=10 if len(names) > 30 else 11)
        axes[1].set_xlabel(xlabel)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=150)
        plt.close(fig)
