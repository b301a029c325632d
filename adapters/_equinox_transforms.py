"""Equinox sites inside JAX transforms of the model's own code.

Two routes, both reached from `bridge.adapters.equinox`'s wrappers:

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
eager or jitted (`lift`).

Inside `lax.scan` over stacked layers (`eqx.filter_vmap` builds them, the scan
slices them per step, directly or after `eqx.partition`) and inside
`jax.checkpoint` / `eqx.filter_checkpoint`, no value can be handed out: the
epsilon lives in the tree instead (the design's tree surgery). Discovery finds
these calls and their iterations (a wrapper whose parameters lost a leading
axis of size L was sliced by the scan). For the run, each such wrapper holds,
per selected call, a zero epsilon leaf and a zero "recorder" leaf of the
stacked shape `(L, *value shape)`: the scan slices them with the parameters,
so the epsilon's gradient is the stacked activation gradient. The value leaves
the scan backwards: the recorder enters through a `custom_vjp` identity whose
backward pass returns the value itself as the recorder's cotangent, and
`run_with_tree_leaves` pulls it out with one `jax.vjp` of the model
(`call_in_transform`). A call inside a transform this cannot express
(`lax.cond`, `while_loop`, a `jax.jit` inside the model, a `vmap` inside the
scan, a layer closed over by the scan body rather than scanned over) raises an
error naming it: a site is never silently missing or summed over iterations.

The trace stack is read through `bridge.adapters._jax_internals`, the one
place that touches JAX's private modules.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from bridge._session import Session
from bridge._sites import (
    differentiable_part,
    merge_differentiable,
    without_axis,
    zeros_like_struct,
)

from . import _jax_internals as internals


class Leaves(eqx.Module):
    """A call's epsilon and recorder inside a transform: array leaves of the
    tree, so a scan slices them as it slices the parameters."""

    epsilon: Any
    recorder: Any


def param_shapes(module: Any) -> tuple[tuple[int, ...], ...]:
    """Shapes of a module's arrays, bridge's own leaves left out."""
    arrays = eqx.filter(module, eqx.is_array, is_leaf=lambda x: isinstance(x, Leaves))
    return tuple(tuple(a.shape) for a in jax.tree.leaves(arrays))


# -- inside the model's own jax.vmap: handing the whole value out ----------------


def mapped_depth(base_trace: Any) -> int | None:
    """How many `jax.vmap`s of the model's own code enclose this point.

    `None` when another transform (`lax.scan`, `jax.checkpoint`, …) stands
    between here and the probe's trace: no value can be handed out from there.
    """
    trace = internals.current_trace()
    depth = 0
    while trace is not base_trace:
        if not internals.is_vmap(trace):
            return None
        trace = internals.parent(trace)
        depth += 1
    return depth


# -- inside lax.scan and jax.checkpoint: epsilons and recorders in the tree -------


def in_tree(session: Session) -> dict[str, Any]:
    """The selected sites whose epsilons live in the tree."""
    return {
        name: site
        for name, site in session.selected.items()
        if isinstance(site.origin, InTransform)
    }


def run_with_tree_leaves(
    call_model: Callable[[dict[str, Leaves]], tuple[Any, Any]],
    session: Session,
    vmap: bool,
    model_name: str,
) -> tuple[Any, Any]:
    """Run the model with each in-tree site's epsilon and recorder leaves
    (`call_model(leaves) -> (outputs, state)`), and record those sites' values,
    which leave the scan as the recorders' cotangents (see `record`)."""
    sites = in_tree(session)
    for name in sites:
        if sites[name].origin.blocked:
            raise ValueError(sites[name].origin.blocked)
        if name in session.patches:
            raise ValueError(
                f"Site {name!r} is inside {sites[name].origin.described}: "
                "bridge cannot patch it there. Patch a site outside the "
                "transform, or unroll the layers."
            )
        if session.with_inputs:
            raise ValueError(
                f"with_inputs=True: the inputs of site {name!r}, inside "
                f"{sites[name].origin.described}, cannot be recorded. "
                "Select sites outside the transform with `at=`."
            )

    def shaped(site: Any) -> Any:
        struct = site.value_struct
        if vmap:  # the probe's own vmap: one example here
            struct = jax.tree.map(lambda s: without_axis(s, site.stacked), struct)
        return zeros_like_struct(struct)

    recorders = {name: shaped(site) for name, site in sites.items()}

    def forward(recorders: dict) -> tuple[Any, Any]:
        leaves = {
            name: Leaves(session.epsilons.get(name, zeros), recorders[name])
            for name, zeros in ((n, shaped(s)) for n, s in sites.items())
        }
        outputs, state = call_model(leaves)
        floats = [
            jnp.sum(leaf)
            for leaf in jax.tree.leaves(differentiable_part(outputs))
            if leaf is not None
        ]
        if not floats:
            raise ValueError(
                "bridge records the sites inside jax.lax.scan or "
                "jax.checkpoint through the backward pass of the model's "
                f"outputs, but {model_name} returned no floating-point array."
            )
        # What the session recorded in here must leave `jax.vjp` as outputs.
        recorded = (dict(session.activations), dict(session.inputs))
        return sum(floats, jnp.zeros(())), (outputs, state, recorded)

    total, pullback, (outputs, state, recorded) = jax.vjp(
        forward, recorders, has_aux=True
    )
    session.activations.update(recorded[0])
    session.inputs.update(recorded[1])
    (values,) = pullback(jnp.ones_like(total))
    for name in sites:
        session.record(name, values[name])
    return outputs, state


_SCAN = "scan"
_CHECKPOINT = "checkpoint / remat"


@dataclasses.dataclass(frozen=True)
class InTransform:
    """Where a site lives that takes its epsilon from the tree: `iterations` of
    the enclosing scan (`None` when only a checkpoint encloses it)."""

    iterations: int | None
    transforms: tuple[str, ...]
    #: Why a call there cannot be a site (raised where it is selected).
    blocked: str | None = None

    @property
    def described(self) -> str:
        return describe(self.transforms)


#: The innermost scan over stacked layers now running a sliced wrapper:
#: `(the scan body's trace, iterations)`. A call without parameters of its
#: own (a function field, a parameterless module) inside it is sliced too.
_SLICED: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar(
    "bridge_equinox_sliced", default=None
)


def transforms(base_trace: Any) -> tuple[str, ...]:
    """The transforms between here and the probe's trace, innermost first:
    `vmap` for a `jax.vmap`, otherwise JAX's own name (`scan`, `cond`, ...)."""
    trace = internals.current_trace()
    found = []
    while trace is not base_trace:
        if trace is None:
            # jax < 0.6.2: a jaxpr trace (of scan, checkpoint, cond, ...) does
            # not record the trace it runs in; nothing beyond it can be seen.
            found.append(_PARENT_UNKNOWN)
            break
        found.append(
            "vmap" if internals.is_vmap(trace) else internals.traced_for(trace)
        )
        trace = internals.parent(trace)
    return tuple(found)


#: What `transforms` names past a jaxpr trace of jax < 0.6.2.
_PARENT_UNKNOWN = (
    "a transform whose enclosing trace this jax does not record (bridge sees "
    "through jax.lax.scan and jax.checkpoint from jax 0.6.2)"
)


def describe(transforms: tuple[str, ...]) -> str:
    names = {
        _SCAN: "jax.lax.scan",
        _CHECKPOINT: "jax.checkpoint",
        "vmap": "jax.vmap",
        "jit": "a jax.jit inside the model",
        "cond": "jax.lax.cond",
        "switch": "jax.lax.switch",
        "while_body": "jax.lax.while_loop",
        "while_cond": "jax.lax.while_loop",
        "fori_loop": "jax.lax.fori_loop",
    }
    return " inside ".join(names.get(t, t) for t in transforms)


def iterations(site: Any) -> int | None:
    """L when the wrapper's arrays lost a leading axis of size L (a scan sliced
    them), 0 when they are whole, `None` when it cannot tell (no arrays)."""
    if not site.shapes:
        return None
    module = getattr(site, "module", None)  # a function site has no arrays
    now = () if module is None else param_shapes(module)
    if now == site.shapes:
        return 0
    leading = {shape[:1] for shape in site.shapes}
    if (
        len(now) == len(site.shapes)
        and len(leading) == 1
        and all(n == s[1:] for n, s in zip(now, site.shapes, strict=True))
    ):
        return site.shapes[0][0]
    return None


def call_in_transform(
    context: Any,
    site: Any,
    method: str | None,
    module: Any,
    function: Callable,
    args: tuple,
    kwargs: dict,
) -> Any:
    """A call inside `lax.scan` or `jax.checkpoint`: see the module docstring."""
    session = context.session
    enclosing = transforms(context.base_trace)
    where = describe(enclosing)
    site_path = site.path if method is None else f"{site.path}.{method}"
    unsupported = [t for t in enclosing if t not in (_SCAN, _CHECKPOINT)]
    if unsupported:
        detail = (
            "a jax.vmap of the model's own code inside a scan or checkpoint (an "
            "epsilon in the tree cannot vary along the mapped axis; eqx.nn.MLP "
            "with scan=True maps its activation so: use scan=False)"
            if "vmap" in unsupported
            else f"{describe((unsupported[0],))}"
        )
        raise ValueError(
            f"bridge cannot see through {detail}: site {site_path!r} is called "
            f"inside {where}. bridge sees through jax.lax.scan over stacked layers "
            "and jax.checkpoint; move the call out of the transform, or unroll it."
        )
    if enclosing.count(_SCAN) > 1:
        raise ValueError(
            f"bridge cannot see through nested jax.lax.scan: site {site_path!r} is "
            f"called inside {where}. Scan over one stack of layers at a time."
        )
    count = None
    if _SCAN in enclosing:
        count = iterations(site)
        sliced = _SLICED.get()
        if not count and sliced and sliced[0] is internals.current_trace():
            count = sliced[1]
        if not count:
            blocked = (
                f"bridge cannot see through this jax.lax.scan: site {site_path!r} is "
                "called in every iteration, but the scan does not slice its "
                "parameters (a layer closed over by the scan body, as in an RNN), "
                "so one epsilon would sum the gradients of all iterations. Select "
                "sites outside the scan with `at=`, scan over stacked layers "
                "(eqx.filter_vmap to build them, the scan's xs to slice them), or "
                "unroll the loop."
            )
            return _unreachable(
                session,
                site,
                method,
                module,
                function,
                args,
                kwargs,
                InTransform(None, enclosing, blocked),
            )
    origin = InTransform(count, enclosing)
    call = session.enter(site.path, method, module, args, origin=origin, record=False)
    token = (
        _SLICED.set((internals.current_trace(), count))
        if count and iterations(site)
        else None
    )
    try:
        value = function(*args, **kwargs)
    finally:
        if token is not None:
            _SLICED.reset(token)
    if any(isinstance(leaf, eqx.nn.State) for leaf in _leaves_with_state(value)):
        raise ValueError(
            f"site {site_path!r} is a stateful layer inside {where}: bridge cannot "
            "thread its eqx.nn.State there. Move it out of the transform."
        )
    # The epsilon comes from the tree below, not from the session.
    value = session.exit(call, value, perturb=lambda v: v, record=False)
    if session.discovering:
        if count:
            session.restructure(
                call.name,
                # Broadcast, not zeros: a value varying across shard_map's
                # devices stays varying, and so do its epsilon and recorder.
                jax.tree.map(
                    lambda a: (
                        jnp.broadcast_to(a, (count, *jnp.shape(a)))
                        if eqx.is_array(a)
                        else a
                    ),
                    value,
                ),
            )
        return value
    if call.name not in session.selected:
        return value
    leaves = site.bridge_leaves.get(call.name)
    if leaves is None:
        raise RuntimeError(
            f"bridge found no epsilon for site {call.name!r} inside {where}: the "
            "model called it differently from the discovery pass. This is a bug "
            "in bridge: please report it."
        )
    floats = jax.tree.map(
        lambda v, epsilon, recorder: record(v, recorder) + epsilon,
        differentiable_part(value),
        leaves.epsilon,
        leaves.recorder,
    )
    return merge_differentiable(value, floats)


def _unreachable(session, site, method, module, function, args, kwargs, origin):
    """A call that cannot be a site: listed by discovery, refused where it is
    selected or patched, and otherwise run as it is."""
    call = session.enter(site.path, method, module, args, origin=origin, record=False)
    if not session.discovering and (
        call.name in session.selected or call.name in session.patches
    ):
        raise ValueError(origin.blocked)
    value = function(*args, **kwargs)
    return session.exit(call, value, perturb=lambda v: v, record=False)


def _leaves_with_state(value: Any) -> list:
    return jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, eqx.nn.State))


@jax.custom_vjp
def record(value: Any, recorder: Any) -> Any:
    """`value`; the recorder's cotangent is `value` itself, so the value leaves
    a scan as the gradient of the stacked recorder leaf."""
    del recorder
    return value


def _record_forward(value: Any, recorder: Any) -> tuple[Any, Any]:
    del recorder
    return value, value


def _record_backward(value: Any, cotangent: Any) -> tuple[Any, Any]:
    return cotangent, value


record.defvjp(_record_forward, _record_backward)


def lift(tree: Any, depth: int, observe: Callable[[Any], Any]) -> Any:
    """Hand `tree`, seen inside `depth` vmaps, to `observe` at the probe's trace.

    `observe` gets the full value, mapped axes first, outermost first, and
    returns the value to go on with, of the same structure and shapes.
    """
    leaves, treedef = jax.tree.flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if eqx.is_array(leaf)]

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
    raise RuntimeError(
        "bridge's Equinox site primitive was evaluated outside a jax.vmap. This is "
        "a bug in bridge: please report it."
    )


_lift_p = internals.mapped_primitive(
    "bridge_equinox_site", _lift_batched, _outside_a_vmap
)
