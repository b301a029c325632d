"""Linen sites inside Flax's lifted transforms (`nn.scan`, `nn.vmap`,
`nn.remat`, `nn.jit`, `nn.cond`, ...).

Lifted transforms run their body in a scope root of their own, and values seen
there are tracers of the transform's inner trace: recordings leave through a
mutable collection, as Flax's own `sow` does. `nn.remat` and `nn.jit` carry
every collection. `nn.scan` and `nn.vmap` carry only those their
`variable_axes` name — users name `params`, never a perturbation collection,
and an unnamed one is silently dropped — so inside them the epsilons and
recordings ride with the parameters, under reserved names
(`bridge.adapters.linen.variables`).

Flax traces a lifted body more than once: a repeated trace re-uses the names
of the first (`entering_linen_lifted_scope`, shared with Linen's guest). How
a call there reaches its site, the router decides
(`bridge.adapters.linen.routes`): carried through bridge's collections,
through the session's control-flow route (`nn.cond`, `nn.switch` alone), or
refused (inside `nn.while_loop`, a branch inside another lifted transform,
an `nn.scan`/`nn.vmap` that broadcasts `params`, as `nn.RNN` does).
A transform that broadcasts `params` is found by discovery: recording a call
inside it among the parameters, Flax refuses a broadcast variable that
depends on the loop (`internals.broadcasting` reads which transform from
its error), and discovery runs again with that transform's traces known
(`Broadcasts`, `LiftedTransforms.broadcast_traces`).

Which lifted transform's call a trace belongs to is read off the Python call
stack (`internals.transform_call`). What this reads of Flax's internals is in
`internals.py`.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

from bridge.adapter_api import (
    BodyTraces,
    BridgeValueError,
    Rule,
    Session,
    Transform,
    route,
)

from ..shared import jax_internals
from .internals import transform_call
from .variables import Origin


def entering_linen_lifted_scope(
    bodies: BodyTraces, module: Any, method: str, body: Any = None
) -> str | None:
    """A Linen call in a new scope root (inside a lifted transform), whose
    parent frame holds `bodies`. A lifted transform's own module (`ScanBlock`,
    scope path `()`) is called before its body runs: it starts a new call of
    the body, and its transform's name is returned. A body's first call
    starts its trace, first or repeated (Flax traces a body more than once).
    In `nn.scan(nn.remat(Block))` the scan's body is the own module of the
    remat, `CheckpointBlock`, a base class of `ScanCheckpointBlock`: it is
    traced again as any body is, not a new call. A functional transform
    (`nn.scan(f)(self, x)`) has no module of its own: each trace of its body
    starts with a call of a clone of `self` at path `()`, a new trace of the
    same call while the transform's call (`transform_call`) is the same; the
    clone's `setup` before each trace starts nothing."""
    key = (module.path, module.name, method, type(module), body)
    call = transform_call()
    if call is not None and module.path == () and method == "setup":
        # A functional transform sets up its module's clone before each trace
        # of each body (every branch of an `nn.cond`): what starts a trace is
        # the call that follows.
        return linen_transform_name(module)
    if (
        module.path == ()
        and not any(
            started[0] == () and issubclass(started[3], type(module))
            for started in bodies
            if started[3] is not type(module)
        )
        and (call is None or _CALLS.get(bodies) is not call)
    ):
        bodies.clear()
        bodies.begin(key)
        if call is not None:
            _CALLS[bodies] = call
        return linen_transform_name(module)
    bodies.begin_or_again(key)
    return linen_transform_name(module) if module.path == () else None


def body_of(context: Any) -> Any:
    """The function an intercepted Linen call runs (`context.orig_method`),
    unwrapped from the partial and the bound method Flax makes of it for each
    trace: what tells the branches of one `nn.cond` apart, and is the same in
    each trace of one body."""
    function = getattr(context, "orig_method", None)
    function = getattr(function, "func", function)
    return getattr(function, "__func__", function)


def runs_lifted_function(context: Any) -> bool:
    """Whether an intercepted Linen call runs a function a lifted transform was
    given rather than a method of the module: `nn.RNN`'s `scan_fn`, the body
    of `nn.scan(f)`, `nn.vmap(f)`, `nn.remat(f)`, `nn.jit(f)` or
    `nn.map_variables(f)`, the branches of `nn.cond` and `nn.switch`, the
    functions of `nn.while_loop`. Flax calls such a function as a method of
    the module it hands it (`nn.intercept_methods` sees
    `OptimizedLSTMCell_0.scan_fn`), but it is the transform's function, not a
    call of the module's: no site, while the calls it makes are. A method of
    the module's class called through a lifted transform (`@nn.remat` on
    `__call__`, `nn.scan(Cell.__call__)`) is a site as ever.

    A method is what the class holds under the call's name, or a function
    one of the class's attributes wraps, through `__wrapped__` (Flax's
    method wrappers and lifted decorators set it): a user's decorator may
    give the function it returns a name of its own (`inner`). Flax calls a
    function of no class as a method only in its lifted transforms (and in
    its check of a `setup`, at path `()`, which is no site)."""
    cls = type(context.module)
    if callable(inspect.getattr_static(cls, context.method_name, None)):
        return False
    function = body_of(context)
    for name in dir(cls):
        attribute = inspect.getattr_static(cls, name, None)
        seen = set()  # a wrapper chain that loops back ends there
        while attribute is not None and id(attribute) not in seen:
            if attribute is function:
                return False
            seen.add(id(attribute))
            attribute = getattr(attribute, "__wrapped__", None)
    return True


#: The Python frame of the lifted transform's call each `BodyTraces` saw begin
#: last (kept alive, so that no later call's frame takes its id).
_CALLS: weakref.WeakKeyDictionary[BodyTraces, Any] = weakref.WeakKeyDictionary()


_LINEN_TRANSFORMS = {
    "Scan": "nn.scan",
    "Vmap": "nn.vmap",
    "Checkpoint": "nn.remat",
    "Jit": "nn.jit",
    "While_loop": "nn.while_loop",
    "Map_variables": "nn.map_variables",
}


def linen_transform_name(module: Any) -> str:
    """`ScanBlock` (the class `nn.scan(Block)` makes) -> `nn.scan`."""
    name = type(module).__name__
    for prefix, transform in _LINEN_TRANSFORMS.items():
        if name.startswith(prefix):
            return transform
    return "a Flax lifted transform"


class Broadcasts(Exception):
    """Discovery, recording in `params`, met a lifted transform that
    broadcasts them (`nn.RNN`'s `nn.scan`, an `nn.vmap` with
    `variable_axes={'params': None}`): Flax refuses a broadcast variable that
    depends on the loop. Discovery runs again with the calls inside it listed
    as refused sites, and the others as before."""

    def __init__(self, key: tuple, transform: str):
        super().__init__(key, transform)
        self.key = key
        self.transform = transform


#: Why a call inside a lifted transform that carries neither bridge's
#: collections nor `params` cannot be a site.
CARRIES_NEITHER = (
    "it carries neither bridge's collections nor `params`, so a perturbation "
    "there would be silently dropped"
)


def carrying_neither(name: str) -> Transform:
    """Flax's lifted transform `name` where it carries neither bridge's
    collections nor `params`."""
    return Transform(name, Rule.BLOCKS, CARRIES_NEITHER)


class LiftedTransforms:
    """The lifted transforms of one Linen `apply`: which one a call is inside,
    and which broadcast `params`.

    `broadcasting` is `{transform: its name}` of the transforms known to
    broadcast `params` (`Broadcasts`), learnt by discovery.
    """

    def __init__(
        self, session: Session, in_params: bool, broadcasting: dict[tuple, str]
    ):
        self.session = session
        self.in_params = in_params
        #: The name of the lifted transform entered last.
        self.transform = "a Flax lifted transform"
        # The transforms known to broadcast `params` (`Broadcasts`), and the
        # traces of their bodies now, by id (the trace kept alive).
        self.broadcasting = broadcasting
        self.broadcast_traces: dict[int, tuple[Any, str, tuple]] = {}
        # The traces the lifted transforms' bodies run in, by id (kept
        # alive): what runs inside one of them in a trace of its own is
        # JAX's transform of the model's code, not Flax's.
        self.body_traces: dict[int, Any] = {}

    def entering(self, parent: Any, module: Any, method: str, body: Any) -> None:
        """A call in a new scope root, inside a lifted transform, made from the
        call of `parent` (a `run.Frame`)."""
        transform = entering_linen_lifted_scope(parent.bodies, module, method, body)
        if transform is not None:
            self.transform = transform
        # Which of `parent`'s lifted transform calls this is: a functional
        # transform's module is of the class of the module it was given
        # (`nn.remat(f)(self, x)` and `nn.vmap(g)(self, x)` both run a clone
        # of `self`), so only the order tells them apart; a repeated trace of
        # one call is the same transform.
        call = transform_call()
        if call is None:
            index = len(parent.entered)
        else:
            index = next((i for i, c in enumerate(parent.calls) if c is call), None)
            if index is None:
                index = len(parent.calls)
                parent.calls.append(call)
        key = (parent.path, type(module).__qualname__, index)
        parent.entered.append(key)
        trace = jax_internals.current_trace()
        self.body_traces[id(trace)] = trace
        broadcast = self.broadcasting.get(key)
        if broadcast is not None:
            self.broadcast_traces[id(trace)] = (trace, broadcast, key)

    def broadcasting_around(self, traces: Any) -> tuple[tuple, str] | None:
        """`(key, name)` of the innermost transform known to broadcast
        `params` among `traces` (innermost first): what a run must know to
        route a call there as discovery did (`Origin.broadcast`)."""
        for trace in traces:
            found = self.broadcast_traces.get(id(trace))
            if found is not None:
                return found[2], found[1]
        return None

    def uncarried(self, path: tuple[str, ...], tap: str | None) -> None:
        """A call (or a tap) at `path` in a transform that carries neither
        bridge's collections nor `params` (mutable): discovery runs again with
        recordings in `params`; a site of it to leave the transform raises."""
        session = self.session
        if not self.in_params:
            session.recorder.fall_back()  # discovery: again, in `params`
        # A site of this module (or this tap of its) is to leave it: the
        # taps of a functional transform's clone of the model all have
        # scope `()`, so a tap is told by its name.
        if session.carrier.carries_out_any(
            lambda site: (
                isinstance(site.origin, Origin)
                and site.origin.scope == path
                and site.origin.tap == tap
            )
        ):
            where = "/".join(path if tap is None else (*path, tap))
            refused = route(where, (carrying_neither(self.transform),))
            raise BridgeValueError(refused.sentence)
