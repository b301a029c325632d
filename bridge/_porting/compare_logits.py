"""The outputs compared as logits, at the end of `compare`'s report: which
outputs are logits (`logits=`, or found in the outputs), and the two models'
KL divergence and top-1 agreement over every position.

Apart from `compare.py`: it concerns the models' outputs, not the pairs of
layers, and runs in NumPy on the host whatever the libraries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._errors import BridgeTypeError, BridgeValueError
from .contract import PortingSide
from .report import LogitsComparison
from .sides import host_array, numpy_dtype


def logits_pair(logits: Any) -> tuple[Any, Any] | None:
    """`None` (no logits), or a function per model (`Found`: found)."""
    if logits is False:
        return None
    if logits is None:
        return (Found(), Found())
    pair_ = function_pair(logits)
    if pair_ is None:
        raise BridgeTypeError(
            "`logits` must be None (found in the outputs), False (none), a "
            "function `outputs -> logits`, or a pair `(logits_a, logits_b)` of "
            f"them; got {logits!r}."
        )
    return pair_


def function_pair(given: Any) -> tuple[Any, Any] | None:
    """`given`, a function for both models or a pair of them, as a pair;
    `None` where it is neither."""
    pair_ = tuple(given) if isinstance(given, tuple | list) else (given,) * 2
    if len(pair_) != 2 or not all(callable(f) for f in pair_):
        return None
    return pair_


def on_sides(logits_fns: Any, sides: tuple[PortingSide, PortingSide]) -> Any:
    """`logits_fns`, each `Found` reading its own model's values."""
    if logits_fns is None:
        return None
    return tuple(
        Found(side) if isinstance(fn, Found) else fn
        for fn, side in zip(logits_fns, sides, strict=True)
    )


class Found:
    """The outputs' logits: a `logits` field or key (a Hugging Face output),
    else the outputs themselves when they are one floating array whose last
    axis has two entries or more; else `None`. `side`: the porting side of
    the model whose outputs they are, which reads its library's dtypes."""

    def __init__(self, side: PortingSide | None = None):
        self.side = side

    def __call__(self, outputs: Any) -> Any:
        found = getattr(outputs, "logits", None)
        if found is None and isinstance(outputs, dict):
            found = outputs.get("logits")
        if found is None and self._floating(outputs) and np.ndim(outputs) >= 1:
            found = outputs if outputs.shape[-1] >= 2 else None
        return found if self._floating(found) else None

    def _floating(self, value: Any) -> bool:
        dtype = getattr(value, "dtype", None)
        if dtype is None or not hasattr(value, "shape"):
            return False
        found = numpy_dtype(self.side, dtype)
        return found is not None and bool(jnp.issubdtype(found, jnp.floating))


def with_logits(loss_fn: Callable, logits_fn: Any) -> Callable:
    """`loss_fn` returning the logits as its aux."""
    return lambda outputs: (loss_fn(outputs), logits_fn(outputs))


def logits_figures(logits_a: Any, logits_b: Any, logits_fns, sides) -> Any:
    """KL divergence and top-1 agreement of the two models' logits, over
    every position (each index of all axes but the last); `None` where
    there are none, or (found, not given) where their shapes differ.
    `sides`: the two models' porting sides, which read their values."""
    if logits_fns is None or logits_a is None or logits_b is None:
        return None
    a, b = (
        np.asarray(host_array(side, value), np.float64)
        for side, value in zip(sides, (logits_a, logits_b), strict=True)
    )
    if a.shape != b.shape:
        if isinstance(logits_fns[0], Found):
            return None
        raise BridgeValueError(
            f"The logits given by `logits` have shapes {a.shape} and {b.shape}: "
            "compare needs the same positions and classes on both sides."
        )
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    log_p, log_q = _log_softmax(a), _log_softmax(b)
    # Never below 0 but by rounding, which would read as a sign.
    kl = np.maximum(np.sum(np.exp(log_p) * (log_p - log_q), axis=-1), 0.0)
    top1 = np.argmax(a, axis=-1) == np.argmax(b, axis=-1)
    return LogitsComparison(float(np.mean(kl)), float(np.mean(top1)), len(a))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - np.max(x, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))
