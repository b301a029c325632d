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
of the first (`entering_linen_lifted_scope`, shared with Linen's guest). The
calls bridge cannot express there are listed and refused only where selected
or patched (`LiftedTransforms.refused`, see
`bridge.adapters.shared.unexpressible`): inside `nn.while_loop`, a branch
inside another lifted transform, or an `nn.scan`/`nn.vmap` that broadcasts
`params` (`nn.RNN`). `nn.cond` and `nn.switch` alone are sites of the
session's control-flow route, in discovery and in a run alike
(`LiftedTransforms.in_control_flow`).
Such a transform is found by discovery: recording a call inside it among the
parameters, Flax refuses a broadcast variable that depends on the loop
(`internals.broadcasting` reads which transform from its error), and
discovery runs again with that transform's calls refused (`Broadcasts`).

Which lifted transform's call a trace belongs to is read off the Python call
stack (`internals.transform_call`). What this reads of Flax's internals is in
`internals.py`.
"""

from __future__ import annotations

import weakref
from typing import Any

from bridge.adapter_api import (
    BRANCH,
    UNBOUNDED_LOOP,
    BodyTraces,
    BridgeValueError,
    Session,
    refusal,
)

from ..shared import jax_internals, unexpressible
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


#: Why a site inside each transform cannot be expressed, and what to do.
REFUSALS = {
    "nn.scan": (
        "it broadcasts `params` (variable_broadcast='params', as nn.RNN "
        "does), so one epsilon would serve every iteration and their "
        "gradients would be summed",
        "scan over stacked layers (variable_axes={'params': 0}), or unroll the loop",
    ),
    "nn.vmap": (
        "it broadcasts `params` (variable_axes={'params': None}), so one "
        "epsilon would serve every mapped example and their gradients would "
        "be summed",
        "probe the unmapped model with bridge.probe(..., vmap=True)",
    ),
    "nn.while_loop": (
        UNBOUNDED_LOOP,
        "write the loop as an nn.scan of fixed length",
    ),
    "nn.cond": (
        BRANCH,
        "compute both branches and pick with jnp.where",
    ),
    "nn.switch": (
        BRANCH,
        "compute every branch and pick with jnp.where",
    ),
}


#: JAX's names of the loops and branches (`unexpressible.LOOPS_AND_BRANCHES`)
#: as Linen's lifted transforms.
LINEN_NAMES = {"while_loop": "nn.while_loop", "cond": "nn.cond", "switch": "nn.switch"}


class LiftedTransforms:
    """The lifted transforms of one Linen `apply`: which one a call is inside,
    which broadcast `params`, and the calls inside them that bridge cannot
    express.

    `broadcasting` is `{transform: its name}` of the transforms known to
    broadcast `params` (`Broadcasts`), learnt by discovery; `base` and
    `stop` are the trace and the Python frame of the probe's `apply`.
    """

    def __init__(
        self,
        session: Session,
        in_params: bool,
        broadcasting: dict[tuple, str],
        base: Any,
        stop: Any,
    ):
        self.session = session
        self.in_params = in_params
        self.base = base
        self.stop = stop
        #: The name of the lifted transform entered last.
        self.transform = "a Flax lifted transform"
        # The transforms known to broadcast `params` (`Broadcasts`), and the
        # traces of their bodies now, by id (the trace kept alive).
        self.broadcasting = broadcasting
        self.broadcast_traces: dict[int, tuple[Any, str]] = {}

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
        broadcast = self.broadcasting.get(key)
        if broadcast is not None:
            trace = jax_internals.current_trace()
            self.broadcast_traces[id(trace)] = (trace, broadcast)

    def blocked(self, lifted: bool, module: Any, carried: bool) -> str | None:
        """The transform that holds a call (of a module in a `lifted` scope)
        where bridge cannot express it (innermost first: a loop, a branch, a
        transform broadcasting `params`, one that carries neither bridge's
        collections nor `params`), or `None`. Asked by discovery and by a run
        alike: inside branches and loops of static bounds only, both hand the
        call to the session's control-flow route (`in_control_flow`);
        elsewhere discovery lists it as refused (`refused`), and a run never
        selects or patches it. A run knows no transform broadcasting
        `params`, whose scan or vmap holds no call of that route anyway."""

        def broadcasting(trace: Any) -> str | None:
            found = self.broadcast_traces.get(id(trace))
            return None if found is None else found[1]

        transform = unexpressible.innermost_loop_or_branch(self.base, broadcasting)
        if transform is not None:
            return LINEN_NAMES.get(transform, transform)
        if (
            lifted
            and not carried
            and self.in_params
            and not module.is_mutable_collection("params")
        ):
            return self.transform
        return None

    def in_control_flow(self, run, call_args, module, method, path, tap, flow):
        """A call (or a `bridge.tap` named `tap`) inside branches and loops of
        static bounds only (`flow`: `nn.cond`, `nn.switch`, JAX's own and
        `lax.fori_loop`), in discovery and in a run alike: a site of the
        session's control-flow route, whose epsilon the branch closes over
        and whose value leaves through the backward pass, not through
        bridge's collections (which a branch that does not call it would
        not write)."""
        return self.session.call_in_control_flow(
            "/".join(path if tap is None else (*path, tap)),
            None if method == "__call__" else method,
            module if tap is None else None,
            call_args,
            flow,
            run,
            Origin(path, tap=tap),
        )

    def refused(self, run, call_args, module, method, path, tap, transform):
        """A call bridge cannot express inside `transform`, outside branches
        and loops of static bounds (`in_control_flow`): listed with its whole
        value, run as it is (see `bridge.adapters.shared.unexpressible`)."""
        session = self.session
        call = session.enter(
            "/".join(path if tap is None else (*path, tap)),
            None if method == "__call__" else method,
            module if tap is None else None,
            call_args,
            origin=Origin(path, tap=tap),
            record=False,
        )
        why, fix = REFUSALS.get(
            transform,
            (
                "it carries neither bridge's collections nor `params`, so a "
                "perturbation there would be silently dropped",
                "move the call out of it",
            ),
        )
        call.origin = Origin(
            path, tap=tap, blocked=refusal(call.name, transform, why, fix)
        )
        return unexpressible.listed(session, call, run(), self.base, self.stop)

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
            raise BridgeValueError(
                f"bridge cannot see through {self.transform} around "
                f"'{where}': it carries neither bridge's collections "
                "nor `params`, so a perturbation there would be silently "
                "dropped. Select sites outside it."
            )
