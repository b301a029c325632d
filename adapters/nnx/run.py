"""One run of an NNX probe's copy: each call of its modules, reported to the
session from where it runs.

The copy's modules report their calls (`bridge.adapters.nnx.surgery`) to the
`Run` of the probe's call, and the call router (`bridge.adapter_api.route`)
decides, from the transforms around each call and NNX's rules for them
(`bridge.adapters.nnx.rules`), how it reaches its site. A call outside
NNX's transforms is routed by JAX's transforms around it
(`bridge.adapters.nnx.jax_transforms`); a call inside an NNX transform
(`nnx.scan`, `nnx.vmap`, `nnx.remat`) keeps its values in bridge's variables
on the module (`bridge.adapters.nnx.transforms`). `nnx.jit` is traced
through: while a probe runs the model's own jits run inline, in the probe's
trace (`bridge._session.jit`). A scan body JAX traces twice (its carry
starts as a Python `0`) lists its sites once
(`bridge.adapters.shared.scan_bodies`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from flax import nnx

from bridge.adapter_api import (
    Mapped,
    Route,
    Rule,
    Session,
    ThroughControlFlow,
    Transform,
    route,
)
from bridge.adapter_api import Refused as Refusal

from ..shared import jax_internals, lifting, unexpressible
from ..shared.scan_bodies import ScanBodies
from . import internals, jax_transforms, rules
from .transforms import Lifted
from .variables import PATH_ATTRIBUTE, CopyVariables, Origin

jax_internals.require_scan_frame("Flax NNX")


@dataclasses.dataclass(frozen=True)
class Refused(Origin):
    """A site the router refuses (or one of the control-flow route):
    `blocked` is the router's sentence, naming the transform that blocks."""

    blocked: str | None = None


class Run:
    """One run of the probe's copy: its modules, and where each call runs.

    `stop` is the Python frame of the probe's own call of the model (scans
    around it are not the model's), `session` the session of the run. The
    calls inside NNX transforms are `lifted`'s (`transforms.Lifted`), and
    bridge's variables on the copy `variables`' (`variables.CopyVariables`),
    given the `candidates` and `markers` of discovery's passes.
    """

    def __init__(
        self,
        modules: dict[str, nnx.Module],
        stop: Any,
        session: Session,
        candidates: dict[tuple[str, str], int] | None = None,
        markers: bool = False,
    ):
        self.modules = modules
        self.stop = stop  # the frame of the probe's own call of the model
        # The trace of that call: the model's own transforms run inside it.
        self.base = jax_internals.current_trace()
        self.ids = {id(module): path for path, module in modules.items()}
        self.outer = internals.active_transforms()
        # The first trace of each `lax.scan`'s body, by the scan's frame.
        self.scan_bodies = ScanBodies(session, self.base, stop)
        candidates = {} if candidates is None else candidates
        self.variables = CopyVariables(modules, candidates, markers)
        self.lifted = Lifted(self, candidates, markers)

    def transforms(self) -> tuple[Any, ...]:
        """The update-context tags of the NNX transforms of the model's own
        code running now, outermost first, but those bridge traces through
        (`nnx.jit`: while a probe runs, the model's own jits run inline, in
        the probe's trace, so a call inside one is a call like any other, on
        the module's copy that `nnx.jit` merged)."""
        return tuple(
            t
            for t in internals.active_transforms()
            if t not in self.outer and rules.transform(t).rule is not Rule.THROUGH
        )

    def innermost_transform(self) -> str | None:
        """The name of the innermost NNX transform of the model's code running
        now (`nnx.scan`), for errors about the calls inside it."""
        transforms = self.transforms()
        return rules.name(transforms[-1]) if transforms else None

    def route(
        self, site: str, over_jax: Mapping[str, Transform] = rules.RULES
    ) -> Route:
        """The route of a call at `site` through JAX's transforms between here
        and the probe's call of the model, the rules `over_jax` over JAX's."""
        return unexpressible.route(site, self.base, over_jax)

    def report(self, module, method_name, method, args, kwargs, session):
        """A call of a module of the copy (`surgery.Reporter`)."""
        site_method = None if method_name == "__call__" else method_name
        self.scan_bodies.traced()
        path = self.ids.get(id(module))
        if path is None and not self.transforms():
            # The module's copy that `nnx.jit` merged, or a pytree copy handed
            # to a JAX transform as an argument: a call outside NNX's own.
            path = vars(module).get(PATH_ATTRIBUTE)
        if path is not None:
            return jax_transforms.plain_call(
                self, module, site_method, method, args, kwargs, session, path
            )
        return self.lifted.call(module, site_method, method, args, kwargs, session)

    def tap(self, session: Session, name: str, value: Any) -> Any:
        """`bridge.tap` in the model's code, routed by JAX's transforms around
        it (`rules.for_tap`: each reason says the tap is called there), among
        them an `nnx.scan`'s, which counts its iterations while a probe runs
        (`rules.SCAN_LOOP`): a tap in its body, in a branch there or not, is a
        site per iteration. Where they are not branches and loops of known
        bounds only, NNX's own transforms around it route it: its value is a
        tracer of their trace, and bridge does not carry taps out of them yet
        (`rules.tap_blocked`)."""
        if self.in_a_shape_pass():
            return value  # no call of the model's: not a site
        self.scan_bodies.traced()
        path = session.naming.under_enclosing(name)
        tap_rules = rules.for_tap(name)
        tags = self.transforms()

        found = self.route(path, tap_rules)
        if tags and not isinstance(found, ThroughControlFlow):
            found = route(path, rules.enclosing(tags, tap=name))
        match found:
            case ThroughControlFlow(flow):
                return session.call_in_control_flow(
                    path, None, None, (), flow, lambda: value
                )
            case Mapped(depth):
                return lifting.lift(
                    value, depth, lambda full: session.tap_here(name, full)
                )
            case Refusal():
                call = session.enter(
                    path, None, None, origin=Refused(path), record=False
                )
                return self.refused(call, found, lambda _: value, None, (), {}, session)
        return session.tap_here(name, value)

    def off_route(
        self, found, module, site_method, method, args, kwargs, session, path
    ):
        """A call the router (`found`) sends through branches
        and loops of static bounds only (`nnx.cond`, `nnx.switch`,
        `nnx.fori_loop`, JAX's own), the session's control-flow route, or
        refuses: called as the model calls it and listed (see
        `bridge.adapters.shared.unexpressible`)."""
        if self.in_a_shape_pass():  # no call of the model's: not a site
            return method(module, *args, **kwargs)
        if isinstance(found, ThroughControlFlow):
            return session.call_in_control_flow(
                path,
                site_method,
                module,
                args,
                found.flow,
                lambda: method(module, *args, **kwargs),
                Refused(path),
            )
        call = session.enter(
            path, site_method, module, args, origin=Refused(path), record=False
        )
        return self.refused(call, found, method, module, args, kwargs, session)

    def in_a_shape_pass(self) -> bool:
        """Whether this runs in a `jax.eval_shape` of the model's own code,
        whose values JAX discards: the pass nnx.fori_loop makes of its body
        before the loop, to learn its shapes. A module call or a tap there
        is no call of the model's, and no site (the loop's own trace of the
        body lists it once); read from the Python call stack
        (`jax_internals.in_a_shape_pass`), where the trace is not the
        probe's own (JAX traces the pass as a jit, which the router traces
        through)."""
        return jax_internals.current_trace() is not self.base and (
            jax_internals.in_a_shape_pass(self.stop)
        )

    def refused(
        self,
        call,
        found: Refusal,
        method,
        module,
        args,
        kwargs,
        session,
    ):
        """Run the call entered as `call` as the model does, listed as refused
        with the sentence of the router's refusal `found` for its name."""
        call.origin = Refused(call.path, blocked=found.at(call.name))
        value = method(module, *args, **kwargs)
        return unexpressible.listed(session, call, value, self.base, self.stop)
