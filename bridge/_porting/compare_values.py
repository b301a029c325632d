"""One pair's values compared, for `compare`: both sides brought to the
common layout, broadcast where one side's value broadcasts to the other's,
and their differences measured at the scale of the whole tensor.

Apart from `compare.py`: the numbers of a comparison, NumPy on values the
models have already produced, the same for every library.

A layer that applies an element-wise activation after its weights (a Keras
`Dense(activation="gelu")`) against one that applies none (a PyTorch
`nn.Linear`, its activation a module of its own after it) is compared after
the activation: the other side's value goes through it, and the gradient
with respect to this side's output goes back through it, at the other
side's value (`through_activation`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import BridgeValueError
from .hyperparameters import differing_hyperparameters
from .layer import Layer
from .report import PairComparison


def compare_pair(layer_a, layer_b, result_a, result_b, rtol, atol, kind):
    values_a = values_at(layer_a, result_a.activations)
    values_b = values_at(layer_b, result_b.activations)
    grads_a = values_at(layer_a, result_a.activation_grads)
    grads_b = values_at(layer_b, result_b.activation_grads)
    values_a, values_b, grads_a, grads_b = broadcast(
        values_a, values_b, grads_a, grads_b
    )
    if (layer_a.activation is None) != (layer_b.activation is None):
        if layer_a.activation is not None:
            values_b, grads_a = through_activation(
                layer_a.activation, values_b, grads_a
            )
        else:
            values_a, grads_b = through_activation(
                layer_b.activation, values_a, grads_b
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


def through_activation(activation, values, grads) -> tuple[list, list]:
    """`(activation(value), its VJP at value of grad)` of each leaf of the
    side without the activation (`values`) and of the gradients of the side
    with it (`grads`): the values after the activation, and the gradients
    before it, on both sides. Where the shapes differ, the values are left for
    `compare_pair` to refuse."""
    if len(values) != len(grads) or any(
        np.shape(v) != np.shape(g) for v, g in zip(values, grads, strict=True)
    ):
        return values, grads
    after, before = [], []
    for value, grad in zip(values, grads, strict=True):
        value = jnp.asarray(value)
        out, vjp = jax.vjp(activation, value)
        (back,) = vjp(jnp.asarray(grad, out.dtype))
        after.append(np.asarray(out))
        before.append(np.asarray(back))
    return after, before


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


def sites_of(layer: Layer) -> list[str]:
    """The sites whose values are the layer's: a packed layer's parts'."""
    return [part.site for part in layer.parts] if layer.parts else [layer.site]


def values_at(layer: Layer, by_site: Any) -> list[np.ndarray]:
    """The layer's values in the common layout, from `{site: value}`; a packed
    layer's (`Layer.parts`) are its parts' concatenated along the last axis,
    as the packed kernel's columns are."""
    if not layer.parts:
        return common(layer, by_site[layer.site])
    parts = [common(part, by_site[part.site]) for part in layer.parts]
    return [np.concatenate(leaves, -1) for leaves in zip(*parts, strict=True)]


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
