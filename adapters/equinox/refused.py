"""Equinox calls that cannot be sites: listed, run as they are, and refused
only where they are selected or patched.

A call inside a transform bridge cannot see through (a `jax.vmap` of the
model's own code inside a `lax.scan`, `lax.cond`, `while_loop`, nested
scans, a layer the scan closes over) has no route for its epsilon or its
value. It must not cost the other sites anything: the README promises that
unselected sites cost nothing, so discovery lists it and a run that neither
selects nor patches it calls it as it is. Where it is selected or patched,
the error names the site and the innermost transform that holds it (its
origin's `blocked`); a `jax.jit` inside the model is skipped when naming
one.

It is listed with the shape its value has for the model, as the contract
lays sites out: the axes of the model's own `jax.vmap`s around it in front
(after the batch axis of `vmap=True`, outermost first), the iterations of
the scans around it first (`stacked`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from bridge.adapter_api import BridgeValueError, Session, SiteOrigin

from ..shared import jax_internals as internals
from ..shared import unexpressible
from .transforms import CHECKPOINT, SCAN, describe

#: JAX's names of the transforms a refused site is never named after: those
#: bridge sees through (a scan over stacked layers, a checkpoint, the model's
#: own vmaps alone) and a `jax.jit` inside the model, traced through.
_NOT_NAMED = frozenset({SCAN, CHECKPOINT, "vmap", *unexpressible.TRANSPARENT})

#: Why a site inside each transform cannot be expressed, and what to do.
_REFUSALS = {
    "while_body": (
        "how many iterations run is known only when the model runs, so no "
        "epsilon or recording can be shaped for them",
        "write the loop as a jax.lax.scan of fixed length",
    ),
    "cond": (
        "which branch runs is known only when the model runs, so a call in a "
        "branch may not run at all",
        "compute both branches and pick with jnp.where",
    ),
    "fori_loop": (
        "the loop closes over the layer, so one epsilon would serve every "
        "iteration and their gradients would be summed",
        "scan over stacked layers (the scan's xs slice them), or unroll the loop",
    ),
}
_REFUSALS["while_cond"] = _REFUSALS["while_body"]
_REFUSALS["switch"] = _REFUSALS["cond"]


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
    whole: Whole | None = None,
) -> Any:
    """Call `function` as the model does, listed as a site that raises
    `origin.blocked` where it is selected or patched. `whole`: the axes its
    value has for the model around the one seen here (`whole_axes`); read
    here from `origin.transforms` where not given."""
    call = session.enter(site.path, method, module, args, origin=origin, record=False)
    call.origin = _named(origin, call.name)
    if call.name in session.selected or call.name in session.patches:
        raise BridgeValueError(call.origin.blocked)
    value = function(*args, **kwargs)
    if not session.recorder.learns_sites():
        return session.exit(call, value, perturb=lambda v: v, record=False)
    if whole is None:
        whole = whole_axes(getattr(origin, "transforms", ()), None)
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


def _named(origin: SiteOrigin, name: str) -> SiteOrigin:
    """`origin`, its `blocked` naming the innermost loop or branch around the
    call where there is one (the model's own vmaps, a `jax.jit` inside the
    model and what bridge sees through are skipped)."""
    enclosing = getattr(origin, "transforms", ())
    blocker = next((t for t in enclosing if t not in _NOT_NAMED), None)
    if blocker is None or not dataclasses.is_dataclass(origin):
        return origin
    why, fix = _REFUSALS.get(
        blocker,
        (
            "bridge sees through jax.lax.scan over stacked layers, "
            "jax.checkpoint and the model's own jax.vmap only",
            "move the call out of it, or unroll it",
        ),
    )
    why += f" (it is called inside {describe(enclosing)})"
    return dataclasses.replace(
        origin, blocked=unexpressible.reason(name, describe((blocker,)), why, fix)
    )


def whole_axes(enclosing: tuple[str, ...], iterations: int | None) -> Whole:
    """The axes that the transforms around this point (`enclosing`, innermost
    first) add to a value seen here: each `jax.vmap`'s size, and the scans'
    iterations (`iterations` for the only scan, else read off `lax.scan`'s
    frames where their count matches; `None` where unknown). A loop or a
    branch adds none."""
    mapped = []
    trace = internals.current_trace()
    for name in enclosing:
        if name == "vmap":
            size = internals.vmap_size(trace)
            if size is not None:
                mapped.append(size)
        trace = internals.parent(trace)
    scans = sum(name in unexpressible.SCANS for name in enclosing)
    lengths: tuple[int, ...] | None = ()
    if scans == 1 and iterations:
        lengths = (iterations,)
    elif scans:
        frames = internals.scan_frames(None) or []
        lengths = (
            tuple(length for length, _ in reversed(frames))
            if len(frames) == scans
            else None
        )
    return Whole(tuple(reversed(mapped)), lengths)
