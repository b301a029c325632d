"""Running both models for `compare`: JAX models under one `jax.jit`, a
PyTorch model eagerly in PyTorch; with `dtype="float64"`, on float64 copies,
x64 enabled for the call only.

Apart from `compare.py`: how the models run (jit, precision, the libraries'
own float64 copies) changes independently of what is compared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import BridgeTypeError, BridgeValueError
from .._session.sites import split_arrays
from .compare_logits import with_logits
from .contract import porting_side
from .sides import ask, numpy_dtype


def run_both(probes, loss_fns, sites, inputs, logits_fns=None):
    """Both models' `value_and_grad` at their paired sites, the logits as
    aux: JAX models under one `jax.jit` (no parameter baked in), a PyTorch
    model eagerly in PyTorch."""
    if logits_fns is not None:
        loss_fns = tuple(
            with_logits(loss_fn, logits_fn)
            for loss_fn, logits_fn in zip(loss_fns, logits_fns, strict=True)
        )
    has_aux = logits_fns is not None
    runs = list(zip(probes, loss_fns, sites, inputs, strict=True))
    in_jax = [getattr(probe, "runs_in_jax", False) for probe in probes]
    if all(in_jax):
        return _jitted(runs, has_aux)
    return tuple(
        _jitted([run], has_aux)[0] if jax_run else _value_and_grad(*run, has_aux)
        for run, jax_run in zip(runs, in_jax, strict=True)
    )


def _value_and_grad(probe, loss_fn, names, inputs, has_aux=False):
    args, kwargs = inputs
    return probe.value_and_grad(
        loss_fn, *args, at=_exactly(names), has_aux=has_aux, **kwargs
    )


def _jitted(runs: list, has_aux: bool = False) -> tuple:
    """`_value_and_grad` of each run, all under one `jax.jit`, the inputs'
    arrays traced."""

    probes = [probe for probe, *_ in runs]
    losses_and_sites = [(loss_fn, names) for _, loss_fn, names, _ in runs]
    dynamic, rebuild = split_arrays([inputs for *_, inputs in runs])

    @jax.jit
    def run(probes, dynamic):
        return tuple(
            _value_and_grad(probe, loss_fn, names, inputs, has_aux)
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


# -- float64 --------------------------------------------------------------------


def requested_precision(dtype: Any, probes: Sequence[Any] = ()) -> str | None:
    """`"float64"` for a float64 `dtype`: NumPy's, JAX's, or one of the
    probes' libraries' (`torch.float64`, read by their porting sides)."""
    if dtype is None:
        return None
    name = None
    for side in (None, *_sides(probes)):
        found = numpy_dtype(side, dtype)
        if found is not None:
            name = found.name
            break
    if name != "float64":
        raise BridgeValueError(
            '`dtype` must be None (the models as they are) or "float64" (both '
            f"models run in float64, on copies); got {dtype!r}."
        )
    return name


def _sides(probes: Sequence[Any]) -> Iterator[Any]:
    """The porting sides of the probes that have one (a probe that cannot be
    ported is refused later, its error after `dtype`'s)."""
    for probe in probes:
        try:
            yield porting_side(probe, "probe")
        except BridgeTypeError:
            continue


@contextlib.contextmanager
def x64() -> Iterator[None]:
    """x64 enabled for the block only (this thread's; the global flag is left
    as it was)."""
    try:
        context = jax.enable_x64(True)
    except (AttributeError, TypeError):  # pragma: no cover - older JAX
        from jax.experimental import enable_x64

        context = enable_x64()
    with context:
        yield


def in_float64(probe: Any, name: str) -> Any:
    """A probe of a float64 copy of the model: the library's own
    `in_float64` where its porting module has one (PyTorch's `.double()`,
    the Flax libraries' `dtype` fields), else the probe's floating leaves
    cast."""
    own = getattr(porting_side(probe, name), "in_float64", None)
    if own is not None:
        return own(probe)
    if getattr(probe, "runs_in_jax", False):
        return jax.tree.map(_float64, probe)
    raise BridgeTypeError(
        f"`{name}` is a {type(probe).__name__}, which compare cannot run in "
        'float64: its porting module has no `in_float64`. Leave dtype="float64" '
        "out, or cast the model yourself."
    )


def _float64(leaf: Any, side: Any = None) -> Any:
    found = ask(side, "to_float64", leaf)
    if found is not None:
        return found
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        return leaf
    if isinstance(leaf, np.ndarray | np.generic):
        return np.asarray(leaf, np.float64)
    return jnp.asarray(leaf, jnp.float64)


def inputs_in_float64(inputs: tuple[tuple, dict], side: Any) -> tuple[tuple, dict]:
    """A model's inputs in float64: its library's arrays cast by its porting
    `side`, JAX's and NumPy's here."""
    return jax.tree.map(lambda leaf: _float64(leaf, side), inputs)
