"""Equinox calls that cannot be sites: listed, run as they are, and refused
only where they are selected or patched.

A call inside a transform bridge cannot see through (a `jax.vmap` of the
model's own code inside a `lax.scan`, `lax.cond`, `while_loop`, a `jax.jit`
called inside the model, nested scans, a layer the scan closes over) has no
route for its epsilon or its value. It must not cost the other sites
anything: the README promises that unselected sites cost nothing, so
discovery lists it and a run that neither selects nor patches it calls it
as it is. Where it is selected or patched, the error names the site and the
transforms around it (its origin's `blocked`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from bridge.adapter_api import BridgeValueError, Session, SiteOrigin

from ..shared import jax_internals as internals
from .transforms import CHECKPOINT, SCAN


def unreachable(
    session: Session,
    site: Any,
    method: str | None,
    module: Any,
    function: Callable,
    args: tuple,
    kwargs: dict,
    origin: SiteOrigin,
    whole: tuple[int, ...] | None = None,
) -> Any:
    """Call `function` as the model does, listed as a site that raises
    `origin.blocked` where it is selected or patched. `whole`: the axes,
    outermost first, that the value would hold in front of the one seen
    here had bridge been able to hand it out (listed so at discovery);
    `None` where they cannot be told."""
    call = session.enter(site.path, method, module, args, origin=origin, record=False)
    if call.name in session.selected or call.name in session.patches:
        raise BridgeValueError(origin.blocked)
    value = function(*args, **kwargs)
    value = session.exit(call, value, perturb=lambda v: v, record=False)
    if whole and session.recorder.learns_sites():
        # Listed with every iteration and every token, as a site of the same
        # code outside the transform would be; inner axes first here,
        # `holds_iterations` puts the outermost in front.
        inner = jax.tree.map(
            lambda v: (
                jnp.broadcast_to(v, (*whole[1:], *jnp.shape(v)))
                if eqx.is_array(v)
                else v
            ),
            value,
        )
        session.recorder.holds_iterations(call.name, inner, whole[0])
    return value


def whole_axes(
    enclosing: tuple[str, ...], iterations: int | None
) -> tuple[int, ...] | None:
    """The axes, outermost first, that the transforms around this point
    (`enclosing`, innermost first) add to a value seen here: each `jax.vmap`'s
    size and the scan's `iterations`. `None` where one cannot be told (a
    loop of unknown length, nested scans)."""
    sizes = []
    trace = internals.current_trace()
    for name in enclosing:
        if name == "vmap":
            size = internals.vmap_size(trace)
            if size is None:
                return None
            sizes.append(size)
        elif name == SCAN:
            if not iterations or enclosing.count(SCAN) > 1:
                return None
            sizes.append(iterations)
        elif name not in (CHECKPOINT, "jit", "cond", "switch"):
            return None  # a while_loop's iterations are not known
        trace = internals.parent(trace)
    return tuple(reversed(sizes))
