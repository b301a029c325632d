"""One run of a Linen model: every submodule method call of its `apply`,
reported to the session by an interceptor (`nn.intercept_methods`), from
where it runs.

At a selected call the interceptor calls the module's own `perturb` on its
output, reading the epsilon from bridge's variables
(`bridge.adapters.linen.variables`). A call inside Flax's lifted transforms
runs in a scope root of their own (`bridge.adapters.linen.transforms`); one
inside the model's own JAX transforms, outside those, is handed out of its
`jax.vmap`s (`bridge.adapters.linen.jax_transforms`). The router decides
which (`bridge.adapters.linen.routes`): one inside branches and loops of
static bounds only (`nn.cond`, `nn.switch`, JAX's own), in discovery and in
a run alike, is a site of the session's control-flow route
(`Session.call_in_control_flow`); one it refuses is listed.
An `apply` the model makes itself (a tied LM head's) is a scope root too,
whose calls are named under the module that makes it.

Modules of other libraries called inside the model — the NNX module an
`nnx.bridge.ToLinen` builds, an `hk.transform`ed function's `apply` — are
sites named under the Linen site that calls them
(`bridge.adapters.shared.guests`). A `ToLinen`'s own epsilon is the
session's outside lifted transforms: it hands every variable of its scope
to the NNX module it builds.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn

from bridge.adapter_api import BodyTraces, Mapped, Refused, Session, ThroughControlFlow

from ..shared import guests, jax_internals, unexpressible
from . import internals, transforms
from .jax_transforms import JaxTransforms
from .routes import Routes
from .transforms import LiftedTransforms, body_of, runs_lifted_function
from .variables import (
    EPSILON_COLLECTION,
    RECORDING_COLLECTION,
    Origin,
    patch_in_params,
    perturbation,
    record_in_scope,
)


def _is_nested_apply(module: Any) -> bool:
    """Whether a module's call starts an `apply` (or `bind`) the model makes
    itself, `self.lm_head.apply({"params": ...}, x)` as a tied LM head does:
    a fresh scope root whose module keeps its name. A lifted transform's own
    module (`ScanBlock`) has one too, but its class is made by
    `flax.linen.transforms`."""
    scope = module.scope
    return (
        module.name is not None
        and scope.path == ()
        and getattr(scope, "debug_path", None) == ()
        and type(module).__module__ != nn.transforms.__name__
    )


class Frame:
    """One active method call, as the interceptor sees it."""

    def __init__(
        self, module: Any, root: Any, path: tuple[str, ...], bodies: BodyTraces
    ):
        self.module = module
        self.root = root  # the scope root the call runs in
        self.path = path  # the module's path in the model
        self.bodies = bodies  # lifted bodies traced from this call
        self.entered: list[tuple] = []  # the lifted transforms it entered
        # The Python frames of the lifted transforms' calls it made, in order
        # (`transform_call`): the transform a key names is its n-th.
        self.calls: list[Any] = []


class Interceptor:
    """Reports every submodule call of one `apply` to the session.

    Flax traces some lifted bodies more than once (`nn.scan` twice); a repeated
    trace of the same body re-uses the names of the first, so a scanned site is
    one site, never `#1`. `in_params`: recordings inside lifted transforms
    ride among the parameters; `broadcasting`: the lifted transforms known to
    broadcast `params` (`transforms.Broadcasts`); `stop`: the Python frame of
    the probe's `apply`.
    """

    def __init__(
        self,
        session: Session,
        in_params: bool,
        broadcasting: dict[tuple, str],
        stop: Any,
    ):
        self.session = session
        self.in_params = in_params
        self.stack: list[Frame] = []
        # The trace of the probe's `apply`: the model's own transforms run
        # between here and there.
        base = jax_internals.current_trace()
        self.base = base
        self.lifted = LiftedTransforms(session, in_params, broadcasting)
        self.routes = Routes(session, self.lifted, base, stop)
        self.jax = JaxTransforms(session, self.routes)
        # The scope roots of `apply`s the model makes itself, by id: the root
        # (kept alive, so that its id is not reused) and the path its module
        # has in the model.
        self.nested: dict[int, tuple[Any, tuple[str, ...]]] = {}

    def __call__(self, next_fun, call_args, call_kwargs, context):
        module, method = context.module, context.method_name
        parent = self.stack[-1] if self.stack else None
        root = module.scope.root
        if parent is not None and root is not parent.root:
            if not self._lifted(parent) and _is_nested_apply(module):
                self.nested[id(root)] = (root, (*parent.path, module.name))
            elif id(root) not in self.nested:
                self.lifted.entering(parent, module, method, body_of(context))
        _, prefix = self.nested.get(id(root), (None, ()))
        path = (*prefix, *module.path)
        frame = Frame(module, root, path, BodyTraces(self.session))
        self.stack.append(frame)
        try:
            return self._call(
                next_fun,
                call_args,
                call_kwargs,
                module,
                method,
                frame,
                runs_lifted_function(context),
            )
        except ValueError as error:
            # Flax refuses, after tracing a lifted body, a recording in
            # broadcast `params`: the transform this call entered last.
            transform = internals.broadcasting(error) if self.in_params else None
            if transform is None or not frame.entered:
                raise
            raise transforms.Broadcasts(frame.entered[-1], transform) from error
        finally:
            self.stack.pop()

    def _call(
        self, next_fun, call_args, call_kwargs, module, method, frame, lifted_function
    ):
        def run():
            return guests.call_module("linen", module, next_fun, call_args, call_kwargs)

        if (
            frame.path == ()
            or method == "setup"
            or (method.startswith("_") and method != "__call__")
            # `nn.RNN`'s `scan_fn`, an `nn.cond` branch: the transform's
            # function, not the module's call (its frame still names the
            # `bridge.tap`s made in it).
            or lifted_function
        ):
            return run()  # a root `nnx.bridge.ToLinen`'s NNX submodules are sites
        return self._site(run, call_args, module, method, frame)

    def tap(self, name: str, value: Any) -> Any:
        """`bridge.tap` in the model's code. Inside a lifted transform it is a
        site of the calling module's, carried out and perturbed through its
        scope as the module's own calls are (a value there belongs to the
        transform's trace); elsewhere the session's own."""
        if not self.stack or not self._lifted(self.stack[-1]):
            scope = self.stack[-1].path if self.stack else ()
            return self.jax.tap(name, value, scope)
        frame = self.stack[-1]
        return self._site(lambda: value, (), frame.module, "__call__", frame, name)

    def _lifted(self, frame: Frame) -> bool:
        """Whether `frame`'s call runs inside a lifted transform: in a scope
        root other than the model's and its own `apply`s'."""
        return frame.root is not self.stack[0].root and id(frame.root) not in (
            self.nested
        )

    def lifted_transform(self) -> str | None:
        """The lifted transform the call running now is inside, if any: where a
        module of another library called there cannot be a site."""
        if self.stack and self._lifted(self.stack[-1]):
            return self.lifted.transform
        return None

    def _site(self, run, call_args, module, method, frame, tap=None):
        """The call `run()` of `module`'s `method` as a site; a `bridge.tap`
        named `tap` inside the call of `frame`."""
        session = self.session
        path = frame.path
        lifted = self._lifted(frame)
        carried = not lifted or module.is_mutable_collection(RECORDING_COLLECTION)
        if not lifted:
            self.jax.scan_bodies.traced()
        in_params = not carried and self.in_params
        name = "/".join(path if tap is None else (*path, tap))
        shown = None if method == "__call__" else method
        carries_none = in_params and not module.is_mutable_collection("params")
        enclosing = self.routes.enclosing(lifted, carries_none)
        given = id(frame.root) in self.nested
        found = self.routes.route(name, enclosing, lifted)
        if isinstance(found, Refused) and lifted:
            if internals.in_invariants_pass():
                # Flax's pass over an nn.scan's body before the scan, whose
                # values it discards: the scan's own trace of the body lists
                # or routes the call.
                return run()
            # Where no carrier takes the call (a branch in a scanned stack),
            # the nn.scans around it, counting their iterations, may still be
            # loops of known bounds around it.
            looped = self.routes.enclosing(lifted, carries_none, scans_loop=True)
            if looped != enclosing:
                again = self.routes.route(name, looped, lifted)
                if isinstance(again, ThroughControlFlow):
                    found = again
        match found:
            case ThroughControlFlow(flow=flow):
                # In discovery and in a run alike: a run that took the lifted
                # route instead would look for an epsilon bridge's collection
                # does not hold, and write recordings in one branch only.
                broadcast = self.lifted.broadcasting_around(
                    unexpressible.traces(self.routes.base)
                )
                return session.call_in_control_flow(
                    name,
                    shown,
                    module if tap is None else None,
                    call_args,
                    flow,
                    run,
                    Origin(path, tap=tap, broadcast=broadcast),
                )
            case Refused() as refused:
                return self.routes.listed(
                    run,
                    call_args,
                    module if tap is None else None,
                    shown,
                    name,
                    Origin(path, tap=tap),
                    refused,
                )
            case Mapped(depth=depth):
                return self.jax.mapped(
                    run, call_args, module, method, path, given, depth
                )
        # The model's own trace (`PLAIN`), or carried through the lifted
        # transforms in bridge's collections (`Carried`).
        if not carried and not in_params:
            self.lifted.uncarried(path, tap)
        # Neither a `ToLinen` nor an `apply` the model makes passes bridge's
        # collection on: their epsilon is the session's.
        in_session = not in_params and (guests.wraps_guest("linen", module) or given)
        call = session.enter(
            name,
            shown,
            module if tap is None else None,
            call_args,
            origin=Origin(path, in_params, in_session, tap, given),
            record=not lifted,
        )
        value = run()
        patch = None
        if in_params and call.name in session.carrier.patched_with_values():
            patch = patch_in_params(module, method, call, tap)
        collection = "params" if in_params else EPSILON_COLLECTION
        value = session.exit(
            call,
            value,
            None if in_session else perturbation(module, method, call, tap, collection),
            record=not lifted,
            patch=patch,
        )
        if lifted and session.carrier.carries_out(call.name):
            record_in_scope(
                session, module, method, call, tap, in_params, path, value, call_args
            )
        return value
