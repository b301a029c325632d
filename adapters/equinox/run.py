"""One run of an Equinox model: a wrapper's call, reported to the probe's
session from where it runs.

The wrappers of the surgery (`bridge.adapters.equinox.surgery`) report each
call here (`observed_call`), and each `bridge.tap` (`tap`), plainly: where
it runs (the model's own `jax.vmap`s, `lax.scan` over stacked layers or
closing over a layer, branches, loops, `jax.checkpoint`) the core reads from
the computation (`bridge._session.computation`), which gives a site its
epsilon, its patch and its recording, or refuses it with the one sentence of
the primitive no rule crosses. One exception: inside Equinox's checkpointed
or bounded while loop (a `custom_vjp`, whose backward pass calls the body
again where the computation does not see it) a call takes the session's
control-flow route, the core's one fallback.
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
import jax.numpy as jnp

from bridge.adapter_api import (
    BOUNDED_WHILE,
    CHECKPOINTED_WHILE,
    ControlFlow,
    Refused,
    Rule,
    Session,
    SiteOrigin,
    Transform,
    blocked,
    current_session,
)

from ..shared import jax_internals
from . import internals, loops


@dataclasses.dataclass(frozen=True)
class Context:
    """The probe's run of the model, as its wrappers see it."""

    session: Session
    base_trace: Any  # the trace the probe runs the model in


CONTEXT: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
    "bridge_equinox", default=None
)


@dataclasses.dataclass(frozen=True)
class VmappedInput(SiteOrigin):
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

    input_axes: tuple[int | None, ...]
    input_ndim: int


def observed_call(
    path: str,
    method: str | None,
    module: Any,
    function: Callable,
    args: tuple,
    kwargs: dict,
) -> Any:
    """`function(*args, **kwargs)`, the call of the wrapper at `path` (its
    `module`'s `method`), reported to the probe's session."""
    context = CONTEXT.get()
    session = current_session()
    if context is None or session is not context.session:
        return function(*args, **kwargs)
    found = _in_equinox_loops(context, path)
    if isinstance(found, ControlFlow):
        return session.call_in_control_flow(
            path, method, module, args, found, lambda: function(*args, **kwargs)
        )
    origin = _vmapped_input(context, args) if found is None else EquinoxLoop(found)
    call = session.enter(path, method, module, args, origin)
    return _report(session, call, function(*args, **kwargs))


@dataclasses.dataclass(frozen=True)
class EquinoxLoop(SiteOrigin):
    """A call inside an Equinox loop or a solve built on one that no route
    reaches: the router's refusal, naming the loop or the solve and the way
    out, which the computation, seeing a `while` or a `custom_vjp`, cannot."""

    refused: Refused

    def refusal_at(self, name: str) -> str:
        return self.refused.at(name)


def _in_equinox_loops(context: Context, path: str) -> ControlFlow | Refused | None:
    """For a call inside Equinox's while loops or the solves built on them
    (read by `internals`): the control-flow route
    inside the checkpointed or bounded kind with `max_steps` (the core's one
    fallback: a `custom_vjp` whose backward pass calls the body again), or
    the router's refusal naming the loop or the solve. `None` elsewhere: the
    call is reported plainly."""
    traces = list(loops.traces(context.base_trace))
    if not traces:
        return None
    names = [loops.name(trace) for trace in traces]
    named = internals.blocking(traces, names)
    flow = loops.control_flow(context.base_trace)
    in_loops = flow is not None and {CHECKPOINTED_WHILE, BOUNDED_WHILE} & set(
        flow.transforms
    )
    if in_loops:
        return flow
    if not named and not internals.running():
        return None
    # JAX's transforms, each Equinox loop's traces named as one.
    transforms = loops.enclosing(context.base_trace)
    blocking = [_blocking(named.get(id(trace), "")) for trace in traces]
    if len(transforms) == len(traces):
        transforms = tuple(
            block or transform
            for block, transform in zip(blocking, transforms, strict=True)
        )
    else:
        # Not read to the probe's trace (a trace past a `custom_jvp`'s
        # function records no parent): the loops and solves named block,
        # then what stands for the rest.
        transforms = (*filter(None, blocking), transforms[-1])
    return blocked(path, transforms)


def _blocking(name: str) -> Transform | None:
    """An Equinox loop or solve `internals.refusal` refuses, as a transform."""
    refused = internals.refusal(name)
    return None if refused is None else Transform(name, Rule.BLOCKS, *refused)


def _vmapped_input(context: Context, args: tuple) -> VmappedInput | None:
    """For a call inside the model's own vmaps (those directly around it),
    how they mapped its first array argument; `None` elsewhere, or where
    that cannot be read."""
    names = loops.transform_names(context.base_trace) or ()
    depth = next((i for i, name in enumerate(names) if name != "vmap"), len(names))
    arrays = [leaf for leaf in jax.tree.leaves(args) if eqx.is_array(leaf)]
    if not depth or not arrays:
        return None
    axes = jax_internals.mapped_dims(arrays[0], jax_internals.current_trace(), depth)
    return None if axes is None else VmappedInput(axes, jnp.ndim(arrays[0]))


#: The wrappers `jax.jit` and `eqx.filter_jit` return, told by the public
#: behaviour of both rather than by their private class names.
JITS = (type(jax.jit(lambda x: x)), type(eqx.filter_jit(lambda x: x)))


def unjitted(module: Any, name: str) -> Callable:
    """`module.name` bound, without the `jax.jit` or `eqx.filter_jit` that
    wraps the method itself (`@eqx.filter_jit def __call__`, as Equinox's
    examples write a model): traced inline, its calls run at the trace of
    their caller. A jit only groups operations for the compiler, with the
    same values: the probe compiles the whole call under the user's
    `jax.jit` anyway."""
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

    leaves, treedef = jax.tree.flatten(value, is_leaf=is_state)
    if not any(is_state(leaf) for leaf in leaves):
        return session.exit(call, value)
    reported = [None if is_state(leaf) else leaf for leaf in leaves]
    returned = session.exit(call, jax.tree.unflatten(treedef, reported))
    returned_leaves = treedef.flatten_up_to(returned)
    merged = [
        leaf if is_state(leaf) else new
        for leaf, new in zip(leaves, returned_leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, merged)


def tap(context: Context, name: str, value: Any) -> Any:
    """`bridge.tap` in the model's code: reported plainly, as a call, except
    inside Equinox's own while loops (see `observed_call`)."""
    session = context.session
    path = session.naming.under_enclosing(name)
    found = _in_equinox_loops(context, path)
    if isinstance(found, ControlFlow):
        return session.call_in_control_flow(path, None, None, (), found, lambda: value)
    if found is None:
        return session.tap_here(name, value)
    return session.exit(session.enter(path, None, None, (), EquinoxLoop(found)), value)
