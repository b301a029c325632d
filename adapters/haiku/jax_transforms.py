"""Haiku sites inside JAX's own transforms in the model's code (`jax.vmap`,
`jax.checkpoint`, `lax.scan`, `lax.cond`, ...), which Haiku's state does not
thread and its call stack does not name.

Inside the model's own `jax.vmap`s a call sees one example, yet the site
holds every example, mapped axes first, outermost first (the contract's
layout), with per-example gradients. The value is handed out whole through a
private primitive whose batching rule is the only code that sees it whole: at
each enclosing `vmap` the rule moves that vmap's axis to the front
(broadcasting a value that does not vary along it) and passes it one trace
out, until it reaches the probe's own trace. There the session takes it as
any site's value (epsilon, patch, recording), and the rule hands the result
back in, mapped along axis 0 at every level. No tracer leaves its trace, and
autodiff sees ordinary operations (`lift`; the Equinox adapter hands values
out of the model's own vmaps the same way).

Inside any other transform of JAX's (a `lax.scan`, `jax.checkpoint`,
`lax.cond`, ...), no value can leave and no epsilon can enter: the site is
listed with the shape its value has for the model and refused where selected
or patched, naming the innermost such transform (`blocker`).

The trace stack is read through `bridge.adapters.shared.jax_internals`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from bridge.adapter_api import BridgeRuntimeError, is_array

from ..shared import jax_internals

#: How a refusal names JAX's transforms (a trace's `traced_for`).
_NAMES = {
    "scan": "jax.lax.scan",
    "fori_loop": "jax.lax.fori_loop",
    "checkpoint / remat": "jax.checkpoint",
    "cond": "jax.lax.cond",
    "switch": "jax.lax.switch",
    "while_body": "jax.lax.while_loop",
    "while_cond": "jax.lax.while_loop",
    "jit": "a jax.jit inside the model",
    "pjit": "a jax.jit inside the model",
    "vmap": "jax.vmap",
}


def around(base: Any) -> tuple[int, str | None]:
    """JAX's transforms between here and `base` (the trace of the probe's
    `apply`): `(depth, None)` where only `depth` `jax.vmap`s stand between
    (`0`: none), else `(0, name)` of the innermost other one, as a refusal
    names it."""
    trace = jax_internals.current_trace()
    depth = 0
    while trace is not base:
        if trace is None:  # jax < 0.6.2: a jaxpr trace records no parent
            return 0, "a transform whose enclosing trace this jax does not record"
        if not jax_internals.is_vmap(trace):
            traced = jax_internals.traced_for(trace)
            return 0, _NAMES.get(traced, f"jax's {traced}")
        trace = jax_internals.parent(trace)
        depth += 1
    return depth, None


#: Why a site inside each JAX transform cannot be expressed, and what to do.
REFUSALS = {
    "jax.lax.scan": (
        "Haiku state does not reach inside a jax.lax.scan of the model's own "
        "code, so no epsilon can enter and no value leave it per iteration",
        "write the loop as hk.scan, or stack layers with hk.experimental.layer_stack",
    ),
    "jax.checkpoint": (
        "Haiku state does not reach inside a jax.checkpoint of the model's own "
        "code, so no epsilon can enter and no value leave it",
        "rematerialise with hk.remat, which threads Haiku state",
    ),
    "jax.lax.cond": (
        "which branch runs is known only when the model runs, so a call in a "
        "branch may not run at all",
        "compute both branches and pick with jnp.where",
    ),
    "jax.lax.switch": (
        "which branch runs is known only when the model runs, so a call in a "
        "branch may not run at all",
        "compute every branch and pick with jnp.where",
    ),
    "jax.lax.while_loop": (
        "how many iterations run is known only when the model runs, so no "
        "epsilon or recording can be shaped for them",
        "write the loop as hk.scan of fixed length",
    ),
}


def lift(tree: Any, depth: int, observe: Callable[[Any], Any]) -> Any:
    """Hand `tree`, seen inside `depth` of the model's own `jax.vmap`s, to
    `observe` at the trace `depth` vmaps out (the probe's): `observe(full)`
    gets its arrays whole, mapped axes first, outermost first, and returns
    the value to go on with, of the same structure and shapes."""
    leaves, treedef = jax.tree.flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if is_array(leaf)]

    def observe_arrays(full_arrays: list) -> list:
        full = list(leaves)
        for i, array in zip(positions, full_arrays, strict=True):
            full[i] = array
        returned = treedef.flatten_up_to(observe(jax.tree.unflatten(treedef, full)))
        return [returned[i] for i in positions]

    arrays = [leaves[i] for i in positions]
    out = _lift_p.bind(*arrays, observe=observe_arrays, depth=depth)
    new = list(leaves)
    for i, array in zip(positions, out, strict=True):
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
        "bridge's Haiku site primitive was evaluated outside a jax.vmap. This is "
        "a bug in bridge: please report it."
    )


_lift_p = jax_internals.mapped_primitive(
    "bridge_haiku_site", _lift_batched, _outside_a_vmap
)
