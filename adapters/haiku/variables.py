"""Haiku state as the route of epsilons and recordings (see `bridge.adapters.haiku`).

At a selected call of an `hk.transform_with_state` model the epsilon is read
with `hk.get_state` from the module's own state bundle (keyed like its
params), so Haiku threads it wherever it threads state: through
`hk.experimental.layer_stack` (sliced per layer going in, its recording stacked
coming out), `hk.remat` and `hk.jit`, and `hk.scan`, whose carry holds the
whole stacked epsilon and recording while a step counter picks the
iteration's row. A patch value for a site there rides beside the epsilon, in
the site's stacked shape, and each layer or iteration takes its row the same
way. The entries are stripped from the state `apply` returns. A plain
`hk.transform` model with such a site runs as the `hk.transform_with_state`
of the function it wraps. Transforms that carry state as one value for every
iteration or example raise, naming themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from bridge.adapter_api import (
    BridgeNotImplementedError,
    Session,
    Site,
    SiteOrigin,
    add_epsilon,
    carrier_name,
    differentiable_part,
    is_carrier_name,
    positional_arrays,
)

from ..shared import unexpressible
from . import internals, jax_transforms


def with_state(transformed: hk.Transformed, takes_rng: bool) -> hk.TransformedWithState:
    """The plain transform's function under `hk.transform_with_state`, so that
    epsilons and recordings can ride in state through a lifted transform.

    `hk.transform` is `hk.without_state(hk.transform_with_state(f))`; Haiku
    keeps `f` on `apply` as `_original_fn` (marked experimental there).
    """
    original = internals.original_function(transformed.apply)
    if original is None:
        raise BridgeNotImplementedError(
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
class Origin(SiteOrigin):
    """Where a Haiku site's epsilon and recording live.

    `bundle` is the state bundle, keyed like the module's params as `apply`
    sees them (`__layer_stack_no_per_layer/lin`). `lifted` is true inside
    `layer_stack`, `hk.scan`, `hk.remat` or `hk.jit`, whose values must leave
    through state; `blocked` says why a call inside a transform whose values
    cannot leave it per call is refused where selected or patched, naming it
    (`refused`). Inside `hk.scan`, whose state is one carry for every iteration,
    `scan` is `(length, reverse)`: the carry holds the whole stacked epsilon,
    patch value and recording, and a step counter picks the iteration's row;
    `value` and `inputs` are the abstract value (floating leaves) and
    positional arguments of one iteration, which shape the recording's rows.
    `tap` names a `bridge.tap` there, kept in the bundle of the module that
    calls it.
    """

    bundle: str
    lifted: bool = False
    blocked: str | None = None
    scan: tuple[int, bool] | None = None
    value: Any = None
    inputs: Any = None
    tap: str | None = None


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


def patch_from_state(call: Any, method: str, row: Any = None) -> Any:
    """`call`'s patch value, read from state (see `placed`): a layer stack
    slices it per layer going in; inside `hk.scan` the carry holds the whole
    stacked value and `row` picks the iteration's."""
    entry = carrier_name("patch", method, call.index, call.origin.tap)
    value = hk.get_state(entry, (), jnp.float32, init=unreachable(call))
    if row is not None:
        value = jax.tree.map(lambda v: v[row], value)
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
    "hk.fori_loop": (
        "Haiku carries state through hk.fori_loop as one value for every "
        "iteration, so one epsilon would serve them all and their gradients "
        "would be summed",
        "write the loop as hk.scan, or stack layers with hk.experimental.layer_stack",
    ),
    "hk.while_loop": (
        "how many iterations run is known only when the model runs, so no "
        "epsilon or recording can be shaped for them",
        "write the loop as hk.scan of fixed length",
    ),
    "hk.cond": (
        "which branch runs is known only when the model runs, so a call in a "
        "branch may not run at all",
        "compute both branches and pick with jnp.where",
    ),
    "hk.switch": (
        "which branch runs is known only when the model runs, so a call in a "
        "branch may not run at all",
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
    return dataclasses.replace(
        origin, blocked=unexpressible.reason(name, transform, why, fix)
    )


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
            or jax_transforms.around(base) != (0, None)
        ):
            return in_transform(name, value, where)
        return session.tap_here(name, value)

    return tap


def unreachable(call: Any) -> Any:
    """The `init` of an epsilon's `hk.get_state`: called only where the state
    given to `apply` does not reach, inside a lifted transform."""

    def fail(shape: Any, dtype: Any) -> Any:
        raise BridgeNotImplementedError(
            f"The epsilon of site {call.name!r} did not reach it through Haiku "
            "state: it is called inside a transform that does not carry the "
            "state given to `apply`. Select sites outside it with `at=`."
        )

    return fail


def placed(session: Session) -> dict[str, Site]:
    """Of the sites patched with a value, those inside a lifted transform: the
    value rides in state beside the epsilon (a patch function needs no
    placing)."""
    return {
        name: site
        for name, site in session.carrier.patched_with_values().items()
        if isinstance(site.origin, Origin) and site.origin.lifted
    }


def with_epsilons(
    state: Mapping, session: Session, patched: Mapping[str, Site]
) -> dict:
    """The user's state plus, in each site's bundle (new dicts), what
    the carrier's `to_carry_in` gives: the epsilon of each selected site, the patch
    value of each site in `patched` (see `placed`), and, for a site inside
    `hk.scan`, its step counter and recording rows."""
    merged = {bundle: dict(entries) for bundle, entries in state.items()}
    for carried in session.carrier.to_carry_in(
        lambda site: True, lambda site: site.name in patched
    ):
        merged.setdefault(carried.site.origin.bundle, {})[carried.name] = carried.value
    return merged


def without_epsilons(state: Mapping) -> dict:
    """Apply's new state less the epsilons, and less bundles that held only them."""
    stripped = {}
    for bundle, entries in state.items():
        kept = {k: v for k, v in entries.items() if not is_carrier_name(k)}
        if kept or len(kept) == len(entries):
            stripped[bundle] = kept
    return stripped
