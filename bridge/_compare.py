"""`compare`: where two models part, pair by pair.

Pairs are made as for `transfer` (`bridge._porting`): the parameterised
modules of both models in call order. Both models run once at the paired
sites; each pair's activations and activation gradients are brought to the
canonical layout (channel-last, batch-first) and compared elementwise.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from ._errors import BridgeImportError, BridgeTypeError, BridgeValueError
from ._hyperparameters import differing_hyperparameters, shown
from ._porting import (
    Layer,
    inputs_for,
    label,
    pair,
    parameterised_layers,
    porting_module,
    second_inputs,
)
from ._sites import split_arrays


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
      loss_a, loss_b: the loss of each model.
      rtol, atol: the tolerances used.
      first_divergence: where the models part (see `bridge.compare`), or `None`
        when every pair agrees.
    """

    rows: list[PairComparison]
    loss_a: float
    loss_b: float
    rtol: float
    atol: float

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
            f"loss A {self.loss_a:.6g}, loss B {self.loss_b:.6g}; "
            f"rtol={self.rtol:g}, atol={self.atol:g}; {summary}"
        )
        return "\n".join([header, *table])

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


def compare(
    probe_a: Any,
    probe_b: Any,
    loss_fn: Callable[[Any], Any] | tuple[Callable, Callable],
    *args: Any,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    args_b: tuple | None = None,
    kwargs_b: dict | None = None,
    **kwargs: Any,
) -> ComparisonReport:
    """Run two models on the same inputs and find where they part.

    Pairs the calls of the models' parameterised modules in call order (as
    `bridge.transfer` pairs the modules), runs `value_and_grad` of both (under
    `jax.jit`), brings each pair's activations and activation gradients to a
    common layout (channel-last: Equinox and PyTorch convolutions are
    channel-first; attention head axes flattened; PyTorch's sequence-first
    attention batch-first), and measures their differences. A PyTorch model
    runs eagerly in PyTorch, the JAX model under `jax.jit`.

    `report.first_divergence` is the first pair in call order whose
    activations differ beyond tolerance — a forward bug shows there, while
    gradients differ everywhere upstream of it. Where every activation agrees
    but gradients do not (a bug in a backward pass), it is the last pair
    whose gradients differ. `None` when everything agrees.

    Args:
      probe_a, probe_b: the two models' probes.
      loss_fn: `outputs -> scalar`, applied to each model's outputs; or a pair
        `(loss_fn_a, loss_fn_b)` where one function cannot serve both (a
        PyTorch model's loss takes torch tensors).
      *args, **kwargs: the call arguments both models accept (the first
        model's, when `args_b`/`kwargs_b` are given).
      rtol, atol: an element agrees when `|a - b| <= atol + rtol * |b|`, as in
        `numpy.allclose`. The defaults suit float32 models whose operations
        run in a different order (differences near 1e-7 relative); loosen
        them for deep models or bfloat16. A hyperparameter mismatch shows
        only as far as it changes numbers: LayerNorm epsilons of 1e-6 and
        1e-5 differ visibly only where the normalised variance is small.
      args_b, kwargs_b: the second model's inputs, where they differ from the
        first's: `args_b=(x_nhwc,)` for a JAX port of a PyTorch model that
        takes `x_nchw`. Values are compared in the common layout either way.

    Returns:
      A `ComparisonReport`: `str(report)` is a table; `report.rows` the data.

    Example:
      >>> report = bridge.compare(linen_probe, eqx_probe, loss_fn, x)
      >>> print(report)
      >>> report.first_divergence
    """
    loss_a, loss_b = _loss_pair(loss_fn)
    porting_module(probe_a, "probe_a")
    porting_module(probe_b, "probe_b")
    args_b, kwargs_b = second_inputs(args, kwargs, args_b, kwargs_b)
    layers_a = parameterised_layers(probe_a, "probe_a", args, kwargs)[1]
    layers_b = parameterised_layers(probe_b, "probe_b", args_b, kwargs_b)[1]
    paired = pair(layers_a, layers_b, ("probe_a", "probe_b"))
    for layer_a, layer_b in paired:
        if layer_a.kind != layer_b.kind:
            raise BridgeValueError(
                f"Cannot compare {label(layer_a)} ({layer_a.described}) of "
                f"probe_a with {label(layer_b)} ({layer_b.described}) of "
                f"probe_b: their kinds differ ({layer_a.kind} vs {layer_b.kind}). "
                "compare pairs parameterised modules in call order: check that "
                "both models call the same layers in the same order."
            )
    # Compared where both sides have a value: the root module is no site (its
    # output is the models' outputs), nor is an inner projection of a fused
    # layer (PyTorch's `nn.MultiheadAttention` query/key/value).
    pairs = [(a, b) for a, b in paired if a.site and b.site]
    result_a, result_b = _run_both(
        (probe_a, probe_b),
        (loss_a, loss_b),
        ([a.site for a, _ in pairs], [b.site for _, b in pairs]),
        (inputs_for(probe_a, args, kwargs), inputs_for(probe_b, args_b, kwargs_b)),
    )
    rows = [
        _compare_pair(layer_a, layer_b, result_a, result_b, rtol, atol)
        for layer_a, layer_b in pairs
    ]
    return ComparisonReport(
        rows, float(result_a.loss), float(result_b.loss), rtol, atol
    )


def _loss_pair(loss_fn: Any) -> tuple[Callable, Callable]:
    pair_ = tuple(loss_fn) if isinstance(loss_fn, tuple | list) else (loss_fn,) * 2
    if len(pair_) != 2 or not all(callable(f) for f in pair_):
        raise BridgeTypeError(
            "`loss_fn` must be a function `outputs -> scalar`, or a pair "
            "`(loss_fn_a, loss_fn_b)` of them when the models' outputs differ in "
            f"kind (torch tensors against JAX arrays); got {loss_fn!r}. The inputs "
            "come after it: bridge.compare(probe_a, probe_b, loss_fn, x)."
        )
    return pair_


def _run_both(probes, loss_fns, sites, inputs):
    """Both models' `value_and_grad` at their paired sites: JAX models under one
    `jax.jit` (no parameter baked in), a PyTorch model eagerly in PyTorch."""
    from ._probe import ProbeBase

    runs = list(zip(probes, loss_fns, sites, inputs, strict=True))
    if all(isinstance(probe, ProbeBase) for probe in probes):
        return _jitted(runs)
    return tuple(
        _jitted([run])[0] if isinstance(run[0], ProbeBase) else _value_and_grad(*run)
        for run in runs
    )


def _value_and_grad(probe, loss_fn, names, inputs):
    args, kwargs = inputs
    return probe.value_and_grad(loss_fn, *args, at=_exactly(names), **kwargs)


def _jitted(runs: list) -> tuple:
    """`_value_and_grad` of each run, all under one `jax.jit`, the inputs'
    arrays traced."""

    probes = [probe for probe, *_ in runs]
    losses_and_sites = [(loss_fn, names) for _, loss_fn, names, _ in runs]
    dynamic, rebuild = split_arrays([inputs for *_, inputs in runs])

    @jax.jit
    def run(probes, dynamic):
        return tuple(
            _value_and_grad(probe, loss_fn, names, inputs)
            for probe, (loss_fn, names), inputs in zip(
                probes, losses_and_sites, rebuild(dynamic), strict=True
            )
        )

    return run(probes, dynamic)


def _exactly(names: Sequence[str]) -> list[str] | Callable:
    """A selection of exactly these sites. Glob characters in a name would
    widen a pattern; such names are few and harmless (the extra sites are
    recorded, never compared)."""
    return list(dict.fromkeys(names))


def _compare_pair(layer_a, layer_b, result_a, result_b, rtol, atol):
    values_a = _common(layer_a, result_a.activations[layer_a.site])
    values_b = _common(layer_b, result_b.activations[layer_b.site])
    grads_a = _common(layer_a, result_a.activation_grads[layer_a.site])
    grads_b = _common(layer_b, result_b.activation_grads[layer_b.site])
    shapes_a = [np.shape(v) for v in values_a]
    shapes_b = [np.shape(v) for v in values_b]
    if shapes_a != shapes_b:
        raise BridgeValueError(
            f"Cannot compare site {layer_a.site!r} ({layer_a.described}) of probe_a "
            f"with site {layer_b.site!r} ({layer_b.described}) of probe_b: their "
            f"activations have shapes {shapes_a} and {shapes_b} in the common "
            "layout (channel-last, head axes flattened, batch first). Check that "
            "both models are given the same inputs, and vmap=True for an Equinox "
            "model that handles one example."
        )
    act_abs, act_rel, act_ok = _differences(values_a, values_b, rtol, atol)
    grad_abs, grad_rel, grad_ok = _differences(grads_a, grads_b, rtol, atol)
    hyperparameters = differing_hyperparameters(
        layer_a.hyperparameters, layer_b.hyperparameters
    )
    return PairComparison(
        layer_a.site,
        layer_b.site,
        layer_a.kind,
        tuple(shapes_a[0]) if shapes_a else (),
        act_abs,
        act_rel,
        act_ok,
        grad_abs,
        grad_rel,
        grad_ok,
        hyperparameters,
    )


def _common(layer: Layer, value: Any) -> list[np.ndarray]:
    return [np.asarray(layer.to_common(leaf)) for leaf in layer.select(value)]


def _differences(
    values_a: list, values_b: list, rtol: float, atol: float
) -> tuple[float, float, bool]:
    largest_abs, largest_b, agree = 0.0, 0.0, True
    for a, b in zip(values_a, values_b, strict=True):
        if a.size == 0:
            continue
        a, b = a.astype(np.float64), b.astype(np.float64)
        difference = np.abs(a - b)
        largest_abs = max(largest_abs, float(difference.max()))
        largest_b = max(largest_b, float(np.abs(b).max()))
        agree = agree and bool(np.all(difference <= atol + rtol * np.abs(b)))
    relative = largest_abs / largest_b if largest_b > 0 else largest_abs
    return largest_abs, relative, agree


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


# -- hyperparameters ------------------------------------------------------------
