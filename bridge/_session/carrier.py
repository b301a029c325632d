"""The carrier: bridge's values through a library's lifted transforms.

A lifted transform (a scan, a layer stack, a remat) sees only what its
library carries through it, and a value seen inside it is a tracer of its
own trace. So an adapter moves bridge's values through the library's own
variables (Linen collections, Haiku state, NNX module attributes): epsilons
and patch values in before the model's call (`to_carry_in`), recordings out
after it (`carries_out`, `to_carry_out`, `defer`, `hand_over`). The carrier
(`session.carrier`) says what moves; the adapter moves it.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from .sites import Site, carrier_name

if TYPE_CHECKING:
    from .recorders import Recorder
    from .session import Request


@dataclasses.dataclass(frozen=True)
class CarriedIn:
    """One value an adapter places in its library's variables for `site`
    (`Carrier.to_carry_in`): `kind` is `epsilon`, `patch`, `step` or
    `recording`."""

    site: Site
    kind: str
    value: Any

    @property
    def name(self) -> str:
        """The variable's name (`carrier_name`)."""
        site = self.site
        return carrier_name(self.kind, site.method, site.index, site.origin.tap)


class Carrier:
    """What one session moves through lifted transforms (`session.carrier`):
    made from the trace's `Request`, and the `Recorder` that keeps what
    comes out."""

    def __init__(self, request: Request, recorder: Recorder):
        self._request = request
        self._recorder = recorder
        # Asked for at every call inside a lifted transform: computed once.
        self._patched_with_values = {
            name: request.patched[name]
            for name, patch in request.patches.items()
            if not callable(patch) and name in request.patched
        }
        # Sites inside lifted transforms whose values leave in library state:
        # `{name: where}`, read back by `hand_over`.
        self._deferred: dict[str, Any] = {}

    # -- in ------------------------------------------------------------------

    def patched_with_values(self) -> Mapping[str, Site]:
        """The discovered `Site` of each site patched with a value rather than
        a function: what an adapter must carry into a lifted transform."""
        return types.MappingProxyType(self._patched_with_values)

    def to_carry_in(
        self,
        carried: Callable[[Site], bool],
        patch_carried: Callable[[Site], bool] = lambda site: False,
    ) -> list[CarriedIn]:
        """What an adapter places in its library's own variables before the
        model's call, each under its `name` (`carrier_name`): for each selected
        site where `carried(site)`, its epsilon (where it has one); for each
        site patched with a value where `patch_carried(site)`, that value. A
        site among these inside a scan whose carry holds them (`origin.scan`)
        also gets an int32 `step` counter, to pick its row, and, if selected,
        its `recording` rows: zeros `(length, ...)` of its value's floating
        leaves and, with `with_inputs`, of its inputs (else `None`), which the
        adapter fills one row a step."""
        request = self._request
        selected = [
            site
            for site in (request.selected or {}).values()
            if site.origin is not None and carried(site)
        ]
        patched = [
            site
            for site in self._patched_with_values.values()
            if site.origin is not None and patch_carried(site)
        ]
        placed = [
            CarriedIn(site, "epsilon", request.epsilons[site.name])
            for site in selected
            if site.name in request.epsilons
        ]
        placed += [
            CarriedIn(site, "patch", request.patches[site.name]) for site in patched
        ]
        for site in {site.name: site for site in [*selected, *patched]}.values():
            if site.origin.scan is None:
                continue
            placed.append(CarriedIn(site, "step", jnp.zeros((), jnp.int32)))
            if site.name in (request.selected or {}):
                length = site.origin.scan[0]
                inputs = site.origin.inputs if request.with_inputs else None
                rows = _zero_rows((site.origin.value, inputs), length)
                placed.append(CarriedIn(site, "recording", rows))
        return placed

    # -- out -----------------------------------------------------------------

    def carries_out(self, name: str) -> bool:
        """Whether site `name`'s value must leave the lifted transform it is
        in: at discovery every site's (its stacked shape), in a run a
        selected site's (its recording)."""
        return self._recorder.keeps(name)

    def carries_out_any(self, where: Callable[[Site], bool]) -> bool:
        """Whether any site where `where(site)` must carry its value out (at
        discovery, where no site is known yet, any may)."""
        return self._recorder.keeps_any(where)

    def to_carry_out(self, value: Any, args: tuple = ()) -> tuple[Any, Any]:
        """What an adapter carries out of a lifted transform for a site there:
        `(value, inputs)`, the whole value at discovery (its structure is the
        site's) and its floating leaves in a run (what a recording keeps);
        with `with_inputs`, the call's positional `args` (else `None`)."""
        request = self._request
        inputs = request.arrays.positional(args) if request.with_inputs else None
        return self._recorder.kept_part(value), inputs

    def defer(self, name: str, where: Any) -> None:
        """A site inside a lifted transform carries its value out (see
        `to_carry_out`) in the library's own state, at `where` (an adapter's
        location: a collection path, a state entry, a module attribute)."""
        self._deferred[name] = where

    def hand_over(self, read: Callable[[Any], tuple[Any, Any]]) -> None:
        """After the model's call: each deferred site's `(value, inputs)`,
        `read(where)` from the state the call returned, goes to
        `carried_out`."""
        for name, where in self._deferred.items():
            self.carried_out(name, *read(where))

    def carried_out(
        self, name: str, value: Any, inputs: tuple | None = None, ran: Any = None
    ) -> None:
        """A site's value (and inputs) as it left a lifted transform, stacked
        over iterations or layers: at discovery it reshapes the site, in a run
        it is recorded. `ran`, for a site inside a branch or a while loop: a
        boolean array, shaped like the value's stacked axes, of where its call
        ran (`ProbeResult.ran`)."""
        self._recorder.carried_out(name, value, inputs, ran)

    # -- through a transform of the adapter's own ------------------------------

    def recordings(self) -> tuple[dict[str, Any], dict[str, tuple], dict[str, Any]]:
        """The values, inputs and where-it-ran masks recorded so far. An
        adapter that runs the model inside a JAX transform of its own
        (Equinox's `jax.vjp`) returns them from it as outputs, and `adopt`s
        them outside."""
        recorder = self._recorder
        return dict(recorder.activations), dict(recorder.inputs), dict(recorder.ran)

    def adopt(
        self, recordings: tuple[dict[str, Any], dict[str, tuple], dict[str, Any]]
    ) -> None:
        """Take `recordings` (see `recordings`) as the session's own."""
        activations, inputs, ran = recordings
        self._recorder.activations.update(activations)
        self._recorder.inputs.update(inputs)
        self._recorder.ran.update(ran)

    def checkpoint(self) -> dict[str, Any]:
        return dict(self._deferred)

    def restore(self, checkpoint: dict[str, Any]) -> None:
        self._deferred = dict(checkpoint)


def _zero_rows(struct: Any, length: int) -> Any:
    return jax.tree.map(lambda s: jnp.zeros((length, *s.shape), s.dtype), struct)
