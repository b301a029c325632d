"""Haiku sites inside transforms: the route of a call, decided by the call
router (`bridge.adapter_api.route`) from the rules of the transforms around it
(`RULES`, `route`), and how a call inside Haiku's lifted transforms is carried.

`hk.experimental.layer_stack`, `hk.scan`, `hk.remat` (and `hk.jit`) carry:
they thread Haiku state, where a site's epsilon, patch value and recording
ride (`bridge.adapters.haiku.variables`). A layer stack slices state per layer
going in and stacks it coming out, so its sites hold every layer; `hk.remat`
threads it through; `hk.scan` carries it, so the carry holds the whole
stacked epsilon and recording and a step counter picks the iteration's row
(`scanned`). A tap there is a site of the module calling it. Transforms that
carry state as one value for every iteration or example (`hk.vmap`, a user's
`hk.lift`, ...) block, and so do Haiku's loops and branches, but where the
JAX loops and branches they run take the control-flow route (`route`).

A layer stack's and `hk.scan`'s own `jax.lax.scan` counts its iterations
while a probe runs (`count_scans_of`): where their state does not carry a
call in their body (a branch, a `fori_loop` or the model's own `lax.scan`
there, or an `hk.scan` nested in another or in a layer stack), the scan is
a loop of known bounds around it and the call takes the control-flow route,
a site per layer or iteration (`route`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import haiku as hk
import jax

from bridge.adapter_api import (
    BRANCH,
    COUNTED_SCAN,
    TRACED_BOUNDS,
    TRACED_BOUNDS_FIX,
    UNBOUNDED_LOOP,
    Refused,
    Route,
    Rule,
    Session,
    ThroughControlFlow,
    Transform,
    add_epsilon,
    carrier_name,
    count_scans_of,
    differentiable_part,
    positional_arrays,
)
from bridge.adapter_api import route as routing_route

from ..shared import jax_internals, unexpressible
from . import internals
from .variables import Origin, patch_from_state

_SHARED_CARRY = (
    "Haiku's state there is one carry for nested scans (or for a scan inside a "
    "layer stack), where bridge cannot pick one iteration's row",
    "scan one level deep, or stack layers with hk.experimental.layer_stack",
)
_WHILE_LOOP_FIX = "write the loop as hk.scan of fixed length"

#: The rules of Haiku's transforms (as `internals.enclosing` names them), and
#: of JAX's where Haiku's way out is not `JAX_RULES`'s: JAX's own transforms
#: in the model's code, which Haiku's state does not thread.
RULES: dict[str, Transform] = {
    name: Transform(name, Rule.CARRIES)
    for name in (internals.LAYER_STACK, internals.SCAN, internals.THREADS_STATE)
} | {
    internals.SHARED_SCAN: Transform(internals.SCAN, Rule.BLOCKS, *_SHARED_CARRY),
    "hk.vmap": Transform(
        "hk.vmap",
        Rule.BLOCKS,
        "Haiku carries state through hk.vmap as one value for every mapped "
        "example, so one epsilon would serve them all and their gradients "
        "would be summed",
        "probe the unmapped function with bridge.probe(..., vmap=True)",
    ),
    # One of static bounds runs JAX's, whose reading finds the control-flow
    # route (`route`).
    "hk.fori_loop": Transform(
        "hk.fori_loop", Rule.BLOCKS, TRACED_BOUNDS, TRACED_BOUNDS_FIX
    ),
    "hk.while_loop": Transform(
        "hk.while_loop", Rule.BLOCKS, UNBOUNDED_LOOP, _WHILE_LOOP_FIX
    ),
    "hk.cond": Transform(
        "hk.cond", Rule.BLOCKS, BRANCH, "compute both branches and pick with jnp.where"
    ),
    "hk.switch": Transform(
        "hk.switch", Rule.BLOCKS, BRANCH, "compute every branch and pick with jnp.where"
    ),
    "hk.grad": Transform("hk.grad", Rule.BLOCKS),
    "hk.value_and_grad": Transform("hk.value_and_grad", Rule.BLOCKS),
    internals.LIFT: Transform(
        internals.LIFT,
        Rule.BLOCKS,
        "an inner transform the model lifts keeps state of its own, which "
        "bridge's does not reach",
        "probe the lifted function on its own",
    ),
    "scan": Transform(
        "jax.lax.scan",
        Rule.BLOCKS,
        "Haiku state does not reach inside a jax.lax.scan of the model's own "
        "code, so no epsilon can enter and no value leave it per iteration",
        "write the loop as hk.scan, or stack layers with hk.experimental.layer_stack",
    ),
    "while_body": Transform(
        "jax.lax.while_loop", Rule.BLOCKS, UNBOUNDED_LOOP, _WHILE_LOOP_FIX
    ),
    "checkpoint / remat": Transform(
        "jax.checkpoint",
        Rule.BLOCKS,
        "Haiku state does not reach inside a jax.checkpoint of the model's own "
        "code, so no epsilon can enter and no value leave it",
        "rematerialise with hk.remat, which threads Haiku state",
    ),
}
RULES |= {
    "while_cond": RULES["while_body"],
    "checkpoint": RULES["checkpoint / remat"],  # jax < 0.5
}


def route(
    site: str, where: internals.Enclosing, base: Any, module: Any = None
) -> Route:
    """The router's route of a call at `site`, from two readings that do not
    merge into one: JAX's transforms between here and `base` (the trace of
    the probe's `apply`), and Haiku's, read off the Python call stack
    (`where`), whose own JAX transforms (a layer stack's scan, `hk.remat`'s
    checkpoint) JAX's reading sees too. JAX's decides where Haiku's are none,
    and where it finds branches and loops of known bounds only (those of
    `hk.cond`, `hk.switch` and `hk.fori_loop` among them); Haiku's elsewhere,
    with JAX's inside the body of Haiku's innermost, whose trace the
    `module`'s parameters there belong to.

    The scans of a layer stack and of `hk.scan` count their iterations while
    a probe runs (`count_scans_of`), so JAX's reading takes them for loops
    of known bounds. Where they are JAX's only loops around the call and
    Haiku's state carries it, Haiku's route stands, as it did before they
    counted; where it does not (a branch or a loop in their body, or a
    stack in the model's own loop), JAX's: the call is one in loops of
    known bounds, a site per layer or iteration."""
    found = unexpressible.route(site, base, RULES)
    if not where.transforms:
        return found
    if isinstance(found, ThroughControlFlow):
        loops = unexpressible.enclosing(base, RULES)
        if sum(t.rule is not Rule.THROUGH for t in loops) > where.scans:
            # A branch or loop of JAX's besides Haiku's scans, in the body of
            # Haiku's innermost or around one of them (a layer stack in the
            # model's own lax.scan), where Haiku's state does not reach.
            return found
    haiku = [RULES[name] for name in where.transforms]
    body = _BODIES.get(where.transforms[0])
    if body is not None:
        # JAX's own transforms inside the body of Haiku's innermost (a
        # `lax.cond` in a layer stack's): the router weighs them too.
        trace = _body_trace(where, module)
        inside = unexpressible.within(base, RULES, body, trace)
        current = jax_internals.current_trace()
        if not inside and trace is not None and trace is not current:
            # A trace of JAX's between the call and the body, which this jax
            # does not read back to the body (< 0.6.2): the innermost, which
            # it reads, stands for them.
            inside = unexpressible.enclosing(base, RULES)[:1]
        haiku = [*inside, *haiku]
    carried = routing_route(site, haiku)
    if isinstance(found, ThroughControlFlow) and isinstance(carried, Refused):
        return found
    return carried


# Haiku's scans count their iterations while a probe runs.
for _module in internals.SCAN_MODULES:
    count_scans_of(_module)


def _body_trace(where: internals.Enclosing, module: Any) -> Any:
    """The trace the body of Haiku's innermost transform around the call
    runs in, where it is a layer stack's or `hk.scan`'s (`None` for
    `hk.remat`'s, found by JAX's name): a layer stack slices the `module`'s
    parameters there; else the trace of the scan's counter or carry."""
    innermost = where.transforms[0]
    if innermost == internals.LAYER_STACK:
        if module is not None:
            for value in internals.module_params(module):
                trace = jax_internals.trace_of(value)
                if trace is not None:
                    return trace
        return internals.body_trace(where.body) if where.body is not None else None
    if innermost == internals.SCAN and where.scan_body is not None:
        return internals.body_trace(where.scan_body)
    return None


#: JAX's names of the traces Haiku's carrying transforms run their bodies
#: in (`unexpressible.within`).
_BODIES = {
    internals.LAYER_STACK: frozenset({"scan", COUNTED_SCAN}),
    internals.SCAN: frozenset({"scan", COUNTED_SCAN}),
    internals.THREADS_STATE: frozenset(
        {"checkpoint / remat", "checkpoint", "jit", "pjit"}
    ),
}


def scanned(
    session: Session,
    call: Any,
    value: Any,
    args: tuple,
    origin: Origin,
    method: str,
    patched: bool,
) -> Any:
    """A call inside `hk.scan`: the carried state holds the site's whole
    stacked epsilon, patch value (where `patched`) and recording; a carried
    step counter picks the row."""
    length, reverse = origin.scan
    if session.recorder.learns_sites():
        # One iteration's shapes: they shape the rows a run carries.
        call.origin = dataclasses.replace(
            origin,
            value=session.arrays.abstract(differentiable_part(value)),
            inputs=session.arrays.abstract(positional_arrays(args)),
        )
        value = session.exit(call, value, record=False)
        session.recorder.holds_iterations(call.name, value, length)
        return value
    selected = call.name in session.selected
    if not (selected or patched):  # a patch function needs no row
        return session.exit(call, value, record=False)
    counter = carrier_name("step", method, call.index, origin.tap)
    step = hk.get_state(counter)
    row = length - 1 - step if reverse else step

    def perturb(value):
        epsilon = hk.get_state(carrier_name("epsilon", method, call.index, origin.tap))
        return add_epsilon(value, jax.tree.map(lambda e: e[row], epsilon))

    patch = patch_from_state(call, method, row) if patched else None
    value = session.exit(call, value, perturb, record=False, patch=patch)
    if selected:
        recording = carrier_name("recording", method, call.index, origin.tap)
        values, inputs = hk.get_state(recording)
        values = _set_row(values, row, differentiable_part(value))
        if inputs is not None:
            inputs = _set_row(inputs, row, positional_arrays(args))
        hk.set_state(recording, (values, inputs))
    hk.set_state(counter, step + 1)
    return value


def _set_row(rows: Any, row: Any, values: Any) -> Any:
    return jax.tree.map(lambda r, v: r.at[row].set(v), rows, values)
