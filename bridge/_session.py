"""The per-trace bookkeeping every adapter shares: naming, counting, recording.

An adapter reaches each submodule call with its library's own mechanism and
reports it here with `enter` and `exit`. The session names the call, counts
repeated calls, and, for the selected sites, applies patches, adds the
epsilon (or lets the adapter add it natively) and records values. One session
lives for one trace of the model; it is found through a `ContextVar`, so two
threads (or two nested probes) never see each other's sites.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import types
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ._errors import BridgeTypeError
from ._sites import (
    JAX_ARRAYS,
    Arrays,
    Site,
    SiteOrigin,
    carrier_name,
    differentiable_part,
    patch_misfit,
    site_name,
)

_ACTIVE: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "bridge_session", default=None
)


def current() -> Session | None:
    """The session of the probe tracing the model now, if any."""
    return _ACTIVE.get()


@dataclasses.dataclass
class Call:
    """A submodule call between `enter` and `exit`."""

    name: str
    path: str
    method: str | None
    index: int
    module: Any
    origin: SiteOrigin | None
    slot: int


class Session:
    """Bookkeeping for one trace of the model.

    With `selected=None` the session discovers: it lists every call as a `Site`
    with the abstract shape of its value, and changes nothing. Otherwise it
    runs: selected sites are recorded and, where `epsilons` has an entry, get
    their epsilon added.
    """

    def __init__(
        self,
        selected: Mapping[str, Site] | None = None,
        epsilons: Mapping[str, Any] | None = None,
        patches: Mapping[str, Any] | None = None,
        with_inputs: bool = False,
        batch_axis: str | None = None,
        arrays: Arrays = JAX_ARRAYS,
        patched: Mapping[str, Site] | None = None,
    ):
        self.discovering = selected is None
        self.selected = selected or {}
        self.epsilons = epsilons or {}
        self.patches = patches or {}
        # The discovered `Site` of each patched site, selected or not.
        self.patched = patched or {}
        # Asked for at every call inside a lifted transform: computed once.
        self._patched_with_values = {
            name: self.patched[name]
            for name, patch in self.patches.items()
            if not callable(patch) and name in self.patched
        }
        self.with_inputs = with_inputs
        # Set when the model runs under the probe's own `jax.vmap` (vmap=True):
        # a patch function then still sees the whole batch.
        self.batch_axis = batch_axis
        # The framework's values: JAX arrays, or an adapter's own (PyTorch).
        self.arrays = arrays
        self.sites: list[Site | None] = []
        self.activations: dict[str, Any] = {}
        self.inputs: dict[str, tuple] = {}
        self._counts: dict[str, int] = {}
        self._enclosing: list[str] = []
        self._tap_handler: Callable[[str, Any], Any] | None = None
        # Sites inside lifted transforms whose values leave in library state:
        # `{name: where}`, read back by `hand_over`.
        self._deferred: dict[str, Any] = {}

    @contextlib.contextmanager
    def active(self) -> Iterator[Session]:
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def enter(
        self,
        path: str,
        method: str | None,
        module: Any,
        args: tuple = (),
        origin: SiteOrigin | None = None,
        record: bool = True,
    ) -> Call:
        """Name a call as it starts: sites are ordered by call entry.

        With `record=False` the adapter records the inputs itself (see
        `record`): values seen inside a lifted transform are tracers of its
        inner trace and must leave it through the library's own outputs.
        """
        base = path if method is None else f"{path}.{method}"
        index = self._counts.get(base, 0)
        self._counts[base] = index + 1
        call = Call(
            site_name(path, method, index), path, method, index, module, origin, -1
        )
        if self.discovering:
            call.slot = len(self.sites)
            self.sites.append(None)
        elif record and self.with_inputs and call.name in self.selected:
            self.inputs[call.name] = self.arrays.positional(args)
        self._enclosing.append(path)
        return call

    def exit(
        self,
        call: Call,
        value: Any,
        perturb: Callable[[Any], Any] | None = None,
        record: bool = True,
        patch: Any = None,
    ) -> Any:
        """Finish a call: returns the value the model goes on with.

        Args:
          call: what `enter` returned.
          value: the call's return value.
          perturb: the adapter's native way to add this site's epsilon
            (`value -> value + epsilon`); by default the session adds the
            epsilon it holds.
          record: whether the session records the value; `False` where the
            adapter hands it over later with `record` (see `enter`).
          patch: this call's patch value where the adapter holds it rather
            than the session: one iteration's row of a stacked patch value
            inside a scan, carried in by the library's own mechanism.
        """
        self._enclosing.pop()
        if self.discovering:
            self.sites[call.slot] = Site(
                call.name,
                call.path,
                call.method,
                call.index,
                call.module,
                self.arrays.abstract(value),
                call.origin,
            )
            return value
        if patch is None:
            patch = self.patches.get(call.name)
        if patch is not None:
            value = self._apply_patch(call.name, patch, value)
        if call.name in self.selected:
            epsilon = self.epsilons.get(call.name)
            if epsilon is not None:
                if perturb is None:
                    value = self.arrays.add_epsilon(value, epsilon)
                else:
                    value = perturb(value)
            if record:
                self.activations[call.name] = self.arrays.recorded(value)
        return value

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
        selected = [
            site
            for site in self.selected.values()
            if site.origin is not None and carried(site)
        ]
        patched = [
            site
            for site in self.patched_with_values().values()
            if site.origin is not None and patch_carried(site)
        ]
        placed = [
            CarriedIn(site, "epsilon", self.epsilons[site.name])
            for site in selected
            if site.name in self.epsilons
        ]
        placed += [
            CarriedIn(site, "patch", self.patches[site.name]) for site in patched
        ]
        for site in {site.name: site for site in [*selected, *patched]}.values():
            if site.origin.scan is None:
                continue
            placed.append(CarriedIn(site, "step", jnp.zeros((), jnp.int32)))
            if site.name in self.selected:
                length = site.origin.scan[0]
                inputs = site.origin.inputs if self.with_inputs else None
                rows = _zero_rows((site.origin.value, inputs), length)
                placed.append(CarriedIn(site, "recording", rows))
        return placed

    def to_carry_out(self, value: Any) -> Any:
        """What an adapter carries out of a lifted transform for a site there:
        the whole value at discovery (its structure is the site's), the
        floating leaves in a run (what a recording keeps)."""
        return value if self.discovering else differentiable_part(value)

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

    def carried_out(self, name: str, value: Any, inputs: tuple | None = None) -> None:
        """A site's value (and inputs) as it left a lifted transform, stacked
        over iterations or layers: at discovery it reshapes the site (see
        `restructure`), in a run it is recorded."""
        if self.discovering:
            self.restructure(name, value)
        else:
            self.record(name, value, inputs)

    def record(self, name: str, value: Any, inputs: tuple | None = None) -> None:
        """Hand over a selected site's value (and inputs) recorded by the adapter."""
        self.activations[name] = self.arrays.recorded(value)
        if inputs is not None and self.with_inputs:
            self.inputs[name] = self.arrays.positional(inputs)

    def recordings(self) -> tuple[dict[str, Any], dict[str, tuple]]:
        """The values (and inputs) recorded so far. An adapter that runs the
        model inside a JAX transform of its own (Equinox's `jax.vjp`) returns
        them from it as outputs, and `adopt`s them outside."""
        return dict(self.activations), dict(self.inputs)

    def adopt(self, recordings: tuple[dict[str, Any], dict[str, tuple]]) -> None:
        """Take `recordings` (see `recordings`) as the session's own."""
        activations, inputs = recordings
        self.activations.update(activations)
        self.inputs.update(inputs)

    def checkpoint(self) -> tuple[dict[str, int], int, int, dict[str, Any]]:
        """The naming state now, to `restore` when a library traces a body again."""
        return (
            dict(self._counts),
            len(self.sites),
            len(self._enclosing),
            dict(self._deferred),
        )

    def restore(self, checkpoint: tuple[dict[str, int], int, int, dict]) -> None:
        """Forget the calls since `checkpoint`: they were an earlier trace of the
        same code (Flax traces a lifted body more than once), not new calls."""
        counts, discovered, depth, deferred = checkpoint
        self._counts = dict(counts)
        del self.sites[discovered:]
        del self._enclosing[depth:]
        self._deferred = dict(deferred)

    def run_with_fallback(
        self,
        run: Callable[[bool], Any],
        fallback: type[Exception],
        needs_fallback: Callable[[Any], bool],
    ) -> Any:
        """Run the model the cheap way, or the way its lifted transforms need.

        An adapter whose library hides some sites from its usual route (Linen
        scans carry only `params`, Haiku's plain transforms refuse state)
        calls `run(False)`. Discovery that meets such a site raises `fallback`
        and is done again with `run(True)`, forgetting the calls of the first
        attempt. A later run takes the fallback route only where a selected
        or patched site's origin `needs_fallback`.
        """
        if not self.discovering:
            return run(
                any(
                    site.origin is not None and needs_fallback(site.origin)
                    for site in [*self.selected.values(), *self.patched.values()]
                )
            )
        start = self.checkpoint()
        try:
            return run(False)
        except fallback:
            self.restore(start)
            return run(True)

    def restructure(self, name: str, value: Any) -> None:
        """Discovery: the site's value is `value`, as it leaves a lifted transform
        (stacked over a scan's iterations), not as seen inside it."""
        struct = self.arrays.abstract(value)
        for slot, site in enumerate(self.sites):
            if site is not None and site.name == name:
                added = _ndim(struct) - _ndim(site.struct)
                self.sites[slot] = dataclasses.replace(
                    site, struct=struct, stacked=site.stacked + added
                )

    @property
    def enclosing(self) -> tuple[str, ...]:
        """The paths of the calls running now, outermost first: a tap, or a
        module of another library called inside one, is named under the last."""
        return tuple(self._enclosing)

    def tap(self, name: str, value: Any) -> Any:
        """A named value inside the model's code (`bridge.tap`): the adapter's
        handler where one is installed (`tapping`), else `tap_here`."""
        if self._tap_handler is not None:
            return self._tap_handler(name, value)
        return self.tap_here(name, value)

    def tap_here(self, name: str, value: Any) -> Any:
        """A site without a module, named under the enclosing call, whose value
        is seen in the trace the session runs in."""
        path = f"{self._enclosing[-1]}/{name}" if self._enclosing else name
        return self.exit(self.enter(path, None, None), value)

    @contextlib.contextmanager
    def tapping(self, handler: Callable[[str, Any], Any]) -> Iterator[None]:
        """Within it, `bridge.tap(name, value)` calls `handler(name, value)`:
        an adapter whose taps can run inside its library's transforms hands
        the value out (or refuses it) there, then calls `tap_here`."""
        previous = self._tap_handler
        self._tap_handler = handler
        try:
            yield
        finally:
            self._tap_handler = previous

    def _apply_patch(self, name: str, patch: Any, value: Any) -> Any:
        if not callable(patch):
            new = patch
        elif self.batch_axis is None:
            new = patch(value)
        else:
            # Under the probe's vmap each example sees only itself; the contract
            # gives a patch function the whole batch: gather it, patch it, and
            # keep this example's row.
            axis = self.batch_axis
            whole = jax.tree.map(lambda v: jax.lax.all_gather(v, axis), value)
            index = jax.lax.axis_index(axis)
            new = jax.tree.map(lambda v: v[index], patch(whole))
        expected = self.arrays.abstract(value)
        if not self.arrays.fits(expected, new):
            raise patch_misfit(
                name,
                self.arrays.shapes_and_dtypes(expected),
                self.arrays.shapes_and_dtypes(new),
                function=callable(patch),
            )
        return new

    def discovered(self) -> list[Site]:
        return [site for site in self.sites if site is not None]


@dataclasses.dataclass(frozen=True)
class CarriedIn:
    """One value an adapter places in its library's variables for `site`
    (`Session.to_carry_in`): `kind` is `epsilon`, `patch`, `step` or
    `recording`."""

    site: Site
    kind: str
    value: Any

    @property
    def name(self) -> str:
        """The variable's name (`carrier_name`)."""
        site = self.site
        return carrier_name(self.kind, site.method, site.index, site.origin.tap)


class BodyTraces:
    """Where the traces of lifted bodies began, for a library that traces a
    body more than once (Flax's `nn.scan` traces its body twice, Haiku's
    `layer_stack` once per `init` and `apply` pass). A repeated trace is the
    same code, not new calls: it re-uses the names of the first, so a site
    inside it is one site, never `#1`."""

    def __init__(self, session: Session):
        self._session = session
        self._starts: dict[Hashable, Any] = {}

    def begin(self, key: Hashable) -> None:
        """A trace of body `key` begins now; a later one begins here again."""
        self._starts[key] = self._session.checkpoint()

    def again(self, key: Hashable) -> None:
        """Body `key` is traced again: forget the calls since its first began."""
        self._session.restore(self._starts[key])

    def begin_or_again(self, key: Hashable) -> None:
        """A call that starts body `key`'s trace: its first, or a repeat."""
        if key in self._starts:
            self.again(key)
        else:
            self.begin(key)

    def clear(self) -> None:
        """A new call of the transform: its body's traces are new calls."""
        self._starts.clear()

    def __iter__(self) -> Iterator[Hashable]:
        """The keys of the bodies whose traces have begun."""
        return iter(list(self._starts))


def _zero_rows(struct: Any, length: int) -> Any:
    return jax.tree.map(lambda s: jnp.zeros((length, *s.shape), s.dtype), struct)


def _ndim(struct: Any) -> int:
    leaves = [leaf for leaf in jax.tree.leaves(struct) if leaf is not None]
    return len(leaves[0].shape) if leaves else 0


def positional_arrays(args: tuple) -> tuple:
    """A call's positional arguments, array leaves kept, anything else `None`."""
    return JAX_ARRAYS.positional(args)


def tap(name: str, value: Any) -> Any:
    """Mark `value` as a site named `<enclosing module path>/<name>`.

    Outside a probe this returns `value` itself, at no cost. Inside one, the
    value is a site like a module call: selectable, patchable, with gradients.

    Example:
      >>> h = bridge.tap("pre_activation", x @ w)
    """
    session = _ACTIVE.get()
    if session is None:
        return value
    if not isinstance(name, str) or not name:
        raise BridgeTypeError(f"`name` must be a non-empty string; got {name!r}.")
    return session.tap(name, value)
