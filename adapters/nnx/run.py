"""One run of an NNX probe's copy: each call of its modules, reported to the
session from where it runs.

The copy's modules report their calls (`bridge.adapters.nnx.surgery`) to the
`Run` of the probe's call. A call outside NNX's transforms is a site of the
session's own, handed out whole from inside the model's own `jax.vmap`s and
listed but refused inside JAX's other transforms
(`bridge.adapters.nnx.jax_transforms`); a call inside an NNX transform
(`nnx.scan`, `nnx.vmap`, `nnx.remat`) keeps its values in bridge's variables
on the module (`bridge.adapters.nnx.transforms`). `nnx.jit` is none: while a
probe runs the model's own jits run inline, in the probe's trace
(`bridge._session.jit`). A scan body JAX traces twice (its carry starts as a
Python `0`) lists its sites once (`bridge.adapters.shared.scan_bodies`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from bridge.adapter_api import Session, refusal

from ..shared import jax_internals, lifting, unexpressible
from ..shared.scan_bodies import ScanBodies
from . import internals, jax_transforms
from .transforms import Lifted, transform_name
from .variables import PATH_ATTRIBUTE, CopyVariables, Origin

jax_internals.require_scan_frame("Flax NNX")


@dataclasses.dataclass(frozen=True)
class Refused(Origin):
    """A call inside an NNX transform bridge cannot see through there:
    `blocked` says why, naming it."""

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

    def transforms(self) -> tuple[str, ...]:
        """The NNX transforms of the model's own code running now, but
        `nnx.jit`: while a probe runs, the model's own jits run inline, in the
        probe's trace (`bridge._session.jit`), so a call inside one is a call
        like any other (on the module's copy that `nnx.jit` merged)."""
        return tuple(
            t
            for t in internals.active_transforms()
            if t not in self.outer and transform_name(t) != "nnx.jit"
        )

    def innermost_transform(self) -> str | None:
        """The name of the innermost NNX transform of the model's code running
        now (`nnx.scan`), for errors about the calls inside it."""
        transforms = self.transforms()
        return transform_name(transforms[-1]) if transforms else None

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
        """`bridge.tap` in the model's code. Inside branches and loops of static
        bounds only (NNX's or JAX's), a site of the session's control-flow
        route. Inside another NNX transform, where the value is a tracer of
        the transform's trace, it is listed and refused where selected or
        patched: bridge does not carry taps out of NNX transforms yet. Inside
        the model's own `jax.vmap`s it is handed out whole; inside JAX's
        other transforms, listed and refused."""
        if self.in_a_shape_pass():
            return value  # no call of the model's: not a site
        self.scan_bodies.traced()
        flow = unexpressible.control_flow(self.base)
        if flow is not None:  # branches and loops of static bounds only
            path = session.naming.under_enclosing(name)
            return session.call_in_control_flow(
                path, None, None, (), flow, lambda: value
            )
        transforms = self.transforms()
        if transforms:
            why = (
                transform_name(transforms[-1]),
                f"bridge.tap({name!r}, ...) is called there, and bridge does not "
                "carry taps out of NNX transforms yet",
                "tap the value outside the transform, or select the call of the "
                "module that computes it",
            )
        else:
            depth, blocker = unexpressible.vmaps_or_blocker(self.base)
            if blocker is None:
                if depth == 0:
                    return session.tap_here(name, value)
                return lifting.lift(
                    value, depth, lambda full: session.tap_here(name, full)
                )
            transform, reason, fix = jax_transforms.why(blocker)
            why = (
                transform,
                f"bridge.tap({name!r}, ...) is called there: {reason}",
                "tap the value outside it, or " + fix,
            )
        path = session.naming.under_enclosing(name)
        call = session.enter(path, None, None, origin=Refused(path), record=False)
        return self.refused(call, why, lambda _: value, None, (), {}, session)

    def listed(self, module, site_method, method, args, kwargs, session, path, why):
        """Call `method` as the model does, listed as a refused site (see
        `bridge.adapters.shared.unexpressible`); inside branches and loops of
        static bounds only (`nnx.cond`, `nnx.switch`, `nnx.fori_loop`, JAX's
        own), a site of the session's control-flow route instead."""
        if self.in_a_shape_pass():  # no call of the model's: not a site
            return method(module, *args, **kwargs)
        flow = unexpressible.control_flow(self.base)
        if flow is not None:
            return session.call_in_control_flow(
                path,
                site_method,
                module,
                args,
                flow,
                lambda: method(module, *args, **kwargs),
                Refused(path),
            )
        call = session.enter(
            path, site_method, module, args, origin=Refused(path), record=False
        )
        return self.refused(call, why, method, module, args, kwargs, session)

    def in_a_shape_pass(self) -> bool:
        """Whether this runs in a `jax.eval_shape` of the model's own code,
        whose values JAX discards: the pass nnx.fori_loop makes of its body
        before the loop, to learn its shapes. A module call or a tap there
        is no call of the model's, and no site (the loop's own trace of the
        body lists it once); read from the Python call stack
        (`jax_internals.in_a_shape_pass`), where the trace is not the
        probe's own."""
        return jax_internals.current_trace() is not self.base and (
            jax_internals.in_a_shape_pass(self.stop)
        )

    def refused(self, call, why, method, module, args, kwargs, session):
        """Run the call entered as `call` as the model does, listed as refused
        for `why`: `(transform, reason, fix)`."""
        transform, reason, fix = why
        call.origin = Refused(
            call.path, blocked=refusal(call.name, transform, reason, fix)
        )
        value = method(module, *args, **kwargs)
        return unexpressible.listed(session, call, value, self.base, self.stop)
