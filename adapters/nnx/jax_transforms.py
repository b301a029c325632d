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

Inside branches and loops of static bounds only (`lax.cond`, `lax.switch`,
`lax.fori_loop`), a call is a site of the session's control-flow route
(`run.Run.listed`). Inside any other transform of JAX's (a `lax.scan`,
`jax.checkpoint`, a `while_loop`, ...) no value can leave and no epsilon can
enter: the site is
listed with the shape its value has for the model and refused where selected
or patched, naming the innermost such transform (`around`, `REFUSALS`); a
`lax.scan` body JAX traces twice lists its sites once
(`bridge.adapters.shared.scan_bodies`). A `jax.jit` is none: while a probe
runs, the model's own jits run inline, in the probe's trace. `plain_call` is a
call outside NNX's own transforms, the sites inside those are
`bridge.adapters.nnx.transforms`.

The trace stack is read through `bridge.adapters.shared.jax_internals`.
"""

from __future__ import annotations

from bridge.adapter_api import (
    BRANCH,
    TRACED_BOUNDS,
    TRACED_BOUNDS_FIX,
    UNBOUNDED_LOOP,
    Session,
)

from ..shared import jax_internals, lifting, unexpressible
from . import internals
from .transforms import TREE_MODE
from .variables import PATH_ATTRIBUTE, Origin

#: Why a site inside each JAX transform cannot be expressed, and what to do.
REFUSALS = {
    "jax.lax.scan": (
        "bridge's variables on the module do not ride through a jax.lax.scan "
        "of the model's own code, so no epsilon can enter and no value leave "
        "it per iteration",
        "write the loop as an nnx.scan over stacked layers",
    ),
    "jax.lax.fori_loop": (
        "bridge's variables on the module do not ride through a "
        "jax.lax.fori_loop of the model's own code, so no epsilon can enter "
        "and no value leave it per iteration",
        "write the loop as an nnx.scan over stacked layers",
    ),
    "jax.checkpoint": (
        "bridge's variables on the module do not ride through a "
        "jax.checkpoint of the model's own code, so no epsilon can enter and "
        "no value leave it",
        "rematerialise with nnx.remat, which carries them",
    ),
    "jax.lax.cond": (BRANCH, "compute both branches and pick with jnp.where"),
    "jax.lax.switch": (BRANCH, "compute every branch and pick with jnp.where"),
    "jax.lax.while_loop": (
        UNBOUNDED_LOOP,
        "write the loop as an nnx.scan of fixed length",
    ),
    jax_internals.TRANSFORM_NAMES[jax_internals.FORI_LOOP_TRACED]: (
        TRACED_BOUNDS,
        TRACED_BOUNDS_FIX,
    ),
}


def why(transform: str) -> tuple[str, str, str]:
    """`(transform, reason, fix)` of a call refused inside `transform`."""
    reason, fix = REFUSALS.get(
        transform,
        (
            "bridge's variables on the module do not ride through it, so no "
            "epsilon can enter and no value leave it",
            "move the call out of it",
        ),
    )
    return transform, reason, fix


def plain_call(run, module, site_method, method, args, kwargs, session: Session, path):
    """A call outside NNX's transforms (but `nnx.jit`) in `run` (a `run.Run`):
    a site of the session's own where it runs in the probe's trace, handed
    out whole from inside the model's own `jax.vmap`s, listed and refused
    inside JAX's other transforms."""
    depth, blocker = unexpressible.vmaps_or_blocker(run.base)
    if blocker is not None:
        # Where no NNX transform has pushed its update context, code of one
        # running now runs in tree mode (`graph=False`, `graph_updates=False`),
        # the module a pytree of its own.
        if vars(module).get(PATH_ATTRIBUTE) is not None and (
            run.ids.get(id(module)) is None and internals.in_transform_code(run.stop)
        ):
            reason = TREE_MODE
        else:
            reason = why(blocker)
        return run.listed(
            module, site_method, method, args, kwargs, session, path, reason
        )
    origin = Origin(path)
    if depth == 0:
        call = session.enter(path, site_method, module, args, origin=origin)
        return session.exit(call, method(module, *args, **kwargs))
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
