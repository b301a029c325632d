"""Equinox sites inside `lax.scan` over stacked layers and `jax.checkpoint`:
the transforms of the model's own code that carry its tree, and so bridge's
leaves in it (`bridge.adapters.equinox.variables`).

Inside `lax.scan` over stacked layers (`eqx.filter_vmap` builds them, the scan
slices them per step, directly or after `eqx.partition`) and inside
`jax.checkpoint` / `eqx.filter_checkpoint`, no value can be handed out: the
epsilon lives in the tree instead (the design's tree surgery). Discovery finds
these calls and their iterations (a wrapper whose parameters lost a leading
axis of size L was sliced by the scan: `iterations`); a run takes each call's
epsilon and patch value from its leaves and records through them
(`call_in_transform`).

A layer the scan body applies per token with the model's own `jax.vmap`
(`jax.vmap(self.linear)(x)` in a scanned block) sees one token, yet its
site holds every token: its value is handed out of those vmaps to the
body's trace whole, mapped axes first (`jax_transforms.lift`), and there it
is patched, recorded and perturbed with the call's leaves as a call in the
body itself is (`_call_mapped`). The site is `(iterations, *mapped axes,
*value)`, and with `vmap=True` the probe's batch axis after the iterations.

The router decides which calls come here (`bridge.adapters.equinox.rules`):
a branch (`lax.cond`, `lax.switch`) inside such a scan is carried the same
way, its recorder of where it ran sliced per iteration (`ProbeResult.ran`).
A call it refuses (`refused`), and a layer the scan body closes over rather
than slices (refused here, in the router's words), is listed, and raises the
sentence naming the transform where it is selected or patched
(`bridge.adapters.equinox.jax_transforms.unreachable`): a site is never
silently missing or summed over iterations, nor does it block the others.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from bridge.adapter_api import (
    BridgeRuntimeError,
    BridgeValueError,
    Carried,
    Refused,
    Rule,
    Session,
    ThroughControlFlow,
    Transform,
    positional_arrays,
)

from ..shared import jax_internals
from .jax_transforms import describe, lift, unreachable, whole_axes
from .rules import SCAN, Enclosing, scanned
from .variables import (
    InTransform,
    Leaves,
    as_floats,
    inputs_origin,
    param_shapes,
    through_patch,
    through_tree,
)

# -- inside lax.scan and jax.checkpoint: epsilons, patches, recorders in the tree --


#: The innermost scan over stacked layers now running a sliced wrapper:
#: `(the scan body's trace, iterations)`. A call without parameters of its
#: own (a function field, a parameterless module) inside it is sliced too.
_SLICED: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar(
    "bridge_equinox_sliced", default=None
)


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
    enclosing: Enclosing,
    carried: Carried,
) -> Any:
    """A call the router carries through `lax.scan` or `jax.checkpoint`
    (`carried`), perhaps inside the model's own `jax.vmap`s there: see the
    module docstring. A layer the scan closes over rather than slices is
    `_closed_over`."""
    session = context.session
    depth = carried.depth
    names = enclosing.names
    count = None
    if scanned(carried):
        count = _count(site, depth)
        if not count:
            return _closed_over(
                context, site, method, module, function, args, kwargs, enclosing
            )
    if depth:
        return _call_mapped(
            session, site, method, module, function, args, kwargs, count, depth, names
        )
    # How the inputs are recorded is learnt once, with the site.
    learnt = inputs_origin(args, count) if session.recorder.learns_sites() else {}
    origin = InTransform(count, names, **learnt)
    call = session.enter(site.path, method, module, args, origin=origin, record=False)
    site_path = site.path if method is None else f"{site.path}.{method}"
    value = _run_sliced(site, count, 0, site_path, names, function, args, kwargs)
    leaves = site.bridge_leaves.get(call.name)
    # The patch value and the epsilon come from the tree, not from the session.
    value = _exit(session, call, value, None if leaves is None else leaves.patch)
    if count:
        session.recorder.holds_iterations(call.name, value, count)
    if call.name not in session.selected:
        return value
    _check_leaves(call.name, leaves, names)
    inputs = None
    if leaves.inputs is not None:
        inputs = jax.tree.map(as_floats, positional_arrays(args))
    return through_tree(value, inputs, leaves)


def _closed_over(
    context: Any,
    site: Any,
    method: str | None,
    module: Any,
    function: Callable,
    args: tuple,
    kwargs: dict,
    enclosing: Enclosing,
) -> Any:
    """A call a scan closes over rather than slices: the model's own scan
    counts its iterations (`COUNTED_SCAN`), so the call is one in a loop of
    known bounds, each iteration's epsilon taken by the counter; otherwise
    (a scan called by a name bound before the probe ran) refused, as one
    epsilon would serve every iteration."""
    session = context.session
    site_path = site.path if method is None else f"{site.path}.{method}"
    refused = enclosing.replaced(_not_sliced(site)).route(site_path)
    counted = enclosing.counted()
    if counted.transforms != enclosing.transforms:
        match counted.route(site_path):
            case ThroughControlFlow(flow):
                return session.call_in_control_flow(
                    site.path,
                    method,
                    module,
                    args,
                    flow,
                    lambda: function(*args, **kwargs),
                )
            case Refused() as again:
                refused = again
    return unreachable(
        session,
        site,
        method,
        module,
        function,
        args,
        kwargs,
        InTransform(None, enclosing.names),
        refused,
        whole_axes(enclosing.names, None),
    )


def refused(
    context: Any,
    site: Any,
    method: str | None,
    module: Any,
    function: Callable,
    args: tuple,
    kwargs: dict,
    enclosing: Enclosing,
    refused: Refused,
) -> Any:
    """A call the router `refused` inside `enclosing`, listed with the shape
    its value has for the model (a scan slicing it gives its iterations) and
    run as it is (`unreachable`)."""
    vmaps = next(
        (i for i, t in enumerate(enclosing.transforms) if t.rule is not Rule.MAPS), 0
    )
    return unreachable(
        context.session,
        site,
        method,
        module,
        function,
        args,
        kwargs,
        InTransform(None, enclosing.names),
        refused,
        whole_axes(enclosing.names, _count(site, vmaps)),
    )


def _call_mapped(
    session: Session,
    site: Any,
    method: str | None,
    module: Any,
    function: Callable,
    args: tuple,
    kwargs: dict,
    count: int | None,
    depth: int,
    names: tuple[str, ...],
) -> Any:
    """A call `depth` vmaps of the model's own code deep inside a scan or
    checkpoint (`jax.vmap(self.linear)(x)` in a scanned layer): the value is
    handed out of the vmaps to the body's trace whole, mapped axes first
    (`transforms.lift`), and there it is patched, recorded and perturbed with
    the call's leaves from the tree, as a call in the body itself is: one
    iteration's row holds every token."""
    if session.recorder.learns_sites():
        # How the inputs are recorded, learnt once, whole like the value.
        learnt: list = []
        arrays = positional_arrays(args)
        if jax.tree.leaves(arrays):
            lift(arrays, depth, lambda full: learnt.append(full) or full)
        origin = InTransform(
            count, names, **inputs_origin(learnt[0] if learnt else arrays, count)
        )
    else:
        origin = InTransform(count, names)
    call = session.enter(site.path, method, module, args, origin=origin, record=False)
    site_path = site.path if method is None else f"{site.path}.{method}"
    value = _run_sliced(site, count, depth, site_path, names, function, args, kwargs)
    if not session.recorder.needs_value(call.name):
        return _exit(session, call, value, None)  # nothing to see: no cost
    leaves = site.bridge_leaves.get(call.name)
    selected = call.name in session.selected
    if selected:
        _check_leaves(call.name, leaves, names)
    inputs = positional_arrays(args) if selected and leaves.inputs is not None else None

    def observe(full: tuple, extra: Any) -> tuple:
        whole, whole_inputs = full
        patch = None if extra is None else extra.patch
        whole = _exit(session, call, whole, patch)
        if count:
            session.recorder.holds_iterations(call.name, whole, count)
        if not selected:
            return whole, whole_inputs
        floats = None
        if whole_inputs is not None:
            floats = jax.tree.map(as_floats, whole_inputs)
        return through_tree(whole, floats, extra), whole_inputs

    value, _ = lift(
        (value, inputs),
        depth,
        observe,
        extra=leaves if leaves is not None else Leaves(),
    )
    return value


def _run_sliced(
    site: Any,
    count: int | None,
    depth: int,
    site_path: str,
    names: tuple[str, ...],
    function: Callable,
    args: tuple,
    kwargs: dict,
) -> Any:
    """`function(*args, **kwargs)`; a call without parameters of its own made
    from inside it is sliced by the same scan (see `_SLICED`)."""
    token = (
        _SLICED.set((_body_trace(depth), count)) if count and iterations(site) else None
    )
    try:
        value = function(*args, **kwargs)
    finally:
        if token is not None:
            _SLICED.reset(token)
    if any(isinstance(leaf, eqx.nn.State) for leaf in _leaves_with_state(value)):
        raise BridgeValueError(
            f"site {site_path!r} is a stateful layer inside {describe(names)}: "
            "bridge cannot thread its eqx.nn.State there. Move it out of the "
            "transform."
        )
    return value


def _check_leaves(name: str, leaves: Any, names: tuple[str, ...]) -> None:
    if leaves is None or (leaves.recorder is None and leaves.epsilon is None):
        raise BridgeRuntimeError(
            f"bridge found no epsilon for site {name!r} inside "
            f"{describe(names)}: the model called it differently from the "
            "discovery pass. This is a bug in bridge: please report it."
        )


def _body_trace(depth: int) -> Any:
    """The trace `depth` vmaps out from here: the scan or checkpoint body."""
    trace = jax_internals.current_trace()
    for _ in range(depth):
        trace = jax_internals.parent(trace)
    return trace


def _count(site: Any, depth: int = 0) -> int | None:
    """The iterations of the scan slicing this call (see `_SLICED`), `depth`
    vmaps of the model's own code inside the scan body."""
    count = iterations(site)
    sliced = _SLICED.get()
    if not count and sliced and sliced[0] is _body_trace(depth):
        count = sliced[1]
    return count


def _not_sliced(site: Any) -> Transform:
    """The scan around a call in every iteration that it does not slice, as a
    refusal names it: one epsilon would sum the gradients of all iterations."""
    function = getattr(site, "module", None) is None
    return Transform(
        SCAN.name,
        Rule.BLOCKS,
        "it is called in every iteration, but the scan does not slice its "
        "parameters (a layer closed over by the scan body, as in an RNN), so "
        "one epsilon would sum the gradients of all iterations",
        "scan over stacked layers (eqx.filter_vmap to build them, the scan's xs "
        "to slice them), or unroll the loop"
        + (
            " (eqx.nn.MLP(scan=True) applies its activation so: use scan=False)"
            if function
            else ""
        ),
    )


def _exit(session: Session, call: Any, value: Any, patch: Any) -> Any:
    """`session.exit` for a call whose epsilon the caller adds, patched with
    `patch`, the patch value's leaf in the tree: one iteration's row of a
    stacked patch inside a scan. Without it, the session's own patch applies
    (a patch function, to this iteration's value)."""
    patched = session.exit(call, value, perturb=lambda v: v, record=False, patch=patch)
    return through_patch(session, call.name, value, patched)


def _leaves_with_state(value: Any) -> list:
    return jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, eqx.nn.State))
