"""One run of a Haiku model: every module method call of its `apply`,
reported to the session by an interceptor (`hk.intercept_methods`), and every
`bridge.tap`, from where it runs.

The call router decides how each is reached, from the Haiku transforms around
it (read off the Python call stack, `bridge.adapters.haiku.internals`) and
JAX's (`bridge.adapters.haiku.transforms.route`): at the probe's own trace, and
inside JAX's branches, loops of known bounds and the model's own `jax.vmap`s,
a call is reported plainly and the core reads where it runs from the
computation (`bridge._session.computation`); inside Haiku's lifted
transforms its epsilon and recording ride in state
(`bridge.adapters.haiku.transforms`, `bridge.adapters.haiku.variables`);
inside a transform that carries neither, it is listed and refused where
selected or patched, with the router's sentence.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import haiku as hk
import jax.numpy as jnp

from bridge.adapter_api import (
    PLAIN,
    BodyTraces,
    BridgeValueError,
    Carried,
    Mapped,
    Refused,
    Session,
    Site,
    ThroughControlFlow,
    add_epsilon,
    carrier_name,
)

from ..shared import jax_internals, unexpressible
from ..shared.scan_bodies import ScanBodies
from . import internals, transforms, variables
from .variables import Origin


class Interceptor:
    """Reports every module method call of one `apply` to the session.

    Inside `hk.experimental.layer_stack` a module's name is relative to the
    layer (`lin`); the site is named like its params,
    `__layer_stack_no_per_layer/lin`, with the name of the `LiftingModule` the
    stack calls first. A site there holds every layer stacked: its epsilon and
    recording live in state, which the stack slices per layer going in and
    stacks coming out; so does a patch value for it (`placed`). A repeated
    trace of a stack's body re-uses the names of the first.
    """

    def __init__(
        self,
        session: Session,
        state_route: bool,
        placed: Mapping[str, Site],
        apply_frame: Any,
    ):
        self.session = session
        self.apply_frame = apply_frame  # where the walks up the stack stop
        self.base = jax_internals.current_trace()  # the trace of that apply
        self.state_route = state_route
        self.placed = placed  # sites whose patch value rides in state
        self.prefixes: dict[Any, str] = {}  # `_LayerStack.__call__` frame -> name
        self.traces = BodyTraces(session)  # of each stack's body, by stack call
        self.bodies: dict[Any, Any] = {}  # each stack's body frame traced last
        # The bodies of the model's own `lax.scan`s, by the scan's frame.
        self.scan_bodies = ScanBodies(session, self.base, apply_frame)

    def __call__(self, next_fun, call_args, call_kwargs, context):
        if not is_site(context):
            return next_fun(*call_args, **call_kwargs)
        module = context.module
        if self.session.batch_axis is not None:
            _check_batch_norm_mapped(module, self.session.batch_axis)
        where = internals.enclosing(self.apply_frame)
        prefix = self.prefixes.get(where.stack_call, "")
        if internals.is_lifting(module):
            # Returns the lifted params, not an activation: not a site.
            value = next_fun(*call_args, **call_kwargs)
            caller = internals.layer_stack_caller()
            if caller is not None:
                self.prefixes[caller] = _joined(prefix, module.module_name)
                self.traces.begin(caller)
            return value
        if where.body is not None:
            first = self.bodies.setdefault(where.stack_call, where.body)
            if first is not where.body:  # the stack's body traced again
                self.traces.again(where.stack_call)
                self.bodies[where.stack_call] = where.body
        return self._site(
            lambda: next_fun(*call_args, **call_kwargs),
            call_args,
            module,
            context.method_name,
            where,
            _joined(prefix, module.module_name),
        )

    def tap(self, name: str, value: Any) -> Any:
        """The session's tap handler: a `bridge.tap` named under the module
        calling it, a site of its own where the router routes it anywhere
        but the probe's own trace; inside a layer stack, `hk.scan` or
        `hk.remat` its state bundle holds its values (see `carrier_name`'s
        `tap`)."""
        where = internals.enclosing(self.apply_frame)
        enclosing = self.session.enclosing
        if enclosing:
            path = f"{enclosing[-1]}/{name}"
        else:  # in the stack's body, outside any module: named like its params
            path = _joined(self.prefixes.get(where.stack_call, ""), name)
        return self._site(lambda: value, (), None, "__call__", where, path, name)

    def _site(self, run, call_args, module, method, where, name, tap=None):
        """The call `run()` of `module`'s `method`, named `name`, as a site;
        a `bridge.tap` named `tap` inside the module running now."""
        session = self.session
        prefix = self.prefixes.get(where.stack_call, "")
        bundle = _joined(prefix, hk.experimental.current_name())
        route = transforms.route(name, where, self.base, module)
        method_name = None if method == "__call__" else method
        match route:
            case ThroughControlFlow() | Mapped():
                # JAX's branches and loops, the model's own vmaps: reported
                # plainly, the core reads them from the computation.
                return session.exit(
                    session.enter(name, method_name, module, call_args), run()
                )
            case Refused():
                # Listed, and refused where selected or patched.
                if not where.transforms:  # in a scan's body, maybe traced again
                    self.scan_bodies.traced()
                origin = Origin(bundle, tap=tap)
                call = session.enter(
                    name, method_name, module, call_args, origin=origin, record=False
                )
                # The sentence names the site as the session named the call.
                call.origin = dataclasses.replace(origin, blocked=route.at(call.name))
                return unexpressible.listed(
                    session, call, run(), self.base, self.apply_frame
                )
        if route is PLAIN and tap is not None:
            return session.tap_here(tap, run())
        # At the probe's own trace, or carried through Haiku's transforms.
        inside = isinstance(route, Carried)
        origin = Origin(bundle, inside, scan=where.scan, tap=tap)
        if inside and not self.state_route:
            session.recorder.fall_back()  # discovery: again, through state
        call = session.enter(
            name, method_name, module, call_args, origin=origin, record=not inside
        )
        value = run()
        if not self.state_route:
            return session.exit(call, value)  # the session's own epsilon
        entry = carrier_name("epsilon", method, call.index, tap)
        recording_entry = carrier_name("recording", method, call.index, tap)
        patched = call.name in self.placed
        if origin.scan is not None:
            value = transforms.scanned(
                session, call, value, call_args, origin, method, patched
            )
            if call.name in session.selected:  # its recording rows are carried
                session.carrier.defer(call.name, (origin.bundle, recording_entry))
            return value

        def perturb(value):
            epsilon = hk.get_state(
                entry, (), jnp.float32, init=variables.unreachable(call)
            )
            return add_epsilon(value, epsilon)

        patch = variables.patch_from_state(call, method) if patched else None
        value = session.exit(call, value, perturb, record=not inside, patch=patch)
        carrier = session.carrier
        if inside and carrier.carries_out(call.name):
            hk.set_state(recording_entry, carrier.to_carry_out(value, call_args))
            carrier.defer(call.name, (origin.bundle, recording_entry))
        return value


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def is_site(context: hk.MethodContext) -> bool:
    """A module method call a user would name: not `__init__`, private helpers
    (`MultiHeadAttention._linear_projection`) or property reads
    (`Embed.embeddings`, `ExponentialMovingAverage.average`), which Haiku
    intercepts too."""
    method = context.method_name
    if method.startswith("_") and method != "__call__":
        return False
    attribute = inspect.getattr_static(context.orig_class, method, None)
    return not isinstance(attribute, property)


def _check_batch_norm_mapped(module: Any, batch_axis: str) -> None:
    """Under the probe's vmap, an `hk.BatchNorm` without a cross-replica axis
    would normalise each example by its own statistics: not the model's batch
    statistics, and silently so where the parameter shapes happen to fit."""
    if isinstance(module, hk.BatchNorm) and module.cross_replica_axis is None:
        raise BridgeValueError(
            f"{module.module_name} is an hk.BatchNorm, and with vmap=True the "
            "probe calls the model on one example at a time: its statistics "
            "would be each example's own, and params made for a batch do not "
            "fit one example (hk.BatchNorm's scale and offset are (1, C) for a "
            "(N, C) batch). A Haiku model takes the whole batch: probe it with "
            "vmap=False (the default), which runs BatchNorm as written. (A "
            "model written for one example reduces over the probe's axis with "
            f"hk.BatchNorm(..., cross_replica_axis={batch_axis!r}).)"
        )
