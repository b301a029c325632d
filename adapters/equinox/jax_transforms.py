"""Equinox sites inside JAX transforms of the model's own code that carry
none of bridge's leaves: the route out of the model's own `jax.vmap`, and the
calls the router refuses.

Inside the model's own `jax.vmap` (`eqx.nn.MultiheadAttention` projects every
token with `jax.vmap(self.query_proj)`; `eqx.nn.MLP` applies its activation
per neuron), the wrapper sees one token, yet the site holds every token, with
per-token gradients. The wrapper binds a private primitive whose batching rule
is the only code that sees the whole mapped value: at each enclosing `vmap`
the rule moves that vmap's axis to the front (broadcasting a value that does
not vary along it) and passes the value one trace out, until it reaches the
probe's own trace. There the session records it and adds an epsilon of the
full shape, `(tokens, features)`, outermost mapped axis first, and the rule
hands the result back in, mapped along axis 0 at every level. No tracer leaves
its trace and autodiff sees ordinary operations, so gradients are per token,
eager or jitted (`lift`; `bridge.adapters.shared.lifting` is the same
mechanism without the call's leaves).

Inside `lax.scan` over stacked layers and inside `jax.checkpoint` no value
can be handed out: that route, through the tree, is
`bridge.adapters.equinox.transforms`. The model's own vmaps inside a scan body
hand their value out the same way, to the body's trace, where that route
takes it on (`lift` with the call's leaves from the tree as `extra`).

A call the router refuses (`bridge.adapters.equinox.rules`: a `jax.vmap` of
the model's own code around a `lax.scan`, a `while_loop`, nested scans; or a
layer the scan closes over, which the tree route refuses) has no route for
its epsilon or its value. It must not cost the other sites anything: the
README promises that unselected sites cost nothing, so discovery lists it and
a run that neither selects nor patches it calls it as it is (`unreachable`).
Where it is selected or patched, the router's sentence is raised (its
origin's `blocked`). It is listed with the shape its value has for the
model, as the contract lays sites out: the axes of the model's own
`jax.vmap`s around it in front (after the batch axis of `vmap=True`,
outermost first), the iterations of the scans around it first
(`whole_axes`).

The trace stack is read through `bridge.adapters.shared.jax_internals`, the one
place that touches JAX's private modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from bridge.adapter_api import (
    BridgeRuntimeError,
    Refused,
    Session,
    SiteOrigin,
)

from ..shared import jax_internals, unexpressible

# -- inside the model's own jax.vmap: handing the whole value out ----------------


@dataclasses.dataclass(frozen=True)
class Mapped(SiteOrigin):
    """Where the model's own vmaps took a call's input from.

    The site's value holds the mapped axes first, outermost first (the
    contract's layout); `compare` needs the layout around the layer instead:
    a LayerNorm applied per pixel of a channel-first image by
    `jax.vmap(jax.vmap(norm, 1, 1), 2, 2)` holds `(W, H, C)` per example,
    which no shape tells from `(H, W, C)`.

    Attributes:
      input_axes: the axis each vmap mapped in the first array argument,
        innermost vmap first (`None`: not mapped there).
      input_ndim: that argument's rank as the layer sees it.
    """

    #: Where the call runs the core reads from the computation: this origin
    #: only describes the inputs' layout.
    routes: ClassVar[bool] = False

    input_axes: tuple[int | None, ...]
    input_ndim: int


def mapped_origin(args: tuple, depth: int) -> Mapped | None:
    """The `Mapped` origin of a call `depth` vmaps deep, or `None` where its
    first array argument's layout cannot be read."""
    arrays = [leaf for leaf in jax.tree.leaves(args) if eqx.is_array(leaf)]
    if not arrays:
        return None
    axes = jax_internals.mapped_dims(arrays[0], jax_internals.current_trace(), depth)
    if axes is None:
        return None
    return Mapped(axes, jnp.ndim(arrays[0]))


def describe(transforms: tuple[str, ...]) -> str:
    """`a inside b`: the transforms JAX names `transforms` (innermost first),
    as the model's code writes them."""
    names = jax_internals.TRANSFORM_NAMES
    # A loop JAX runs in several traces (the bounded kind's nest) is one.
    distinct = [t for i, t in enumerate(transforms) if i == 0 or t != transforms[i - 1]]
    return " inside ".join(names.get(t, t) for t in distinct)


def lift(tree: Any, depth: int, observe: Callable[..., Any], extra: Any = None) -> Any:
    """Hand `tree`, seen inside `depth` vmaps, to `observe` at the trace
    `depth` vmaps out: the probe's trace, or the body of a `lax.scan` or
    `jax.checkpoint` around those vmaps.

    `observe(full)` gets the full value, mapped axes first, outermost first,
    and returns the value to go on with, of the same structure and shapes.
    With `extra` (bridge's leaves of the call in the tree, which the vmaps do
    not map), it is `observe(full, extra)`, `extra` as it is out there.
    """
    leaves, treedef = jax.tree.flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if eqx.is_array(leaf)]
    extra_leaves, extra_treedef = jax.tree.flatten(extra)

    def observe_arrays(full_arrays: list, extra_arrays: list) -> list:
        full = list(leaves)
        for i, array in zip(positions, full_arrays, strict=True):
            full[i] = array
        full_tree = jax.tree.unflatten(treedef, full)
        if extra is None:
            observed = observe(full_tree)
        else:
            observed = observe(
                full_tree, jax.tree.unflatten(extra_treedef, extra_arrays)
            )
        returned = treedef.flatten_up_to(observed)
        return [returned[i] for i in positions]

    arrays = _lift_p.bind(
        *[leaves[i] for i in positions],
        *extra_leaves,
        observe=observe_arrays,
        depth=depth,
        extra=len(extra_leaves),
    )
    new = list(leaves)
    for i, array in zip(positions, arrays, strict=True):
        new[i] = array
    return jax.tree.unflatten(treedef, new)


def _lift_batched(axis_size, values, dims, *, observe, depth, extra):
    """The batching rule: runs one trace out, where the mapped value is whole."""
    cut = len(values) - extra
    full = [
        jnp.broadcast_to(value, (axis_size, *jnp.shape(value)))
        if dim is None
        else jnp.moveaxis(value, dim, 0)
        for value, dim in zip(values[:cut], dims[:cut], strict=True)
    ]
    # The call's leaves are whole where this vmap closes over them; where it
    # maps them (the model maps a stack of layers: `jax.vmap(lambda head:
    # head(x))(self.heads)`), they are mapped as the layers' value is.
    leaves = [
        value if dim is None else jnp.moveaxis(value, dim, 0)
        for value, dim in zip(values[cut:], dims[cut:], strict=True)
    ]
    if depth > 1:
        out = _lift_p.bind(
            *full, *leaves, observe=observe, depth=depth - 1, extra=extra
        )
    else:
        out = observe(full, leaves)
    return list(out), [0] * len(out)


def _outside_a_vmap(*args, **params):
    raise BridgeRuntimeError(
        "bridge's Equinox site primitive was evaluated outside a jax.vmap. This is "
        "a bug in bridge: please report it."
    )


_lift_p = jax_internals.mapped_primitive(
    "bridge_equinox_site", _lift_batched, _outside_a_vmap
)


# -- calls the router refuses: listed, refused where selected or patched ----------


@dataclasses.dataclass(frozen=True)
class Whole:
    """The axes a value seen inside transforms has for the model, each
    outermost first: the sizes of the model's own `jax.vmap`s around it,
    and the iterations of the scans (`None`: a scan's count unknown)."""

    mapped: tuple[int, ...]
    iterations: tuple[int, ...] | None


def unreachable(
    session: Session,
    site: Any,
    method: str | None,
    module: Any,
    function: Callable,
    args: tuple,
    kwargs: dict,
    origin: SiteOrigin,
    refused: Refused,
    whole: Whole,
) -> Any:
    """Call `function` as the model does, listed as a site (its `origin`)
    that raises the router's sentence of its refusal (`refused`) for its
    name, where it is selected or patched. `whole`: the axes its value has for the model
    around the one seen here (`whole_axes`)."""
    call = session.enter(site.path, method, module, args, origin=origin, record=False)
    call.origin = dataclasses.replace(origin, blocked=refused.at(call.name))
    value = function(*args, **kwargs)
    if not session.recorder.learns_sites():
        return session.exit(call, value, perturb=lambda v: v, record=False)
    listed = _leading(value, whole.mapped)
    session.exit(call, listed, perturb=lambda v: v, record=False)
    for length in reversed(whole.iterations or ()):  # innermost first
        session.recorder.holds_iterations(call.name, listed, length)
        listed = _leading(listed, (length,))
    return value


def _leading(value: Any, axes: tuple[int, ...]) -> Any:
    return jax.tree.map(
        lambda v: jnp.broadcast_to(v, (*axes, *jnp.shape(v))) if eqx.is_array(v) else v,
        value,
    )


def whole_axes(enclosing: tuple[str, ...], iterations: int | None) -> Whole:
    """The axes that the transforms around this point (`enclosing`, innermost
    first) add to a value seen here: each `jax.vmap`'s size, and the scans'
    iterations (`iterations` for the only scan, else read off `lax.scan`'s
    frames where their count matches; `None` where unknown). A loop or a
    branch adds none."""
    mapped = []
    trace = jax_internals.current_trace()
    for name in enclosing:
        if name == "vmap":
            size = jax_internals.vmap_size(trace)
            if size is not None:
                mapped.append(size)
        trace = jax_internals.parent(trace)
    scans = sum(name in unexpressible.SCANS for name in enclosing)
    lengths: tuple[int, ...] | None = ()
    if scans == 1 and iterations:
        lengths = (iterations,)
    elif scans:
        frames = jax_internals.scan_frames(None) or []
        lengths = (
            tuple(length for length, _ in reversed(frames))
            if len(frames) == scans
            else None
        )
    return Whole(tuple(reversed(mapped)), lengths)
