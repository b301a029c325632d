"""Handing a value seen inside the model's own `jax.vmap`s out to the trace
the probe runs in, and the result back in.

A call inside `jax.vmap(f)` of the model's own code sees one example, yet its
site holds every example, mapped axes first, outermost first (the contract).
`lift` binds a private primitive whose batching rule is the only code that
sees the whole mapped value: at each enclosing `vmap` the rule moves that
vmap's axis to the front (broadcasting a value that does not vary along it)
and passes the value one trace out, until it reaches the trace outside the
vmaps. There `observe(full)` records it (and adds its epsilon, or patches
it), and the rule hands the result back in, mapped along axis 0 at every
level. No tracer leaves its trace and autodiff sees ordinary operations, so
gradients are per example, eager or jitted.

The Linen adapter uses it (the others report every call plainly, and the
core reads the model's vmaps from the computation). The trace stack is read
through `bridge.adapters.shared.jax_internals`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from bridge.adapter_api import BridgeRuntimeError, is_array

from . import jax_internals


def lift(tree: Any, depth: int, observe: Callable[[Any], Any]) -> Any:
    """Hand `tree`, seen inside `depth` vmaps, to `observe` at the trace
    `depth` vmaps out. `observe(full)` gets the full value, mapped axes
    first, outermost first, and returns the value to go on with, of the same
    structure and shapes. Leaves that are not arrays pass as they are."""
    leaves, treedef = jax.tree.flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if is_array(leaf)]
    if not positions:
        observe(tree)
        return tree

    def observe_arrays(full_arrays: list) -> list:
        full = list(leaves)
        for i, array in zip(positions, full_arrays, strict=True):
            full[i] = array
        returned = treedef.flatten_up_to(observe(jax.tree.unflatten(treedef, full)))
        return [returned[i] for i in positions]

    arrays = _lift_p.bind(
        *[leaves[i] for i in positions], observe=observe_arrays, depth=depth
    )
    new = list(leaves)
    for i, array in zip(positions, arrays, strict=True):
        new[i] = array
    return jax.tree.unflatten(treedef, new)


def _lift_batched(axis_size, values, dims, *, observe, depth):
    """The batching rule: runs one trace out, where the mapped value is whole."""
    full = [
        jnp.broadcast_to(value, (axis_size, *jnp.shape(value)))
        if dim is None
        else jnp.moveaxis(value, dim, 0)
        for value, dim in zip(values, dims, strict=True)
    ]
    if depth > 1:
        out = _lift_p.bind(*full, observe=observe, depth=depth - 1)
    else:
        out = observe(full)
    return list(out), [0] * len(out)


def _outside_a_vmap(*args, **params):
    raise BridgeRuntimeError(
        "bridge's lifted-site primitive was evaluated outside a jax.vmap. This is "
        "a bug in bridge: please report it."
    )


_lift_p = jax_internals.mapped_primitive(
    "bridge_lifted_site", _lift_batched, _outside_a_vmap
)
