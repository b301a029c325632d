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
from .report import LogitsComparison


def logits_pair(logits: Any) -> tuple[Any, Any] | None:
    """`None` (no logits), or a function per model (`_AUTO`: found)."""
    if logits is False:
        return None
    if logits is None:
        return (_AUTO, _AUTO)
    pair_ = tuple(logits) if isinstance(logits, tuple | list) else (logits,) * 2
    if len(pair_) != 2 or not all(callable(f) for f in pair_):
        raise BridgeTypeError(
            "`logits` must be None (found in the outputs), False (none), a "
            "function `outputs -> logits`, or a pair `(logits_a, logits_b)` of "
            f"them; got {logits!r}."
        )
    return pair_


def _AUTO(outputs: Any) -> Any:
    """The outputs' logits: a `logits` field or key (a Hugging Face output),
    else the outputs themselves when they are one floating array whose last
    axis has two entries or more; else `None`."""
    found = getattr(outputs, "logits", None)
    if found is None and isinstance(outputs, dict):
        found = outputs.get("logits")
    if found is None and _floating(outputs) and np.ndim(outputs) >= 1:
        found = outputs if outputs.shape[-1] >= 2 else None
    return found if _floating(found) else None


def _floating(value: Any) -> bool:
    if type(value).__module__.split(".")[0] == "torch":
        return hasattr(value, "is_floating_point") and value.is_floating_point()
    dtype = getattr(value, "dtype", None)
    return (
        dtype is not None
        and hasattr(value, "shape")
        and jnp.issubdtype(dtype, jnp.floating)
    )


def with_logits(loss_fn: Callable, logits_fn: Any) -> Callable:
    """`loss_fn` returning the logits as its aux."""
    return lambda outputs: (loss_fn(outputs), logits_fn(outputs))


def _host(value: Any) -> np.ndarray:
    if type(value).__module__.split(".")[0] == "torch":
        return value.detach().cpu().double().numpy()
    return np.asarray(value, np.float64)


def logits_figures(logits_a: Any, logits_b: Any, logits_fns) -> Any:
    """KL divergence and top-1 agreement of the two models' logits, over
    every position (each index of all axes but the last); `None` where
    there are none, or (found, not given) where their shapes differ."""
    if logits_fns is None or logits_a is None or logits_b is None:
        return None
    a, b = _host(logits_a), _host(logits_b)
    if a.shape != b.shape:
        if logits_fns[0] is _AUTO:
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
