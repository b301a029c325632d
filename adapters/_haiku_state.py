"""Haiku state as the route of epsilons and recordings (see `bridge.adapters.haiku`).

At a selected call of an `hk.transform_with_state` model the epsilon is read
with `hk.get_state` from the module's own state bundle (keyed like its
params), so Haiku threads it wherever it threads state: through
`hk.experimental.layer_stack` (sliced per layer going in, its recording stacked
coming out), `hk.remat` and `hk.jit`, and `hk.scan`, whose carry holds the
whole stacked epsilon and recording while a step counter picks the
iteration's row. The entries are stripped from the state `apply` returns. A
plain `hk.transform` model with such a site runs as the
`hk.transform_with_state` of the function it wraps. Transforms that carry
state as one value for every iteration or example raise, naming themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from bridge._session import Session
from bridge._sites import (
    Site,
    differentiable_part,
    is_array,
    merge_differentiable,
    zeros_like_struct,
)

from . import _haiku_internals as internals

#: Prefix of the state entries that hold the probe's epsilons. `#` and `.`
#: cannot occur in a name a Haiku module gives its own state by convention.
EPSILON_PREFIX = "bridge_epsilon."
#: Prefix of the state entries carrying recordings out of lifted transforms.
RECORDING_PREFIX = "bridge_recording."
RESERVED = (EPSILON_PREFIX, RECORDING_PREFIX)
STEP = ".step"


def with_state(transformed: hk.Transformed, takes_rng: bool) -> hk.TransformedWithState:
    """The plain transform's function under `hk.transform_with_state`, so that
    epsilons and recordings can ride in state through a lifted transform.

    `hk.transform` is `hk.without_state(hk.transform_with_state(f))`; Haiku
    keeps `f` on `apply` as `_original_fn` (marked experimental there).
    """
    original = internals.original_function(transformed.apply)
    if original is None:
        raise NotImplementedError(
            "Sites inside hk.experimental.layer_stack, hk.scan or hk.remat of a "
            "plain hk.transform model need the function it wraps, which this "
            "Transformed's apply does not expose (it is not Haiku's own). "
            "Transform the model with hk.transform_with_state and pass "
            "bridge.probe(transformed, params, state)."
        )
    stateful = hk.transform_with_state(original)
    return stateful if takes_rng else hk.without_apply_rng(stateful)


class NeedsState(Exception):
    """Discovery of a plain transform met a site inside a lifted transform: run
    it again with the epsilons and recordings in state."""


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a Haiku site's epsilon and recording live.

    `bundle` is the state bundle, keyed like the module's params as `apply`
    sees them (`__layer_stack_no_per_layer/lin`). `lifted` is true inside
    `layer_stack`, `hk.scan`, `hk.remat` or `hk.jit`, whose values must leave
    through state; `blocked` names a transform whose values cannot leave it
    per call. Inside `hk.scan`, whose state is one carry for every iteration,
    `scan` is `(length, reverse)`: the carry holds the whole stacked epsilon
    and recording, and a step counter picks the iteration's row.
    """

    bundle: str
    lifted: bool = False
    blocked: str | None = None
    scan: tuple[int, bool] | None = None


def scanned(session: Session, call: Any, value: Any, origin: Origin, method: str):
    """A call inside `hk.scan`: the carried state holds the site's whole
    stacked epsilon and recording; a carried step counter picks the row."""
    length, reverse = origin.scan
    if session.discovering:
        value = session.exit(call, value, record=False)
        stacked = jax.tree.map(
            lambda v: jnp.broadcast_to(v, (length, *jnp.shape(v))),
            jax.tree.map(lambda v: v if is_array(v) else None, value),
        )
        session.restructure(call.name, stacked)
        return value
    if call.name not in session.selected:
        return session.exit(call, value, record=False)
    recording = recording_entry(method, call.index)
    step = hk.get_state(recording + STEP)
    row = length - 1 - step if reverse else step

    def perturb(value):
        epsilon = hk.get_state(state_entry(method, call.index))
        floats = jax.tree.map(
            lambda v, e: v + e[row], differentiable_part(value), epsilon
        )
        return merge_differentiable(value, floats)

    value = session.exit(call, value, perturb, record=False)
    rows, _ = hk.get_state(recording)
    rows = jax.tree.map(lambda r, v: r.at[row].set(v), rows, differentiable_part(value))
    hk.set_state(recording, (rows, None))
    hk.set_state(recording + STEP, step + 1)
    return value


def check_reachable(name: str, origin: Origin, session: Session) -> None:
    if name not in session.selected and name not in session.patches:
        return
    if origin.blocked is not None:
        raise ValueError(
            f"bridge cannot see through {origin.blocked} around site {name!r}: "
            f"Haiku carries state through {origin.blocked} as one value for "
            "every iteration (or mapped example), so one epsilon would serve "
            "them all and their gradients would be summed. Select sites outside "
            "it with `at=`; a stack of layers written with "
            "hk.experimental.layer_stack is supported."
        )
    if name in session.patches:
        raise NotImplementedError(
            f"Site {name!r} is inside hk.experimental.layer_stack, hk.scan or "
            "hk.remat, where bridge does not patch yet. Patch a site outside it."
        )
    if origin.scan is not None and session.with_inputs:
        raise NotImplementedError(
            f"Site {name!r} is inside hk.scan, where bridge does not record "
            "layer inputs yet: pass with_inputs=False or select sites outside it."
        )


def tap_outside_transforms(tap: Any, stop: Any) -> Any:
    """The session's `tap`, refusing a tap inside a Haiku transform: its value
    would be recorded from the transform's inner trace and one epsilon would
    serve every layer or iteration."""

    def checked(name: str, value: Any) -> Any:
        where = internals.enclosing(stop)
        if where.lifted or where.blocked is not None:
            raise NotImplementedError(
                f"bridge.tap({name!r}) is called inside "
                f"{where.blocked or 'hk.experimental.layer_stack, hk.scan or hk.remat'}"
                ", where bridge does not support taps yet. Wrap the computation "
                "in an hk.Module (its calls are sites there), or tap outside it."
            )
        return tap(name, value)

    return checked


def unreachable(call: Any) -> Any:
    """The `init` of an epsilon's `hk.get_state`: called only where the state
    given to `apply` does not reach, inside a lifted transform."""

    def fail(shape: Any, dtype: Any) -> Any:
        raise NotImplementedError(
            f"The epsilon of site {call.name!r} did not reach it through Haiku "
            "state: it is called inside a transform that does not carry the "
            "state given to `apply`. Select sites outside it with `at=`."
        )

    return fail


def state_entry(method: str, index: int) -> str:
    return f"{EPSILON_PREFIX}{method}#{index}"


def recording_entry(method: str, index: int) -> str:
    return f"{RECORDING_PREFIX}{method}#{index}"


def with_epsilons(
    state: Mapping, selected: Mapping[str, Site], epsilons: Mapping
) -> dict:
    """The user's state plus each epsilon in its module's bundle (new dicts),
    and, for a site inside `hk.scan`, its recording rows and step counter."""
    merged = {bundle: dict(entries) for bundle, entries in state.items()}
    for site in selected.values():
        if site.origin is not None and site.origin.scan is not None:
            entry = recording_entry(site.method or "__call__", site.index)
            bundle = merged.setdefault(site.origin.bundle, {})
            bundle[entry] = (zeros_like_struct(site.value_struct), None)
            bundle[entry + STEP] = jnp.zeros((), jnp.int32)
    for name, epsilon in epsilons.items():
        site = selected[name]
        if site.origin is None:  # a `bridge.tap`: its epsilon lives in the session
            continue
        entry = state_entry(site.method or "__call__", site.index)
        merged.setdefault(site.origin.bundle, {})[entry] = epsilon
    return merged


def without_epsilons(state: Mapping) -> dict:
    """Apply's new state less the epsilons, and less bundles that held only them."""
    stripped = {}
    for bundle, entries in state.items():
        kept = {k: v for k, v in entries.items() if not k.startswith(RESERVED)}
        if kept or len(kept) == len(entries):
            stripped[bundle] = kept
    return stripped
