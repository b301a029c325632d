"""Values that leave a branch through the backward pass.

A value computed inside a `lax.cond` or `lax.switch` branch (or a scan's
body) is a tracer of that branch's trace: recorded by side effect, it would
leak. The epsilon needs no route (the branch closes over it, and JAX gives
it a zero gradient where the branch did not run), but the value does. It
leaves as a gradient: the call's value passes through `record`, an identity
whose backward pass returns the value itself (and the call's inputs, and
ones) as the cotangents of zero-valued recorders the branch closes over, and
one `jax.vjp` of the model (`run_recording`) pulls them out. Where the branch
did not run, its backward pass never reaches `record`: the value, the
inputs and the ones stay zeros, so the ones say where it ran
(`ProbeResult.ran`). Under a `vmap` whose predicate varies, JAX runs every
branch and selects each operand's gradient by the predicate, so this holds
per example.

The core routes a selected site here where its origin is an `InBranch`
(set by the adapter at discovery); an adapter with its own route (the
Equinox tree, where a scan slices the recorders) uses `record` directly.
Inputs that are not floating-point travel as float32 numbers a cotangent
carries exactly (`as_floats`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import BridgeValueError
from .sites import (
    JAX_ARRAYS,
    SiteOrigin,
    abstract,
    differentiable_part,
    zeros_like_struct,
)

#: JAX's names (a trace's `traced_for`) of the branches.
BRANCHES = frozenset({"cond", "switch"})


@jax.custom_vjp
def record(value: Any, inputs: Any, recorders: Any) -> Any:
    """`value`; the cotangent of `recorders = (value recorder, inputs
    recorder, ran recorder)` is `(value, inputs, ones)` (`None` where a
    recorder is)."""
    del inputs, recorders
    return value


def _record_forward(value: Any, inputs: Any, recorders: Any) -> tuple[Any, Any]:
    _, _, ran = recorders
    return value, (value, inputs, ran)


def _record_backward(recorded: Any, cotangent: Any) -> tuple[Any, Any, Any]:
    value, inputs, ran = recorded
    ran = jax.tree.map(jnp.ones_like, ran)
    return cotangent, jax.tree.map(jnp.zeros_like, inputs), (value, inputs, ran)


record.defvjp(_record_forward, _record_backward)


@dataclasses.dataclass(frozen=True)
class InBranch(SiteOrigin):
    """A call inside a `lax.cond` or `lax.switch` (the library's own, or JAX's
    in the model's code) and no other transform bridge must see through: its
    epsilon and patch value are closed over, its value and inputs leave
    through the backward pass (see the module docstring).

    Attributes:
      transforms: JAX's names of the transforms around the call, innermost
        first (`cond`, `switch`, a `jit` inside the model).
      inputs: how each positional array input comes back from its float32
        transport (an `Encoding`, `None` for other arguments).
      inputs_recorder: the abstract zeros its inputs are recorded through.
      inner: the adapter's own origin of the call, where it has one.
    """

    transforms: tuple[str, ...] = ()
    inputs: Any = None
    inputs_recorder: Any = None
    inner: SiteOrigin | None = None

    def __getattr__(self, name: str) -> Any:
        # What the adapter's own origin says of the call (its bundle, its
        # scope), for the adapter's code that reads every site's origin.
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @classmethod
    def of(
        cls, transforms: tuple[str, ...], args: tuple, inner: SiteOrigin | None = None
    ) -> InBranch:
        """The origin of a call inside `transforms` with positional `args`."""
        arrays = JAX_ARRAYS.positional(args)
        return cls(
            tuple(transforms),
            jax.tree.map(Encoding.of, arrays),
            abstract(jax.tree.map(as_floats, arrays)),
            inner,
        )


def branches_only(transforms: tuple[str, ...]) -> bool:
    """Whether `transforms` (innermost first; `jit` and `pjit` are traced
    through) hold a branch and nothing else bridge must see through."""
    seen = [t for t in transforms if t not in ("jit", "pjit")]
    return bool(seen) and all(t in BRANCHES for t in seen)


def run_recording(
    run: Callable[[Any], tuple[Any, Any, dict, dict, dict]],
    sites: Mapping[str, Any],
    with_inputs: bool,
    without_batch: Callable[[Any], Any],
) -> tuple[Any, Any, dict, dict, dict]:
    """`run(recorders)` -> `(outputs, state, activations, inputs, ran)`, run
    inside one `jax.vjp` whose pullback brings the values, inputs and
    where-they-ran of `sites` (`{name: Site}`, each `InBranch`) out of their
    branches. `without_batch(site)` is the site's abstract value as one
    trace sees it (one example's, under the probe's vmap)."""
    recorders = {
        name: (
            zeros_like_struct(without_batch(site)),
            zeros_like_struct(site.origin.inputs_recorder) if with_inputs else None,
            jnp.zeros((), jnp.float32),
        )
        for name, site in sites.items()
    }

    def forward(recorders: dict) -> tuple[Any, Any]:
        outputs, state, activations, inputs, ran = run(recorders)
        floats = [
            jnp.sum(leaf.astype(jnp.float32))
            for leaf in jax.tree.leaves(differentiable_part((outputs, state)))
            if leaf is not None
        ]
        if not floats:
            raise BridgeValueError(
                "bridge records the sites inside jax.lax.cond through the "
                "backward pass of the model's outputs, but {model_name} "
                "returned no floating-point array."
            )
        return sum(floats, jnp.zeros(())), (outputs, state, activations, inputs, ran)

    total, pullback, (outputs, state, activations, inputs, ran) = jax.vjp(
        forward, recorders, has_aux=True
    )
    (cotangents,) = pullback(jnp.ones_like(total))
    activations, inputs, ran = dict(activations), dict(inputs), dict(ran)
    for name, site in sites.items():
        value, site_inputs, site_ran = cotangents[name]
        activations[name] = value
        if with_inputs:
            inputs[name] = jax.tree.map(from_floats, site.origin.inputs, site_inputs)
        ran[name] = site_ran > 0
    return outputs, state, activations, inputs, ran


# -- inputs as numbers a cotangent carries ------------------------------------


@dataclasses.dataclass(frozen=True)
class Encoding:
    """How an input came to be float32 numbers in `as_floats`, to undo it."""

    dtype: Any
    key_impl: Any = None

    @classmethod
    def of(cls, x: Any) -> Encoding:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return cls(jax.random.key_data(x).dtype, jax.random.key_impl(x))
        return cls(x.dtype)


def as_floats(x: Any) -> Any:
    """An input as numbers a floating-point cotangent carries exactly: floats
    as they are, integers and booleans as float32 (wider ones as their 16-bit
    words, exact in float32), a typed random key as its integer data."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype.itemsize > 1:
        x = jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x.astype(jnp.float32)


def from_floats(encoding: Encoding, x: Any) -> Any:
    """The inverse of `as_floats`, on the recorded (stacked) numbers."""
    dtype = jnp.dtype(encoding.dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return x
    if dtype.itemsize > 1:
        x = jax.lax.bitcast_convert_type(x.astype(jnp.uint16), dtype)
    else:
        x = x.astype(dtype)
    if encoding.key_impl is not None:
        x = jax.random.wrap_key_data(x, impl=encoding.key_impl)
    return x
