"""Haiku sites inside Haiku's lifted transforms: `hk.experimental.layer_stack`,
`hk.scan`, `hk.remat` (and `hk.jit`) thread Haiku state, where a site's
epsilon, patch value and recording ride (`bridge.adapters.haiku.variables`).

A layer stack slices state per layer going in and stacks it coming out, so
its sites hold every layer; `hk.remat` threads it through; `hk.scan` carries
it, so the carry holds the whole stacked epsilon and recording and a step
counter picks the iteration's row (`scanned`). A tap there is a site of the
module calling it (`tap_handler`). Transforms that carry state as one value
for every iteration or example (`hk.vmap`, `hk.fori_loop`, a user's
`hk.lift`, ...) and loops and branches are refused where a site inside them
is selected or patched, naming themselves (`refused`, and
`bridge.adapters.haiku.jax_transforms` for JAX's own).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import haiku as hk
import jax

from bridge.adapter_api import (
    BRANCH,
    TRACED_BOUNDS,
    TRACED_BOUNDS_FIX,
    UNBOUNDED_LOOP,
    Session,
    add_epsilon,
    carrier_name,
    differentiable_part,
    positional_arrays,
    refusal,
)

from ..shared import unexpressible
from . import internals, jax_transforms
from .variables import Origin, patch_from_state


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


#: Why a site inside each Haiku transform cannot be expressed, and what to do.
_REFUSALS = {
    "hk.vmap": (
        "Haiku carries state through hk.vmap as one value for every mapped "
        "example, so one epsilon would serve them all and their gradients "
        "would be summed",
        "probe the unmapped function with bridge.probe(..., vmap=True)",
    ),
    "hk.scan": (
        "Haiku's state there is one carry for nested scans (or for a scan "
        "inside a layer stack), where bridge cannot pick one iteration's row",
        "scan one level deep, or stack layers with hk.experimental.layer_stack",
    ),
    # One of static bounds is a site of the control-flow route.
    "hk.fori_loop": (TRACED_BOUNDS, TRACED_BOUNDS_FIX),
    "hk.while_loop": (
        UNBOUNDED_LOOP,
        "write the loop as hk.scan of fixed length",
    ),
    "hk.cond": (
        BRANCH,
        "compute both branches and pick with jnp.where",
    ),
    "hk.switch": (
        BRANCH,
        "compute every branch and pick with jnp.where",
    ),
    "hk.lift": (
        "an inner transform the model lifts keeps state of its own, which "
        "bridge's does not reach",
        "probe the lifted function on its own",
    ),
}


def refused(origin: Origin, name: str, transform: str) -> Origin:
    """`origin` of site `name`, which bridge cannot express inside
    `transform` (`hk.vmap`, `hk.while_loop`, ...): its `blocked` says why."""
    why, fix = {**_REFUSALS, **jax_transforms.REFUSALS}.get(
        transform,
        (
            f"a call inside {transform} runs where bridge's state does not reach",
            "move the call out of it",
        ),
    )
    return dataclasses.replace(origin, blocked=refusal(name, transform, why, fix))


def tap_handler(session: Session, stop: Any, base: Any, in_transform: Any) -> Any:
    """The session's tap handler. A tap inside `layer_stack`, `hk.scan` or
    `hk.remat` is a site whose values ride in the state of the module calling
    it (`in_transform(name, value, where)`), as that module's own do; one
    inside the model's own `jax.vmap` is handed out of it
    (`bridge.adapters.haiku.jax_transforms`); one inside a transform that
    cannot carry them is listed there and refused where selected or
    patched. `base`: the trace of the probe's `apply`."""

    def tap(name: str, value: Any) -> Any:
        where = internals.enclosing(stop)
        if (
            where.lifted
            or where.blocked is not None
            or unexpressible.vmaps_or_blocker(base) != (0, None)
        ):
            return in_transform(name, value, where)
        return session.tap_here(name, value)

    return tap
