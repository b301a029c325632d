"""One run of an Equinox model: a wrapper's call, reported to the probe's
session from where it runs.

The wrappers of the surgery (`bridge.adapters.equinox.surgery`) report each
call here (`observed_call`), and the call router decides how it reaches its
site from the transforms around it (`bridge.adapters.equinox.rules`): at
the probe's own trace, inside the model's own `jax.vmap`s and inside JAX's
branches and loops of known bounds it is reported plainly, and the core
reads where it runs from the computation (`bridge._session.computation`);
inside Equinox's checkpointed or bounded while loop (a `custom_vjp`, whose
backward pass the computation does not see) it takes the session's
control-flow route, the core's one fallback; inside `lax.scan` over stacked
layers or `jax.checkpoint` it goes through the tree
(`bridge.adapters.equinox.transforms`); elsewhere it is listed and refused
where selected or patched. `bridge.tap` is routed the same way (`tap`). A
trace is not a call: inside the model's own `jax.eval_shape` a call or a tap
is no site, and a scan body JAX traces twice lists its sites once
(`_a_call_of_the_model`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from bridge.adapter_api import (
    BOUNDED_WHILE,
    CHECKPOINTED_WHILE,
    BridgeValueError,
    Carried,
    ControlFlow,
    Mapped,
    Refused,
    Route,
    Session,
    ThroughControlFlow,
    current_session,
    tapping_a_local,
)

from ..shared import jax_internals
from ..shared.scan_bodies import ScanBodies
from . import jax_transforms, rules, transforms, variables


@dataclasses.dataclass(frozen=True)
class Context:
    """The probe's run of the model, as its wrappers see it."""

    session: Session
    base_trace: Any  # the trace the probe runs the model in
    stop: Any = None  # the Python frame of the probe's call of the model
    # The first trace of each `lax.scan`'s body, by the scan's frame.
    scan_bodies: ScanBodies | None = None


CONTEXT: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
    "bridge_equinox", default=None
)


@dataclasses.dataclass(frozen=True)
class Site:
    """A wrapped submodule at one of its calls: its `path`, its leaves in the
    tree (`bridge.adapters.equinox.variables.Leaves`, per call name), the shapes of
    its arrays as given (`shapes`: a scan slices them) and the plain module
    the call runs on."""

    path: str
    bridge_leaves: dict
    shapes: tuple
    module: Any


def observed_call(
    site: Any,
    method: str | None,
    module: Any,
    function: Callable,
    args: tuple,
    kwargs: dict,
) -> Any:
    """`function(*args, **kwargs)`, the call of a wrapper `site` (its
    `module`'s `method`), reported to the probe's session by the route the
    router gives it (`bridge.adapters.equinox.rules`)."""
    context = CONTEXT.get()
    session = current_session()
    if context is None or session is not context.session:
        return function(*args, **kwargs)
    path = site.path
    enclosing = rules.enclosing(context.base_trace)
    found = enclosing.route(path if method is None else f"{path}.{method}")
    if not _a_call(context, enclosing, found):
        return function(*args, **kwargs)
    match found:
        case ThroughControlFlow(flow) if _in_equinox_loops(flow):
            # Equinox's own while loops run a `custom_vjp`, whose backward
            # pass the computation does not see: the core's one fallback.
            return session.call_in_control_flow(
                path, method, module, args, flow, lambda: function(*args, **kwargs)
            )
        case Mapped(depth):
            # The model's own vmaps: reported plainly, the core reads them from
            # the computation; the origin says how the inputs were mapped
            # (for `compare`).
            call = session.enter(
                path, method, module, args, jax_transforms.mapped_origin(args, depth)
            )
            return _report(session, call, function(*args, **kwargs))
        case Carried():
            return transforms.call_in_transform(
                context, site, method, module, function, args, kwargs, enclosing, found
            )
        case Refused() as refused:
            return transforms.refused(
                context,
                site,
                method,
                module,
                function,
                args,
                kwargs,
                enclosing,
                refused,
            )
        case _:
            # At the probe's trace, in JAX's branches and loops of known
            # bounds, in the model's own vmaps: reported plainly, the core
            # reads where from the computation.
            call = session.enter(path, method, module, args)
            return _report(session, call, function(*args, **kwargs))


def _in_equinox_loops(flow: ControlFlow) -> bool:
    """Whether Equinox's checkpointed or bounded while loop is among the loops
    around a call (read by the router: `bridge.adapters.shared.equinox_loops`)."""
    return bool({CHECKPOINTED_WHILE, BOUNDED_WHILE} & set(flow.transforms))


def _a_call(context: Context, enclosing: rules.Enclosing, found: Route) -> bool:
    """Whether a call or a tap `found` routed inside `enclosing` is a call of
    the model's: at the probe's trace or inside the model's own vmaps only it
    is; inside another transform, see `_a_call_of_the_model`."""
    if not enclosing.transforms or isinstance(found, Mapped):
        return True
    return _a_call_of_the_model(context)


def _a_call_of_the_model(context: Context) -> bool:
    """For a call or a tap inside a transform of the model's own code: whether
    it is a call of the model's. Not inside the model's own `jax.eval_shape`
    (diffrax's of its vector field), a pass that learns shapes and whose
    values JAX discards. Inside a `lax.scan` body that JAX traces again (its
    carry changes type), the calls of the body's first trace are forgotten
    here (`ScanBodies`): a trace is not a call, so each is one site, never
    a phantom `#1`."""
    if jax_internals.in_a_shape_pass(context.stop):
        return False
    if context.scan_bodies is not None:
        context.scan_bodies.traced()
    return True


#: The wrappers `jax.jit` and `eqx.filter_jit` return, told by the public
#: behaviour of both rather than by their private class names.
JITS = (type(jax.jit(lambda x: x)), type(eqx.filter_jit(lambda x: x)))


def unjitted(module: Any, name: str) -> Callable:
    """`module.name` bound, without the `jax.jit` or `eqx.filter_jit` that
    wraps the method itself (`@eqx.filter_jit def __call__`, as Equinox's
    examples write a model): traced inline, its calls run at the trace of
    their caller, where their values can be handed out; jitted, they would
    run in a jaxpr trace of their own, which no value leaves. A jit only
    groups operations for the compiler, with the same values: the probe
    compiles the whole call under the user's `jax.jit` anyway. A jit called
    elsewhere in the model's code stays, its sites refused where selected."""
    method = inspect.getattr_static(type(module), name, None)
    if isinstance(method, JITS) and callable(getattr(method, "__wrapped__", None)):
        return functools.partial(method.__wrapped__, module)
    return getattr(module, name)


def _report(session: Session, call: Any, value: Any) -> Any:
    """`session.exit`, leaving out any `eqx.nn.State` or module in the value
    (no activation: a stateful layer returns `(x, state)`, and the site is
    `(x, None)`; a method that returns a module returns its parameters)."""

    def is_state(x: Any) -> bool:
        return isinstance(x, eqx.nn.State | eqx.Module)

    def exit(value: Any) -> Any:
        return variables.through_patch(
            session, call.name, value, session.exit(call, value)
        )

    leaves, treedef = jax.tree.flatten(value, is_leaf=is_state)
    if not any(is_state(leaf) for leaf in leaves):
        return exit(value)
    reported = [None if is_state(leaf) else leaf for leaf in leaves]
    returned = exit(jax.tree.unflatten(treedef, reported))
    returned_leaves = treedef.flatten_up_to(returned)
    merged = [
        leaf if is_state(leaf) else new
        for leaf, new in zip(leaves, returned_leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, merged)


def tap(context: Context, name: str, value: Any) -> Any:
    """`bridge.tap` in the model's code, by the route the router gives it
    with `rules.for_a_tap`: a site at the probe's trace, handed out of the
    model's own vmaps, or of the session's control-flow route; listed with
    the shape its value has for the model, run as it is and refused where
    selected or patched elsewhere (a tap has no leaves in the tree that carry
    a module call's value out of a scan or a checkpoint)."""
    session = context.session
    enclosing = rules.enclosing(context.base_trace, TAP_RULES)
    path = session.naming.under_enclosing(name)
    found = enclosing.route(path)
    if not _a_call(context, enclosing, found):
        return value
    if tapping_a_local() and not isinstance(found, Mapped) and enclosing.transforms:
        # A local of the probe's `inside=`: the core lists it and says so.
        raise BridgeValueError(
            f"bridge.tap({name!r}) is inside "
            f"{jax_transforms.describe(enclosing.names)}, where bridge cannot see "
            "a tap."
        )
    match found:
        case ThroughControlFlow(flow) if _in_equinox_loops(flow):
            return session.call_in_control_flow(
                path, None, None, (), flow, lambda: value
            )
        case Refused() as refused:
            return jax_transforms.unreachable(
                session,
                _TapSite(path),
                None,
                None,
                lambda: value,
                (),
                {},
                variables.InTransform(None, enclosing.names),
                refused,
                jax_transforms.whole_axes(enclosing.names, None),
            )
        case _:  # reported plainly, as a call
            return session.tap_here(name, value)


#: The rules a `bridge.tap` is routed by.
TAP_RULES = rules.for_a_tap(rules.RULES)


@dataclasses.dataclass(frozen=True)
class _TapSite:
    """A `bridge.tap` as `jax_transforms.unreachable` takes a call: its path,
    and no module."""

    path: str
    module: Any = None
