"""`ComparisonReport`: what `bridge.compare` finds, as a table, as data and
as a picture."""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._errors import BridgeImportError
from .hyperparameters import shown


class PairComparison(NamedTuple):
    """One pair of sites in a `ComparisonReport`.

    Attributes:
      site_a: the site in the first model.
      site_b: the site in the second model.
      kind: the kind of both modules (`dense`, `conv`, ...).
      shape: the activation's shape in the common layout (channel-last, head
        axes flattened; the first compared leaf).
      activation_abs: the largest absolute difference of the activations.
      activation_rel: `activation_abs` divided by the largest magnitude of
        the second model's activation.
      activations_agree: every element within `atol + rtol * |b|`.
      grad_abs, grad_rel, grads_agree: the same for the activation gradients.
      hyperparameters: `{name: (value in A, value in B)}` of the
        hyperparameters that differ (`epsilon`, `momentum`, `padding`, ...;
        see `ComparisonReport.hyperparameter_differences`), whatever the
        numbers say.
    """

    site_a: str
    site_b: str
    kind: str
    shape: tuple[int, ...]
    activation_abs: float
    activation_rel: float
    activations_agree: bool
    grad_abs: float
    grad_rel: float
    grads_agree: bool
    hyperparameters: Mapping[str, tuple[Any, Any]] = types.MappingProxyType({})

    @property
    def agree(self) -> bool:
        """Activations and activation gradients agree (hyperparameters aside)."""
        return self.activations_agree and self.grads_agree


class LogitsComparison(NamedTuple):
    """The two models' outputs compared as logits (`ComparisonReport.logits`).

    Attributes:
      kl_divergence: `KL(softmax(a) || softmax(b))` at each position (each
        index of all axes but the last), averaged over the positions; in
        nats, computed in float64.
      top1_agreement: the fraction of positions whose largest logit is at the
        same class in both models.
      positions: how many positions were compared.
    """

    kl_divergence: float
    top1_agreement: float
    positions: int


class HyperparameterDifference(NamedTuple):
    """A hyperparameter that differs at a pair: `(pair, name, a, b)`."""

    pair: str
    name: str
    a: Any
    b: Any


@dataclasses.dataclass(frozen=True)
class ComparisonReport:
    """What `bridge.compare` finds: printable as a table, usable as data.

    Attributes:
      rows: one `PairComparison` per pair of sites, in call order.
      loss_a: the loss of the first model.
      loss_b: the loss of the second model.
      rtol: the relative tolerance used.
      atol: the absolute tolerance used.
      first_divergence: where the models part (see `bridge.compare`), or `None`
        when every pair agrees.
      tied: each layer left out of the pairing because its weights are
        another module's (a tied LM head: PyTorch's `lm_head` holds the
        embedding's tensor; a Flax tied head owns no parameters at all, or
        is the embedding's `attend`); where both sides have one, tied to
        modules that pair, the two are compared (a row of kind `tied`).
      unpaired: each repeated call of a module on one side only (a Flax
        module whose `__call__` calls its base class's), left without a
        partner: the other side's call pairs with the one whose activations
        match it best.
      dead: each call whose output never reaches the loss (a module called
        twice, its first result dropped), found from the computation's
        structure; never paired.
      dtype: the precision the models ran in: `"float64"` with
        `compare(..., dtype="float64")`, else the dtypes of the compared
        activations (`"float32"`).
      lower_precision: in a float64 run, the sites whose activations were
        not float64 (a model casting to float32 itself).
      logits: the outputs compared as logits (`LogitsComparison`: KL
        divergence and top-1 agreement), `None` where there are none.
    """

    rows: list[PairComparison]
    loss_a: float
    loss_b: float
    rtol: float
    atol: float
    tied: tuple[str, ...] = ()
    unpaired: tuple[str, ...] = ()
    dead: tuple[str, ...] = ()
    dtype: str = "float32"
    lower_precision: tuple[str, ...] = ()
    logits: LogitsComparison | None = None

    @property
    def kl_divergence(self) -> float | None:
        """`logits.kl_divergence`, `None` where no logits were compared."""
        return None if self.logits is None else self.logits.kl_divergence

    @property
    def top1_agreement(self) -> float | None:
        """`logits.top1_agreement`, `None` where no logits were compared."""
        return None if self.logits is None else self.logits.top1_agreement

    @property
    def agree(self) -> bool:
        """Every pair's activations and activation gradients agree."""
        return all(row.agree for row in self.rows)

    @property
    def hyperparameter_differences(self) -> list[HyperparameterDifference]:
        """Each hyperparameter that differs, pair by pair in call order:
        `(pair, name, a, b)`, the pair named `"site A / site B"`. `transfer`
        moves weights only; these differences are the porter's to settle, and
        may not show in the numbers (LayerNorm epsilons of 1e-6 and 1e-5)."""
        return [
            HyperparameterDifference(f"{row.site_a} / {row.site_b}", name, a, b)
            for row in self.rows
            for name, (a, b) in row.hyperparameters.items()
        ]

    @property
    def first_divergence(self) -> PairComparison | None:
        """The first pair whose activations diverge; where every activation
        agrees, the last pair whose gradients diverge; `None` when all agree."""
        for row in self.rows:
            if not row.activations_agree:
                return row
        for row in reversed(self.rows):
            if not row.grads_agree:
                return row
        return None

    def __str__(self) -> str:
        headers = (
            "#",
            "site A",
            "site B",
            "kind",
            "shape",
            "act abs",
            "act rel",
            "grad abs",
            "grad rel",
            "",
        )
        first = self.first_divergence
        lines = []
        for number, row in enumerate(self.rows):
            verdict = "ok" if row.agree else "DIFFERS"
            if row is first:
                verdict += " <- first divergence"
            lines.append(
                (
                    str(number),
                    row.site_a,
                    row.site_b,
                    row.kind,
                    "x".join(map(str, row.shape)) or "()",
                    f"{row.activation_abs:.2e}",
                    f"{row.activation_rel:.2e}",
                    f"{row.grad_abs:.2e}",
                    f"{row.grad_rel:.2e}",
                    verdict,
                )
            )
        widths = [
            max(len(cells[i]) for cells in [headers, *lines])
            for i in range(len(headers))
        ]

        def line(cells: Sequence[str]) -> str:
            return "  ".join(
                cell.ljust(width) for cell, width in zip(cells, widths, strict=True)
            ).rstrip()

        table = [line(headers), line(["-" * w for w in widths])]
        indent = " " * (widths[0] + 2)
        for row, cells in zip(self.rows, lines, strict=True):
            table.append(line(cells))
            if row.hyperparameters:
                differing = "; ".join(
                    f"{name} {shown(a)} (A) vs {shown(b)} (B)"
                    for name, (a, b) in row.hyperparameters.items()
                )
                table.append(f"{indent}^ hyperparameters differ: {differing}")
        if first is None:
            summary = "all pairs agree"
        else:
            part = "activations" if not first.activations_agree else "gradients"
            summary = (
                f"first divergence: {first.site_a!r} (A) / {first.site_b!r} (B), {part}"
            )
        differing_rows = [row for row in self.rows if row.hyperparameters]
        if differing_rows:
            count = len(differing_rows)
            summary += (
                f"; hyperparameters differ at {count} "
                f"pair{'s' if count > 1 else ''} (marked ^)"
            )
        header = (
            f"loss A {self.loss_a:.6g}, loss B {self.loss_b:.6g}; {self.dtype}; "
            f"rtol={self.rtol:g}, atol={self.atol:g}; {summary}"
        )
        notes = [f"tied, not paired: {layer}" for layer in self.tied]
        notes += [f"unpaired extra call: {layer}" for layer in self.unpaired]
        notes += [
            f"dead (its output never reaches the loss), not paired: {layer}"
            for layer in self.dead
        ]
        notes += [f"not float64: {site}" for site in self.lower_precision]
        if self.logits is not None:
            logits = self.logits
            notes.append(
                f"outputs as logits ({logits.positions} positions): "
                f"KL(A || B) {logits.kl_divergence:.3g}, top-1 agreement "
                f"{logits.top1_agreement:.2%}"
            )
        return "\n".join([header, *table, *notes])

    def plot(self, path: str | os.PathLike | None = None) -> Any:
        """Draw the report and save it to `path` (any format matplotlib
        writes: `.png`, `.pdf`, `.svg`); returns the `matplotlib.figure.Figure`.

        Per pair in call order, the largest relative difference of the
        activations and of the activation gradients (log scale; an exact
        match is drawn at the floor of the axis), the tolerance `rtol` as a
        horizontal line, the first divergence as a vertical line, and pairs
        whose hyperparameters differ marked on the axis. Needs matplotlib
        (`pip install matplotlib`); `import bridge` does not import it, and
        the figure is drawn without pyplot, so no display is needed.
        """
        try:
            from matplotlib.figure import Figure
        except ImportError as error:  # pragma: no cover - depends on the install
            raise BridgeImportError(
                "ComparisonReport.plot needs matplotlib: pip install matplotlib "
                "(or the [examples] extra of jax-activation-bridge)."
            ) from error
        return _plot(self, Figure, path)


def _plot(report: ComparisonReport, Figure: Any, path: Any) -> Any:
    rows = report.rows
    figure = Figure(figsize=(max(6.0, 0.6 * len(rows) + 2.5), 4.5), layout="tight")
    axes = figure.add_subplot()
    positions = np.arange(len(rows))
    measured = [row.activation_rel for row in rows] + [row.grad_rel for row in rows]
    positive = [value for value in measured if value > 0]
    floor = min([*positive, report.rtol]) / 100 if positive else report.rtol / 100

    def shown(values: list[float]) -> list[float]:
        return [value if value > 0 else floor for value in values]

    axes.plot(
        positions,
        shown([row.activation_rel for row in rows]),
        "o-",
        label="activations (largest relative difference)",
    )
    axes.plot(
        positions,
        shown([row.grad_rel for row in rows]),
        "s--",
        label="activation gradients",
    )
    axes.set_yscale("log")
    axes.axhline(
        report.rtol, color="grey", linestyle=":", label=f"rtol={report.rtol:g}"
    )
    first = report.first_divergence
    if first is not None:
        at = next(n for n, row in enumerate(rows) if row is first)
        axes.axvline(at, color="red", alpha=0.6, label="first divergence")
    differing = [n for n, row in enumerate(rows) if row.hyperparameters]
    if differing:
        axes.plot(
            differing,
            [floor] * len(differing),
            "^",
            color="darkorange",
            markersize=10,
            clip_on=False,
            label="hyperparameters differ",
        )
    axes.set_xticks(
        positions,
        [
            f"{row.site_a}\n{row.site_b}" + (" *" if row.hyperparameters else "")
            for row in rows
        ],
        rotation=45,
        ha="right",
        fontsize="small",
    )
    axes.set_xlabel("pair (site A / site B), in call order")
    axes.set_ylabel("largest |a - b| / largest |b|")
    axes.set_title(
        f"loss A {report.loss_a:.6g}, loss B {report.loss_b:.6g}", fontsize="medium"
    )
    axes.legend(fontsize="small")
    if path is not None:
        figure.savefig(path)
    return figure
