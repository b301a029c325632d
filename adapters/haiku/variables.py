"""Haiku state as the route of epsilons, patch values and recordings (see
`bridge.adapters.haiku`).

At a selected call of an `hk.transform_with_state` model the epsilon is read
with `hk.get_state` from the module's own state bundle (keyed like its
params), so Haiku threads it wherever it threads state: through
`hk.experimental.layer_stack` (sliced per layer going in, its recording stacked
coming out), `hk.remat` and `hk.jit`, and `hk.scan`, whose carry holds the
whole stacked epsilon and recording (`bridge.adapters.haiku.transforms`). A
patch value for a site there rides beside the epsilon, in the site's stacked
shape, and each layer or iteration takes its row the same way. The entries
are stripped from the state `apply` returns. A plain `hk.transform` model
with such a site runs as the `hk.transform_with_state` of the function it
wraps.
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
    carrier_name,
    is_carrier_name,
)

from . import internals


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
    through state; `blocked` is the router's sentence of a call inside a
    transform whose values cannot leave it per call, refused where selected
    or patched. Inside `hk.scan`, whose state is one carry for
    every iteration, `scan` is `(length, reverse)`: the carry holds the whole
    stacked epsilon, patch value and recording, and a step counter picks the
    iteration's row;
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


def patch_from_state(call: Any, method: str, row: Any = None) -> Any:
    """`call`'s patch value, read from state (see `placed`): a layer stack
    slices it per layer going in; inside `hk.scan` the carry holds the whole
    stacked value and `row` picks the iteration's."""
    entry = carrier_name("patch", method, call.index, call.origin.tap)
    value = hk.get_state(entry, (), jnp.float32, init=unreachable(call))
    if row is not None:
        value = jax.tree.map(lambda v: v[row], value)
    return value


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
