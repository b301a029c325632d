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
autodiff sees ordinary operations (`mapped`, through
`bridge.adapters.shared.lifting.lift`, shared with the Linen and NNX
adapters).

Which route a call takes, the call router decides
(`bridge.adapters.haiku.transforms.route`): inside branches and loops of
static bounds only (`lax.cond`, `lax.switch`, `lax.fori_loop`), the session's
control-flow route; inside any other transform of JAX's (a `lax.scan`,
`jax.checkpoint`, a `while_loop`, ...), where no value can leave and no
epsilon can enter, the site is listed with the shape its value has for the
model and refused where selected or patched, with the router's sentence.

The trace stack is read through `bridge.adapters.shared.jax_internals`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from bridge.adapter_api import Session, SiteOrigin, is_array

from ..shared.lifting import lift


def mapped(
    session: Session,
    run: Callable[[], Any],
    call_args: tuple,
    module: Any,
    method: str,
    name: str,
    origin: SiteOrigin,
    depth: int,
) -> Any:
    """The call `run()` inside `depth` of the model's own `jax.vmap`s: a
    site at the probe's trace, its value (and inputs) handed out whole,
    mapped axes first (`lift`); the session adds its epsilon and patch
    there."""
    entered = []

    def enter(full_args: tuple) -> tuple:
        entered.append(
            session.enter(
                name,
                None if method == "__call__" else method,
                module,
                full_args,
                origin=origin,
            )
        )
        return full_args

    if session.with_inputs and any(map(is_array, jax.tree.leaves(call_args))):
        # Inputs are recorded at the probe's trace too, mapped axes first.
        lift(call_args, depth, enter)
    else:
        enter(())
    (call,) = entered
    value = run()
    if not session.recorder.needs_value(call.name):
        return session.exit(call, value)  # bookkeeping only
    return lift(value, depth, lambda full: session.exit(call, full))
