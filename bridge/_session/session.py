"""The per-trace bookkeeping every adapter shares, as small parts.

An adapter reaches each submodule call with its library's own mechanism and
reports it with `session.enter` and `session.exit`. One session lives for one
trace of the model; it is found through `bridge._session.context`, so two
threads (or two nested probes) never see each other's sites. What the trace
is asked to do is one record, the `Request`; the session is a facade over
parts with one job each, made from the request and holding no reference
back to the session:

- `session.naming` (`Naming`, `bridge._session.naming`): names each call
  `path[.method][#k]` and knows the calls running now;
- `session.recorder` (`bridge._session.recorders`): what the session does at
  a call, the one part that differs between a discovery (`DiscoveryRecorder`:
  list every call as a `Site`) and a run (`RunRecorder`: patch, perturb,
  record the selected sites), chosen once here; it answers the questions an
  adapter has (`learns_sites`, `needs_value`), so no adapter asks which;
- `session.taps` (`Taps`, `bridge._session.taps`): the adapter's route for
  `bridge.tap`.

What needs more than one part is the session's own: `enter`/`exit`,
`tap_here`, `checkpoint`/`restore`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .._errors import BridgeTypeError
from . import backward, context
from .naming import Call as Call
from .naming import Naming
from .recorders import DiscoveryRecorder, Recorder, RunRecorder
from .sites import (
    JAX_ARRAYS,
    Arrays,
    Site,
    SiteOrigin,
)
from .taps import Taps

if TYPE_CHECKING:
    from .inside import Inside

_EMPTY: Mapping[str, Any] = types.MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class Request:
    """What one trace of the model is asked to do, made by the core.

    With `selected=None` the trace discovers: it lists every call as a
    `Site` with the abstract shape of its value, and changes nothing; it is
    asked for nothing else (no epsilons, patches or inputs). Otherwise it
    runs: selected sites are recorded and, where `epsilons` has an entry,
    get their epsilon added; patched sites take their patch.

    Attributes:
      selected: `{name: Site}` of the sites to record, or `None`: discover.
      epsilons: `{name: epsilon}` for the selected sites that get one.
      patches: `{name: value or function}`.
      patched: the discovered `Site` of each patched site, selected or not.
      with_inputs: whether to record the selected calls' positional inputs;
        in a discovery, whether to mark every call's (for such runs).
      batch_axis: the axis name where the model runs under the probe's own
        `jax.vmap` (a patch function still sees the whole batch), else `None`.
      arrays: the framework's values (JAX arrays, or an adapter's own).
      renames: the public name of each call where discovery found a trace
        JAX discards (`bridge._session.naming.renames_of`).
      inside: the probe's `bridge._session.inside.Inside`: by default the one
        the core set in this context (`bridge._session.context.INSIDE`), for
        a request made by any adapter.
      control_flow_recorders: `{name: recorders}` of the selected sites
        whose values leave through the backward pass: inside branches and
        loops, and an adapter's own route (`SiteOrigin.backward_recorders`;
        `bridge._session.backward`).
      planted: the selected and patched sites the computation routes
        (`bridge._session.computation`): the session marks them, and the
        jaxpr of the trace acts on them.
    """

    selected: Mapping[str, Site] | None = None
    epsilons: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    patches: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    patched: Mapping[str, Site] = dataclasses.field(default_factory=dict)
    with_inputs: bool = False
    batch_axis: str | None = None
    arrays: Arrays = JAX_ARRAYS
    renames: Mapping[str, tuple[str, int]] | None = None
    inside: Inside | None = dataclasses.field(default_factory=context.INSIDE.get)
    control_flow_recorders: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    planted: frozenset[str] = frozenset()

    def __post_init__(self):
        if self.selected is None:  # a discovery lists the sites: nothing is asked
            for name in ("epsilons", "patches", "patched"):
                object.__setattr__(self, name, {})

    @property
    def discovering(self) -> bool:
        return self.selected is None

    def as_adapters_see_it(self) -> Request:
        """This request without the sites the computation routes (`planted`),
        which are the core's: no route of an adapter's takes them."""
        if not self.planted:
            return self
        planted = self.planted

        def kept(asked: Mapping[str, Any] | None) -> dict[str, Any] | None:
            if asked is None:
                return None
            return {name: v for name, v in asked.items() if name not in planted}

        return dataclasses.replace(
            self,
            selected=kept(self.selected),
            epsilons=kept(self.epsilons),
            patches=kept(self.patches),
            patched=kept(self.patched),
        )

    def patch_values(self) -> dict[str, Any]:
        """The patches given as values (not functions): a `vmap`ped run maps
        them with the inputs."""
        return {k: v for k, v in self.patches.items() if not callable(v)}

    def varied(
        self,
        epsilons: Mapping[str, Any],
        patch_values: Mapping[str, Any],
        control_flow_recorders: Mapping[str, Any] | None = None,
    ):
        """This request with the epsilons, patch values and control-flow
        recorders one trace sees (under the probe's `jax.vmap`: one
        example's)."""
        functions = {k: v for k, v in self.patches.items() if callable(v)}
        return dataclasses.replace(
            self,
            epsilons=epsilons,
            patches={**patch_values, **functions},
            control_flow_recorders=control_flow_recorders or {},
        )


class Session:
    """Bookkeeping for one trace of the model, asked for by `request`.

    What was asked is read by adapters as attributes of the session:
    `selected`, `epsilons`, `patches`, `patched`, `with_inputs`,
    `batch_axis`, `arrays`, `inside` (see `Request`).
    """

    def __init__(self, request: Request | None = None):
        request = Request() if request is None else request
        self.request = request
        self.naming = Naming(request.renames)
        self.recorder: Recorder = (
            DiscoveryRecorder(request.arrays, mark_inputs=request.with_inputs)
            if request.discovering
            else RunRecorder(request)
        )
        self._seen = request.as_adapters_see_it()
        self.taps = Taps()
        # `enter` and `exit` run at every call of the model: bound once.
        self._name_call = self.naming.enter
        self._close_call = self.naming.exit
        self._entered = self.recorder.entered
        self._exited = self.recorder.exited

    # -- what was asked ------------------------------------------------------

    # A site the computation routes is the core's (`Request.planted`): what
    # an adapter reads of the request leaves it out (`Request.as_adapters_see_it`),
    # so no route of the adapter's takes it; the recorder marks it where the
    # adapter reports it.

    @property
    def selected(self) -> Mapping[str, Site]:
        return self._seen.selected or _EMPTY

    @property
    def epsilons(self) -> Mapping[str, Any]:
        return self._seen.epsilons

    @property
    def patches(self) -> Mapping[str, Any]:
        return self._seen.patches

    @property
    def patched(self) -> Mapping[str, Site]:
        return self._seen.patched

    @property
    def with_inputs(self) -> bool:
        return self.request.with_inputs

    @property
    def batch_axis(self) -> str | None:
        return self.request.batch_axis

    @property
    def arrays(self) -> Arrays:
        return self.request.arrays

    @property
    def inside(self) -> Inside | None:
        return self.request.inside

    # -- the model's calls -------------------------------------------------------

    @contextlib.contextmanager
    def active(self) -> Iterator[Session]:
        """The session of the model's calls while it runs, with the probe's
        `inside` rewrites in place (`bridge._session.inside`), undone on
        leaving. No function of JAX's is replaced: where a call runs, and a
        trace JAX cached, the core reads from the computation."""
        with context.active(self):
            if self.inside is None:
                yield self
            else:
                with self.inside.applied():
                    yield self

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

        With `record=False` the session records neither the inputs nor the
        value: the call's site is recorded otherwise (the backward pass of
        `call_in_control_flow`), or not at all.
        """
        call = self._name_call(path, method, module, origin)
        self._entered(call, args, record)
        return call

    def call_in_control_flow(
        self,
        path: str,
        method: str | None,
        module: Any,
        args: tuple,
        flow: backward.ControlFlow,
        run: Callable[[], Any],
        origin: SiteOrigin | None = None,
    ) -> Any:
        """The call `run()` inside branches and loops of static bounds only
        (`flow`, read by the adapter), as a site: its epsilon and patch
        value are closed over (a loop's iteration takes its row), its value
        and inputs leave through the backward pass, with where it ran
        (`bridge._session.backward.call_in_control_flow`). It holds every
        iteration of the loops around it. `origin`: the adapter's own, kept
        as the `InControlFlow`'s `inner`."""
        return backward.call_in_control_flow(
            self, path, method, module, args, flow, run, origin
        )

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
          record: whether the session records the value (see `enter`).
          patch: this call's patch value where the caller holds it rather
            than the session (a loop's row, in `call_in_control_flow`).
        """
        self._close_call()
        return self._exited(call, value, perturb, record, patch)

    def tap(self, name: str, value: Any) -> Any:
        """`bridge.tap(name, value)`: through the adapter's route where it
        installed one (`taps.tapping`), else `tap_here`."""
        route = self.taps.route
        return self.tap_here(name, value) if route is None else route(name, value)

    def tap_here(self, name: str, value: Any) -> Any:
        """A site without a module, named under the enclosing call, whose value
        is seen in the trace the session runs in."""
        path = self.naming.under_enclosing(name)
        return self.exit(self.enter(path, None, None), value)

    def check_reached(self) -> None:
        """After the model's call: raise where a selected or patched site was
        never reached (`Recorder.check_reached`)."""
        self.recorder.check_reached()

    @property
    def enclosing(self) -> tuple[str, ...]:
        """The paths of the calls running now, outermost first: a tap, or a
        module of another library called inside one, is named under the last."""
        return self.naming.enclosing

    @property
    def activations(self) -> dict[str, Any]:
        """`{site: value}` recorded so far (none at discovery)."""
        return self.recorder.activations

    @property
    def inputs(self) -> dict[str, tuple]:
        """`{site: positional inputs}` recorded so far, with `with_inputs`."""
        return self.recorder.inputs

    @property
    def ran(self) -> dict[str, Any]:
        """`{site: where its call ran}` of the sites recorded inside a branch
        or a while loop (`ProbeResult.ran`)."""
        return self.recorder.ran

    def discovered(self) -> list[Site]:
        """The sites a discovery found, in call-entry order."""
        return self.recorder.discovered()


def current() -> Session | None:
    """The session of the probe tracing the model now, if any."""
    return context.current()


def positional_arrays(args: tuple) -> tuple:
    """A call's positional arguments, array leaves kept, anything else `None`."""
    return JAX_ARRAYS.positional(args)


def tap(name: str, value: Any) -> Any:
    """Mark `value` as a site named `<enclosing module path>/<name>`.

    Outside a probe this returns `value` itself, at no cost. Inside one, the
    value is a site like a module call: selectable, patchable, with gradients.

    Examples:
      >>> h = bridge.tap("pre_activation", x @ w)
    """
    session = context.current()
    if session is None:
        return value
    if not isinstance(name, str) or not name:
        raise BridgeTypeError(f"`name` must be a non-empty string; got {name!r}.")
    return session.tap(name, value)
