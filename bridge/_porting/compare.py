"""`compare`: where two models part, pair by pair.

Pairs are made as for `transfer` (`bridge._porting.pairing`): the parameterised
modules of both models in call order. Both models run once at the paired
sites (`bridge._porting.compare_runs`); each pair's activations and activation
gradients are brought to the canonical layout (channel-last, batch-first) and
compared, each tensor at its own scale (`bridge._porting.compare_values`).

What a porter could mistake for a divergence is kept out of the pairs:
- a call whose output never reaches the loss (a model that calls a module
  twice and drops the first result) is *dead*: found from the computation's
  structure (`_unreached`: `PortableProbe.unreached_sites`, which epsilons the
  loss's jaxpr uses or a PyTorch model's autograd graph), never from a
  gradient that happens to be zero; reported, never paired;
- an extra call of a module on one side pairs with the other side's call
  whose values it matches (`bridge._porting.compare_pairs`);
- float32 rounding, with `dtype="float64"`: both models run in float64, on
  copies, and what differences stay are the port's.

The report ends with the outputs compared as logits
(`bridge._porting.compare_logits`). This module is the entry point and the
order of its steps; each step lives in the module named.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import BridgeTypeError, BridgeValueError
from .compare_logits import function_pair, logits_figures, logits_pair, on_sides
from .compare_pairs import NAMES, matched_by_value, paired_ties, tie_notes
from .compare_runs import (
    in_float64,
    inputs_in_float64,
    requested_precision,
    run_both,
    x64,
)
from .compare_values import compare_pair, sites_of, values_at
from .contract import porting_side
from .layer import Layer, described_tie, label
from .pairing import packed, pair_calls, untied, with_counterparts
from .report import ComparisonReport
from .sides import inputs_for, parameterised_layers, second_inputs

#: The default tolerances by the precision compared in: float32's rounding
#: after a different order of operations is near 1e-7 of a tensor's largest
#: element (1e-6 in a deep model), float64's near 1e-16.
_TOLERANCES = {None: (1e-5, 1e-6), "float64": (1e-10, 1e-12)}


def compare(
    probe_a: Any,
    probe_b: Any,
    loss_fn: Callable[[Any], Any] | tuple[Callable, Callable],
    *args: Any,
    rtol: float | None = None,
    atol: float | None = None,
    dtype: str | None = None,
    logits: Any = None,
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

    A value that broadcasts to the other side's shape by NumPy's rules
    (PyTorch's position embedding `(1, seq, d)` or `(seq, d)` against Flax's
    `(batch, seq, d)`) is compared broadcast, the other side's gradient
    summed over the broadcast axes. Tied LM heads (`report.tied`) do not pair
    by their weights: where both sides have one, tied to paired modules, they
    are compared with each other. A call whose output never reaches the loss
    (`report.dead`: a module called twice, its first result dropped) is never
    paired. Where the counts differ only by repeated calls of a module on one
    side, the other side's call pairs with the repeated call whose
    activations match it best, and the others are left unpaired
    (`report.unpaired`) rather than refused.

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
      rtol: the relative tolerance: a tensor agrees when
        `max|a - b| <= atol + rtol * max|b|`, its difference judged at the
        scale of the whole tensor (a float32 rounding error on an element
        near zero is no divergence). Default 1e-5 (1e-10 with
        `dtype="float64"`): float32 models whose operations run in another
        order differ near 1e-7 of their largest element; loosen it for deep
        models or bfloat16. A hyperparameter mismatch shows only as far as it
        changes numbers: LayerNorm epsilons of 1e-6 and 1e-5 differ visibly
        only where the normalised variance is small.
      atol: the absolute tolerance, for tensors near zero throughout. Default
        1e-6 (1e-12 with `dtype="float64"`).
      dtype: `None` (the default) runs the models as they are; `"float64"`
        runs both in float64, on copies (a JAX model's floating parameters,
        variables and inputs cast, and its modules' `dtype` fields, with x64
        enabled only for the call; a PyTorch model as `copy.deepcopy(model)
        .double()`), so that rounding vanishes and what differs is the port's.
        Code that casts to float32 itself stays float32 there.
      logits: which outputs to compare as logits at the end of the report
        (KL divergence and top-1 agreement): `None` (the default) finds them,
        the outputs' `logits` (a Hugging Face output), else the outputs
        themselves when they are one floating array whose last axis has two
        entries or more; a function `outputs -> logits`, or a pair of them,
        one per model; `False` for none.
      args_b, kwargs_b: the second model's inputs, where they differ from the
        first's: `args_b=(x_nhwc,)` for a JAX port of a PyTorch model that
        takes `x_nchw`. Values are compared in the common layout either way.

    Returns:
      A `ComparisonReport`: `str(report)` is a table; `report.rows` the data.

    Examples:
      >>> report = bridge.compare(linen_probe, eqx_probe, loss_fn, x)
      >>> print(report)
      >>> report.first_divergence
    """
    losses = _loss_pair(loss_fn)
    logits_fns = logits_pair(logits)
    precision = requested_precision(dtype, (probe_a, probe_b))
    default_rtol, default_atol = _TOLERANCES[precision]
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    sides = (porting_side(probe_a, "probe_a"), porting_side(probe_b, "probe_b"))
    logits_fns = on_sides(logits_fns, sides)
    args_b, kwargs_b = second_inputs(args, kwargs, args_b, kwargs_b)
    inputs = (
        inputs_for(probe_a, args, kwargs, sides),
        inputs_for(probe_b, args_b, kwargs_b, sides),
    )
    tolerances = (rtol, atol)
    if precision is None:
        return _compare(
            (probe_a, probe_b), sides, losses, inputs, logits_fns, tolerances
        )
    with x64():
        probes = tuple(
            in_float64(probe, name)
            for probe, name in zip((probe_a, probe_b), NAMES, strict=True)
        )
        inputs = tuple(
            inputs_in_float64(given, side)
            for given, side in zip(inputs, sides, strict=True)
        )
        report = _compare(
            probes, sides, losses, inputs, logits_fns, tolerances, precision
        )
    return report


def _compare(probes, sides, losses, inputs, logits_fns, tolerances, precision=None):
    rtol, atol = tolerances
    layers = [
        parameterised_layers(probe, name, *given, sides)[1]
        for probe, name, given in zip(probes, NAMES, inputs, strict=True)
    ]
    dead = _dead_layers(probes, losses, inputs, layers)
    gone = {id(layer) for _, layer in dead}
    own, tied = zip(
        *(untied([la for la in found if id(la) not in gone]) for found in layers),
        strict=True,
    )
    own_a, own_b = packed(*with_counterparts(*own))
    left_out = [
        described_tie(layer, name)
        for name, side in zip(NAMES, tied, strict=True)
        for layer in side
    ] + [f"{_described(layer, name)}, dead" for name, layer in dead]
    paired, unpaired = pair_calls(own_a, own_b, NAMES, left_out)
    _check_kinds(paired)
    pairs = [(a, b) for a, b in paired if a.site and b.site]
    tie_pairs, unpaired = paired_ties(tied, paired, unpaired)
    sites = tuple(
        [site for pair in (*pairs, *tie_pairs) for site in sites_of(pair[side])]
        + [layer.site for name, layer in unpaired if layer.site and name == NAMES[side]]
        for side in (0, 1)
    )
    results = run_both(probes, losses, sites, inputs, logits_fns)
    pairs, unpaired = matched_by_value(pairs, unpaired, results)
    order = {id(layer): n for n, layer in enumerate(layers[0])}
    compared = sorted(
        [(a, b, a.kind) for a, b in pairs] + [(a, b, "tied") for a, b in tie_pairs],
        key=lambda pair: order[id(pair[0])],
    )
    dtype, lower_precision = _precision_of(compared, results, precision)
    return ComparisonReport(
        [compare_pair(a, b, *results, rtol, atol, kind) for a, b, kind in compared],
        float(results[0].loss),
        float(results[1].loss),
        rtol,
        atol,
        tied=tie_notes(tied, tie_pairs),
        unpaired=tuple(_described(layer, name) for name, layer in unpaired),
        dead=tuple(_described(layer, name) for name, layer in dead),
        dtype=dtype,
        lower_precision=lower_precision,
        logits=logits_figures(results[0].aux, results[1].aux, logits_fns, sides),
    )


def _check_kinds(paired: list[tuple[Layer, Layer]]) -> None:
    for layer_a, layer_b in paired:
        if layer_a.kind != layer_b.kind:
            raise BridgeValueError(
                f"Cannot compare {label(layer_a)} ({layer_a.described}) of "
                f"probe_a with {label(layer_b)} ({layer_b.described}) of "
                f"probe_b: their kinds differ ({layer_a.kind} vs {layer_b.kind}). "
                "compare pairs parameterised modules in call order: check that "
                "both models call the same layers in the same order."
            )


def _dead_layers(probes, losses, inputs, layers) -> list[tuple[str, Layer]]:
    """`[(probe's name, layer)]` of the calls whose output never reaches the
    loss."""
    found = []
    for probe, name, loss_fn, given, side in zip(
        probes, NAMES, losses, inputs, layers, strict=True
    ):
        sites = [layer.site for layer in side if layer.site]
        unreached = _unreached(probe, loss_fn, given, sites)
        found += [(name, layer) for layer in side if layer.site in unreached]
    return found


def _unreached(probe, loss_fn, inputs, names) -> set[str]:
    """The sites among `names` whose output has no path to the loss, from
    the computation's structure (`PortableProbe.unreached_sites`: a JAX
    model's jaxpr, PyTorch's autograd graph)."""
    names = list(dict.fromkeys(names))
    if not names:
        return set()
    args, kwargs = inputs
    return set(probe.unreached_sites(loss_fn, names, *args, **kwargs))


def _precision_of(compared, results, precision) -> tuple[str, tuple[str, ...]]:
    """`(the precision the report names, the sites of a float64 run whose
    values were not float64)`: without `dtype=`, the dtypes of the compared
    activations (`"float32"`)."""
    found, lower = set(), []
    for pair in compared:
        for side, name in enumerate(NAMES):
            layer = pair[side]
            dtypes = {
                np.asarray(leaf).dtype
                for leaf in values_at(layer, results[side].activations)
            }
            found |= {dtype.name for dtype in dtypes}
            if precision is not None and dtypes - {np.dtype(np.float64)}:
                lower.append(f"{label(layer)} of {name}")
    return precision or "/".join(sorted(found)) or "float32", tuple(lower)


def _described(layer: Layer, name: str) -> str:
    return f"{label(layer)} ({layer.described}) of {name}"


def _loss_pair(loss_fn: Any) -> tuple[Callable, Callable]:
    pair_ = function_pair(loss_fn)
    if pair_ is None:
        raise BridgeTypeError(
            "`loss_fn` must be a function `outputs -> scalar`, or a pair "
            "`(loss_fn_a, loss_fn_b)` of them when the models' outputs differ in "
            f"kind (torch tensors against JAX arrays); got {loss_fn!r}. The inputs "
            "come after it: bridge.compare(probe_a, probe_b, loss_fn, x)."
        )
    return pair_
