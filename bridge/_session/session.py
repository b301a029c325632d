"""The per-trace bookkeeping every adapter shares, as small parts.

An adapter reaches each submodule call with its library's own mechanism and
reports it with `session.enter` and `session.exit`. One session lives for one
trace of the model; it is found through a `ContextVar`, so two threads (or
two nested probes) never see each other's sites. It is a facade over parts
with one job each:

- `session.naming` (`Naming`, `bridge._session.naming`): names each call
  `path[.method][#k]` and knows the calls running now; `BodyTraces` makes a
  repeated trace of a lifted body re-use the first one's names;
- `session.recorder` (`bridge._session.recorders`): what the session does at a call,
  the one part that differs between a discovery (`DiscoveryRecorder`: list
  every call as a `Site`) and a run (`RunRecorder`: patch, perturb, record
  the selected sites), chosen once here; it answers the questions an
  adapter has (`learns_sites`, `needs_value`), so no adapter asks which;
- `session.carrier` (`Carrier`, `bridge._session.carrier`): bridge's values through
  a library's lifted transforms;
- `session.taps` (`Taps`, `bridge._session.taps`): `bridge.tap`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .._errors import BridgeTypeError
from .carrier import Carrier
from .jit import traced_through
from .naming import BodyTraces as BodyTraces
from .naming import Call as Call
from .naming import Naming
from .recorders import DiscoveryRecorder, Recorder, RunRecorder
from .sites import JAX_ARRAYS, Arrays, Site, SiteOrigin
from .taps import Taps

if TYPE_CHECKING:
    from .inside import Inside

_ACTIVE: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "bridge_session", default=None
)
#: The `bridge._session.inside.Inside` of the probe whose discovery or run is in
#: progress in this context (set by `bridge._session.inside`, whatever the adapter):
#: a session made meanwhile, by the core or by an adapter, looks inside with it.
INSIDE: contextvars.ContextVar[Inside | None] = contextvars.ContextVar(
    "bridge_inside", default=None
)


def current() -> Session | None:
    """The session of the probe tracing the model now, if any."""
    return _ACTIVE.get()


class Session:
    """Bookkeeping for one trace of the model.

    With `selected=None` the session discovers: it lists every call as a `Site`
    with the abstract shape of its value, and changes nothing; it is asked
    for nothing else (no epsilons, patches or inputs). Otherwise it runs:
    selected sites are recorded and, where `epsilons` has an entry, get their
    epsilon added; patched sites take their patch.

    What was asked is read by adapters: `selected` (`{name: Site}`),
    `epsilons`, `patches`, `patched` (the discovered `Site` of each patched
    site, selected or not), `with_inputs`, `batch_axis` (set when the model
    runs under the probe's own `jax.vmap`: a patch function then still sees
    the whole batch) and `arrays` (the framework's values: JAX arrays, or an
    adapter's own). `renames` (`bridge._session.naming.renames_of`): the public
    name of each call where discovery found a trace JAX discards.
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
        renames: Mapping[str, tuple[str, int]] | None = None,
    ):
        if selected is None:  # a discovery lists the sites: nothing is asked
            epsilons = patches = patched = None
            with_inputs = False
        self.selected = selected or {}
        self.epsilons = epsilons or {}
        self.patches = patches or {}
        self.patched = patched or {}
        self.with_inputs = with_inputs
        self.batch_axis = batch_axis
        self.arrays = arrays
        self.naming = Naming(renames)
        self.recorder: Recorder = (
            DiscoveryRecorder(self) if selected is None else RunRecorder(self)
        )
        self.carrier = Carrier(self)
        self.taps = Taps(self)
        # The probe's `bridge._session.inside.Inside`, from the core (`INSIDE`).
        self.inside: Inside | None = INSIDE.get()
        # `enter` and `exit` run at every call of the model: bound once.
        self._name_call = self.naming.enter
        self._close_call = self.naming.exit
        self._entered = self.recorder.entered
        self._exited = self.recorder.exited

    @contextlib.contextmanager
    def active(self) -> Iterator[Session]:
        """The session of the model's calls while it runs: the model's own
        `jax.jit`s run inline (`bridge._session.jit`), and the probe's `inside`
        rewrites are in place (`bridge._session.inside`), both undone on leaving."""
        token = _ACTIVE.set(self)
        try:
            with traced_through():
                if self.inside is None:
                    yield self
                else:
                    with self.inside.applied():
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

        With `record=False` the adapter records the inputs itself (see the
        carrier): values seen inside a lifted transform are tracers of its
        inner trace and must leave it through the library's own outputs.
        """
        call = self._name_call(path, method, module, origin)
        self._entered(call, args, record)
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
            adapter hands it over later through the carrier (see `enter`).
          patch: this call's patch value where the adapter holds it rather
            than the session: one iteration's row of a stacked patch value
            inside a scan, carried in by the library's own mechanism.
        """
        self._close_call()
        return self._exited(call, value, perturb, record, patch)

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

    def discovered(self) -> list[Site]:
        """The sites a discovery found, in call-entry order."""
        return self.recorder.discovered()

    def checkpoint(self) -> tuple[Any, Any, Any]:
        """The naming state now, to `restore` when a library traces a body
        again (see `BodyTraces`): the names given, the sites listed, the
        values deferred."""
        return (
            self.naming.checkpoint(),
            self.recorder.checkpoint(),
            self.carrier.checkpoint(),
        )

    def restore(self, checkpoint: tuple[Any, Any, Any]) -> None:
        """Forget the calls since `checkpoint`: they were an earlier trace of the
        same code (Flax traces a lifted body more than once), not new calls."""
        naming, recorder, carrier = checkpoint
        self.naming.restore(naming)
        self.recorder.restore(recorder)
        self.carrier.restore(carrier)


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
    session = _ACTIVE.get()
    if session is None:
        return value
    if not isinstance(name, str) or not name:
        raise BridgeTypeError(f"`name` must be a non-empty string; got {name!r}.")
    return session.taps.tap(name, value)
