"""One pair's values compared, for `compare`: both sides brought to the
common layout, broadcast where one side's value broadcasts to the other's,
and their differences measured at the scale of the whole tensor.

Apart from `compare.py`: the numbers of a comparison, NumPy on values the
models have already produced, the same for every library.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import BridgeValueError
from .hyperparameters import differing_hyperparameters
from .layer import Layer
from .report import PairComparison


def compare_pair(layer_a, layer_b, result_a, result_b, rtol, atol, kind):
    values_a = common(layer_a, result_a.activations[layer_a.site])
    values_b = common(layer_b, result_b.activations[layer_b.site])
    grads_a = common(layer_a, result_a.activation_grads[layer_a.site])
    grads_b = common(layer_b, result_b.activation_grads[layer_b.site])
    values_a, values_b, grads_a, grads_b = broadcast(
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
    act_abs, act_rel, act_ok = differences(values_a, values_b, rtol, atol)
    grad_abs, grad_rel, grad_ok = differences(grads_a, grads_b, rtol, atol)
    hyperparameters = (
        {}
        if kind == "tied"  # a Linear against an embedding's `attend`
        else differing_hyperparameters(layer_a.hyperparameters, layer_b.hyperparameters)
    )
    return PairComparison(
        layer_a.site,
        layer_b.site,
        kind,
        tuple(shapes_a[0]) if shapes_a else (),
        act_abs,
        act_rel,
        act_ok,
        grad_abs,
        grad_rel,
        grad_ok,
        hyperparameters,
    )


def broadcast(values_a, values_b, grads_a, grads_b):
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


def common(layer: Layer, value: Any) -> list[np.ndarray]:
    return [np.asarray(layer.to_common(leaf)) for leaf in layer.select(value)]


def differences(
    values_a: list, values_b: list, rtol: float, atol: float
) -> tuple[float, float, bool]:
    """`(largest |a - b|, that over the largest |b|, agree)` over the leaves.

    A leaf agrees when `max|a - b| <= atol + rtol * max|b|`: its difference
    is judged at the scale of the whole tensor, not element by element. A
    float32 result summed in another order differs by a few units of
    rounding of its *largest* elements, and that difference lands on every
    element, those near zero too, where an elementwise `rtol * |b|` is no
    room at all (a false alarm that depends on the CPU's vector width). A
    port's bug moves elements by far more than that rounding.
    """
    largest_abs, largest_b, agree = 0.0, 0.0, True
    for a, b in zip(values_a, values_b, strict=True):
        if a.size == 0:
            continue
        a, b = a.astype(np.float64), b.astype(np.float64)
        difference = float(np.max(np.abs(a - b)))
        scale = float(np.max(np.abs(b)))
        largest_abs = max(largest_abs, difference)
        largest_b = max(largest_b, scale)
        # A NaN difference compares false: it disagrees.
        agree = agree and difference <= atol + rtol * scale
    relative = largest_abs / largest_b if largest_b > 0 else largest_abs
    return largest_abs, relative, agree
