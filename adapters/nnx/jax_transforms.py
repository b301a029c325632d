"""NNX sites inside JAX's own transforms in the model's code (`jax.vmap`,
`jax.checkpoint`, `lax.scan`, `lax.cond`, ...), which carry none of bridge's
variables on the module: a module closed over keeps its object, a module
passed as an argument is a pytree copy, and neither is an NNX transform's.

Inside the model's own `jax.vmap`s a call sees one example, yet the site
holds every example, mapped axes first, outermost first (the contract's
layout), with per-example gradients. The value is handed out whole through a
private primitive whose batching rule is the only code that sees it whole: at
each enclosing `vmap` the rule moves that vmap's axis to the front
(broadcasting a value that does not vary along it) and passes it one trace
out, until it reaches the probe's own trace. There the session takes it as
any site's value (epsilon, patch, recording), and the rule hands the result
back in, mapped along axis 0 at every level
(`bridge.adapters.shared.lifting.lift`, as the other adapters do). No tracer
leaves its trace, and autodiff sees ordinary operations.

Which of these a call takes is the call router's
(`bridge.adapter_api.route`), over JAX's transforms around it and NNX's
rules for them (`bridge.adapters.nnx.rules`). Inside branches and loops of
static bounds only (`lax.cond`, `lax.switch`, `lax.fori_loop`), a call is a
site of the session's control-flow route (`run.Run.off_route`). Inside any
other transform of JAX's (a `lax.scan`, `jax.checkpoint`, a `while_loop`,
...) no value can leave and no epsilon can enter: the site is listed with
the shape its value has for the model and refused where selected or
patched, with the router's sentence; a `lax.scan` body JAX traces twice
lists its sites once (`bridge.adapters.shared.scan_bodies`). A `jax.jit` is
traced through: while a probe runs, the model's own jits run inline, in the
probe's trace. `plain_call` is a call outside NNX's own transforms, the
sites inside those are `bridge.adapters.nnx.transforms`.

The trace stack is read through `bridge.adapters.shared.jax_internals`.
"""

from __future__ import annotations

from bridge.adapter_api import Mapped, Refused, Session, ThroughControlFlow

from ..shared import lifting
from . import internals, rules
from .variables import PATH_ATTRIBUTE, Origin


def plain_call(run, module, site_method, method, args, kwargs, session: Session, path):
    """A call outside NNX's transforms (but `nnx.jit`) in `run` (a `run.Run`),
    as the router takes it through JAX's: a site of the session's own where
    it runs in the probe's trace, handed out whole from inside the model's
    own `jax.vmap`s, the control-flow route inside branches and loops of
    static bounds, else listed and refused."""
    if run.in_a_shape_pass():  # no call of the model's: not a site
        return method(module, *args, **kwargs)
    found = run.route(path)
    if isinstance(found, Refused) and (
        vars(module).get(PATH_ATTRIBUTE) is not None
        and run.ids.get(id(module)) is None
        and internals.in_transform_code(run.stop)
    ):
        # Where no NNX transform has pushed its update context, code of one
        # running now runs in tree mode (`graph=False`, `graph_updates=False`),
        # the module a pytree of its own.
        found = rules.in_tree_mode(path)
    match found:
        case Refused() | ThroughControlFlow():
            return run.off_route(
                found, module, site_method, method, args, kwargs, session, path
            )
        case Mapped(depth):
            return _handed_out(
                module, site_method, method, args, kwargs, session, path, depth
            )
    call = session.enter(path, site_method, module, args, origin=Origin(path))
    return session.exit(call, method(module, *args, **kwargs))


def _handed_out(module, site_method, method, args, kwargs, session, path, depth):
    """A call inside `depth` of the model's own `jax.vmap`s only: its value
    (and its inputs) handed out whole to the probe's trace, mapped axes
    first."""
    origin = Origin(path)
    entered = []

    def enter(full_args: tuple) -> tuple:
        entered.append(session.enter(path, site_method, module, full_args, origin))
        return full_args

    if session.with_inputs:
        # Inputs are recorded at the probe's trace too, mapped axes first.
        lifting.lift(args, depth, enter)
    else:
        enter(())
    (call,) = entered
    value = method(module, *args, **kwargs)
    if not session.recorder.needs_value(call.name):
        return session.exit(call, value)
    return lifting.lift(value, depth, lambda full: session.exit(call, full))
