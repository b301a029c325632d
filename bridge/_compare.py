"""`compare`: where two models part, pair by pair.

Pairs are made as for `transfer` (`bridge._porting`): the parameterised
modules of both models in call order. Both models run once at the paired
sites; each pair's activations and activation gradients are brought to the
canonical layout (channel-last, batch-first) and compared elementwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ._errors import BridgeTypeError, BridgeValueError
from ._hyperparameters import differing_hyperparameters
from ._porting import (
    Layer,
    described_tie,
    inputs_for,
    label,
    pair_calls,
    parameterised_layers,
    porting_module,
    second_inputs,
    untied,
)
from ._report import ComparisonReport, PairComparison
from ._sites import split_arrays


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

    A value that broadcasts to the other side's shape by NumPy's rules
    (PyTorch's position embedding `(1, seq, d)` or `(seq, d)` against Flax's
    `(batch, seq, d)`) is compared broadcast, the other side's gradient
    summed over the broadcast axes. A tied layer (`report.tied`) is not
    paired; where the counts differ only by repeated calls of a module on one
    side, those calls are left unpaired (`report.unpaired`) rather than
    refused.

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
      rtol: the relative tolerance: an element agrees when
        `|a - b| <= atol + rtol * |b|`, as in `numpy.allclose`.
      atol: the absolute tolerance. The defaults suit float32 models whose
        operations run in a different order (differences near 1e-7
        relative); loosen them for deep models or bfloat16. A hyperparameter
        mismatch shows only as far as it changes numbers: LayerNorm epsilons
        of 1e-6 and 1e-5 differ visibly only where the normalised variance is
        small.
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
    layers_a, tied_a = untied(parameterised_layers(probe_a, "probe_a", args, kwargs)[1])
    layers_b, tied_b = untied(
        parameterised_layers(probe_b, "probe_b", args_b, kwargs_b)[1]
    )
    paired, unpaired = pair_calls(layers_a, layers_b, ("probe_a", "probe_b"))
    tied = [described_tie(la, "probe_a") for la in tied_a]
    tied += [described_tie(la, "probe_b") for la in tied_b]
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
        rows,
        float(result_a.loss),
        float(result_b.loss),
        rtol,
        atol,
        tied=tuple(tied),
        unpaired=tuple(
            f"{label(layer)} ({layer.described}) of {name}" for name, layer in unpaired
        ),
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
    in_jax = [isinstance(probe, ProbeBase) and probe.runs_in_jax for probe in probes]
    if all(in_jax):
        return _jitted(runs)
    return tuple(
        _jitted([run])[0] if jax_run else _value_and_grad(*run)
        for run, jax_run in zip(runs, in_jax, strict=True)
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
    values_a, values_b, grads_a, grads_b = _broadcast(
        values_a, values_b, grads_a, grads_b
    )
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


def _broadcast(values_a, values_b, grads_a, grads_b):
    """Where one side's value broadcasts to the other's shape (PyTorch's
    position embedding `(1, seq, d)` against Flax's per-row `(batch, seq,
    d)`), the value broadcast and the other side's gradient summed over the
    broadcast axes: the gradient a broadcast value receives is that sum."""
    if len(values_a) != len(values_b) or len(grads_a) != len(values_a):
        return values_a, values_b, grads_a, grads_b
    values_a, values_b, grads_a, grads_b = map(
        list, (values_a, values_b, grads_a, grads_b)
    )
    for n, (a, b) in enumerate(zip(values_a, values_b, strict=True)):
        if a.shape == b.shape:
            continue
        if _broadcasts(a.shape, b.shape):
            values_a[n] = np.broadcast_to(a, b.shape)
            grads_b[n] = _summed_to(grads_b[n], a.shape)
        elif _broadcasts(b.shape, a.shape):
            values_b[n] = np.broadcast_to(b, a.shape)
            grads_a[n] = _summed_to(grads_a[n], b.shape)
    return values_a, values_b, grads_a, grads_b


def _broadcasts(small: tuple, large: tuple) -> bool:
    """`small` broadcasts to `large` by NumPy's rules: axes of 1 (a batch
    axis of 1), or leading axes missing (`(seq, d)` against `(batch, seq,
    d)`)."""
    extra = len(large) - len(small)
    return extra >= 0 and all(
        s in (1, big) for s, big in zip(small, large[extra:], strict=True)
    )


def _summed_to(grad: np.ndarray, shape: tuple) -> np.ndarray:
    """`grad` summed over the axes a value of `shape` was broadcast along."""
    grad = np.sum(grad, axis=tuple(range(grad.ndim - len(shape))))
    pairs = enumerate(zip(shape, grad.shape, strict=True))
    axes = tuple(n for n, (s, g) in pairs if s != g)
    return np.sum(grad, axis=axes, keepdims=True)


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


# -- hyperparameters ------------------------------------------------------------
