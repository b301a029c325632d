"""Linen sites inside JAX's own transforms in the model's code (`jax.vmap`,
`jax.checkpoint`, `lax.scan`, `lax.cond`, ...), outside Flax's lifted
transforms: Flax carries none of bridge's collections through them.

How a call there reaches its site, the router decides
(`bridge.adapters.linen.routes`). Inside the model's own `jax.vmap`s only,
a call sees one example, yet the site holds every example, mapped axes
first, outermost first (the contract's layout), with per-example gradients:
the value is handed out to the model's trace and back
(`bridge.adapters.shared.lifting`), where its epsilon is added
(`JaxTransforms.mapped`). A `lax.scan` body JAX traces twice lists its sites
once (`bridge.adapters.shared.scan_bodies`).
"""

from __future__ import annotations

from typing import Any

from bridge.adapter_api import PLAIN, Mapped, Refused, Session, ThroughControlFlow

from ..shared import guests, lifting
from ..shared.scan_bodies import ScanBodies
from .routes import Routes
from .variables import EPSILON_COLLECTION, Origin, perturbation


class JaxTransforms:
    """The model's own JAX transforms around the calls of one Linen `apply`
    outside Flax's lifted transforms. `base` and `stop` are the trace and the
    Python frame of the probe's `apply`."""

    def __init__(self, session: Session, routes: Routes):
        self.session = session
        self.routes = routes
        # The bodies of the model's own `lax.scan`s, by the scan's frame.
        self.scan_bodies = ScanBodies(session, routes.base, routes.stop)

    def tap(self, name: str, value: Any, scope: tuple[str, ...]) -> Any:
        """A `bridge.tap` outside Flax's lifted transforms, in the call of the
        module at `scope`, as the router routes it: the session's own,
        handed out of the model's own `jax.vmap`s (mapped axes first), a
        site of the session's control-flow route, or listed and refused."""
        session = self.session
        self.scan_bodies.traced()
        routes = self.routes
        enclosing = routes.enclosing(lifted=False, carries_none=False)
        path = session.naming.under_enclosing(name)
        found = routes.route(path, enclosing, lifted=False)
        match found:
            case Mapped(depth=depth):
                return lifting.lift(
                    value, depth, lambda full: session.tap_here(name, full)
                )
            case ThroughControlFlow(flow=flow):
                return session.call_in_control_flow(
                    path, None, None, (), flow, lambda: value, Origin(scope)
                )
            case Refused() as refused:
                return routes.listed(
                    lambda: value, (), None, None, path, Origin(scope), refused
                )
        assert found is PLAIN, found  # outside lifted scopes nothing carries
        return session.tap_here(name, value)

    def mapped(self, run, call_args, module, method, path, given, depth) -> Any:
        """A call inside `depth` of the model's own `jax.vmap`s (outside
        Flax's lifted transforms) of the module at `path` (`given`: inside an
        `apply` the model makes itself): the site holds the mapped value,
        mapped axes first, handed out to the model's trace and back
        (`bridge.adapters.shared.lifting`), where its epsilon is added."""
        session = self.session
        in_session = guests.wraps_guest("linen", module) or given
        entered = []

        def enter(full_args: tuple) -> tuple:
            entered.append(
                session.enter(
                    "/".join(path),
                    None if method == "__call__" else method,
                    module,
                    full_args,
                    origin=Origin(path, False, in_session, None, given),
                )
            )
            return full_args

        if session.with_inputs:
            lifting.lift(call_args, depth, enter)
        else:
            enter(())
        (call,) = entered
        value = run()
        if not session.recorder.needs_value(call.name):
            return session.exit(call, value)
        perturb = perturbation(module, method, call, None, EPSILON_COLLECTION)
        return lifting.lift(
            value,
            depth,
            lambda full: session.exit(call, full, None if in_session else perturb),
        )
