"""NNX sites inside NNX transforms of the model's own code.

NNX transforms (`nnx.scan` over layers built with `nnx.vmap`, `nnx.vmap` over
an ensemble, `nnx.remat`) split the copy and merge it again: the body runs on
new module objects, of the same reporting classes, that carry their site path
as a static attribute, and values seen there are tracers of the transform's
trace. So a site there keeps its epsilon and its recording in bridge's own
`nnx.Param` subclasses on the module (`bridge.adapters.nnx.variables`), which
the transform carries exactly as it carries the module's parameters: an
epsilon placed on the copy before the call is sliced per iteration going in,
and a recording made inside comes out stacked, `(iterations, *value shape)`,
read back from the copy after the call (`Lifted`). Whether a call is
carried so is the call router's (`bridge.adapter_api.route`), over NNX's
transforms around it and their rules (`bridge.adapters.nnx.rules`): those
that would not carry the variables (loops and branches, `nnx.grad`, ...)
and a module a transform broadcasts (`in_axes=None`) block, and the call is
listed, with its whole shape, and refused only where selected or patched
with the router's sentence; inside NNX's branches and loops of static
bounds alone, where the call runs is read off JAX's traces, as a call
outside NNX's transforms (`bridge.adapters.nnx.jax_transforms`).

While a probe runs, `nnx.scan` counts its iterations
(`bridge.adapter_api.count_scans_of`, `rules.SCAN_LOOP`): a call no carrier
takes in its body (in `nnx.cond`, `nnx.switch`, JAX's `lax.cond`,
`lax.switch`, `lax.fori_loop` or a `lax.scan` of the model's own there) is
routed again with each `nnx.scan` around it a loop of known bounds, and is
then a site per iteration of the session's control-flow route, `(iterations,
*value shape)`, where a branch did not run zeros (`res.ran` per iteration).
Where nothing but the nnx.scans stands around the call, their carried route
stands as before.

`nnx.jit` is traced through: while a probe runs the model's own jits run
inline, in the probe's trace, and a call on the copy `nnx.jit` merged is a
call like any other. A module that `nnx.scan` carries rather than slices is
`bridge.adapters.nnx.carried`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from bridge.adapter_api import (
    BridgeNotImplementedError,
    Carried,
    Refused,
    Rule,
    ThroughControlFlow,
    Transform,
    add_epsilon,
    carrier_name,
    counted_scans,
    route,
)

from ..shared import jax_internals, unexpressible
from . import carried, internals, rules
from .variables import PATH_ATTRIBUTE, Origin, Recording, broadcast_error


def _counted(trace: Any) -> bool:
    """Whether `trace` is the body's of a scan that counts its iterations
    while the probe runs (`counted_scans`)."""
    return trace is not None and any(
        jax_internals.trace_of(counter) is trace for counter, _ in counted_scans()
    )


class Lifted:
    """The calls inside NNX transforms of one run of the copy (`run`, a
    `run.Run`), whose values leave through variables on their modules
    (`run.variables`, a `variables.CopyVariables`).

    A module inside `nnx.scan` is sliced (its parameters lose the scan's axis
    inside), carried (they keep their full shape, and updates flow from one
    iteration to the next: `nnx.RNN`'s cell) or broadcast (full shape, updates
    dropped). Sliced modules are the stacked-layers route. Discovery tells the
    other two apart on a second pass (`markers`): each such call gets a
    `(length,)` marker on its module before the call; inside, the scan has
    sliced it (shape `()`) or not, and the body bumps it; after the call a
    marker still holding the very array placed was dropped: broadcast, which
    raises. A carried site's epsilon, recording and step counter ride in the
    carry whole, `(length, ...)`, and the counter picks the step's row
    (`bridge.adapters.nnx.carried`).
    """

    def __init__(
        self,
        run: Any,
        candidates: dict[tuple[str, str], int],
        markers: bool = False,
    ):
        self.run = run
        self.first_lifted: tuple[str, tuple[str, ...]] | None = None
        # `{(path, step key): scan length}`: calls whose module keeps its
        # parameters' shape inside nnx.scan, met by the first discovery pass.
        self.candidates = candidates
        self.markers = markers

    def call(self, module, site_method, method, args, kwargs, session):
        """A call inside an NNX transform, on the module's copy NNX merged,
        as the router takes it through NNX's transforms."""
        path = vars(module).get(PATH_ATTRIBUTE)
        tags = self.run.transforms()
        if path is None:
            raise BridgeNotImplementedError(
                f"A {type(module).__name__} submodule that is not one of the "
                "model's own is called inside "
                + (", ".join(rules.name(t) for t in tags) or "a transform")
                + " in the model's own code: bridge cannot tell which site it is. "
                "Call the model's own submodules there."
            )
        enclosing = rules.enclosing(
            tags, unexpressible.enclosing(self.run.base, rules.RULES)
        )
        body = rules.BODIES.get(enclosing[0].name) if enclosing else None
        looped = enclosing  # as the nnx.scans around it, as loops, route it
        if body is not None:
            # JAX's own transforms inside the NNX transform's body (a
            # `lax.cond` in an `nnx.scan`'s): the router weighs them too.
            # A module the transform slices or maps has parameters of its
            # body's trace; one it carries or broadcasts, of a trace further
            # out, which would take the transform's own for the model's.
            outside = self.run.modules.get(path)
            sliced = outside is not None and not carried.keeps_shape(module, outside)
            trace = carried.body_trace(module)
            inside = unexpressible.within(
                self.run.base, rules.RULES, body, trace if sliced else None
            )
            if not sliced and _counted(trace):
                # Held by a scan counting its iterations (the nnx.scan that
                # carries or broadcasts the module): as loops, what is inside
                # its body (the model's own counted scan) is read by its trace.
                looped = unexpressible.within(self.run.base, rules.RULES, body, trace)
                looped = (*looped, *enclosing)
            else:
                looped = (*inside, *enclosing)
            enclosing = (*inside, *enclosing)

        found = route(path, enclosing)
        if rules.RULES["nnx.scan"] in enclosing and (
            isinstance(found, Refused) or looped != enclosing
        ):
            # Where no carrier takes the call (a branch or a loop of the
            # model's own in an nnx.scan's body), the nnx.scans around it,
            # counting their iterations, may be loops of known bounds: the
            # session's control-flow route, in discovery and in a run alike.
            again = route(path, rules.scans_as_loops(looped))
            if isinstance(again, ThroughControlFlow):
                found = again
        if isinstance(found, ThroughControlFlow):
            # NNX's branches and loops run in JAX's, which say where.
            found = self.run.route(path)
        if not isinstance(found, Carried):
            return self.run.off_route(
                found, module, site_method, method, args, kwargs, session, path
            )
        names = tuple(t.name for t in reversed(found.transforms))  # outermost first
        if session.recorder.learns_sites():
            broadcast = self._broadcast(module, path, enclosing[0])
            if broadcast is not None:
                return self.run.off_route(
                    route(path, (broadcast, *enclosing[1:])),
                    module,
                    site_method,
                    method,
                    args,
                    kwargs,
                    session,
                    path,
                )
        call = session.enter(
            path, site_method, module, args, origin=Origin(path, names), record=False
        )
        if self.first_lifted is None:
            self.first_lifted = (path, names)
        step_key = carrier_name("step", site_method, call.index)
        if "nnx.scan" in names and session.recorder.learns_sites():
            if not self.markers and carried.keeps_shape(module, self.run.modules[path]):
                # Carried or broadcast: the second pass tells which. Nothing
                # is set on the module, so the scan's carry keeps its structure.
                frames = jax_internals.scan_frames(self.run.stop)
                if frames is None:
                    raise jax_internals.unreadable_scan("Flax NNX")
                (length, _), *_ = frames
                self.candidates[path, step_key] = length
                return session.exit(call, method(module, *args, **kwargs))
            marker = vars(module).get(step_key)
            if marker is not None and jnp.ndim(internals.get_value(marker)):
                return carried.discover(
                    self.run,
                    module,
                    marker,
                    step_key,
                    call,
                    names,
                    method,
                    args,
                    kwargs,
                    session,
                )
        elif step_key in vars(module):
            # A run placed its step counter (`to_carry_in`); discovery's
            # markers are met above.
            return carried.run_step(module, call, method, args, kwargs, session)
        value = method(module, *args, **kwargs)
        variables = vars(module)
        epsilon = variables.get(carrier_name("epsilon", site_method, call.index))
        patch = variables.get(carrier_name("patch", site_method, call.index))

        def perturb(value):
            return add_epsilon(value, internals.get_value(epsilon))

        value = session.exit(
            call,
            value,
            perturb if epsilon is not None else None,
            record=False,
            # this iteration's slice of the stacked patch
            patch=None if patch is None else internals.get_value(patch),
        )
        if session.carrier.carries_out(call.name):
            key = carrier_name("recording", site_method, call.index)
            setattr(module, key, Recording(session.carrier.to_carry_out(value, args)))
            session.carrier.defer(call.name, (path, key, names))
        return value

    def _broadcast(self, module, path: str, innermost: Transform) -> Transform | None:
        """The innermost `nnx.vmap` or `nnx.scan` where it broadcasts the
        module (`in_axes=None` for it, or `None` for its parameters in
        `nnx.StateAxes`), which then blocks: its parameters keep their full
        shape, which a vmap gives only a broadcast module, and a scan also a
        carried one (told apart by what the scan broadcasts,
        `carried.broadcast_by_scan`). `None` otherwise, or where it cannot be
        told (a module without parameters: the scan's markers or NNX's own
        error tell, `CopyVariables.hand_over` and `explain`)."""
        outside = self.run.modules[path]
        name = innermost.name
        if name not in ("nnx.vmap", "nnx.scan") or not carried.has_params(module):
            return None
        if not carried.keeps_shape(module, outside):
            return None
        if name == "nnx.scan" and not carried.broadcast_by_scan(self.run.stop, outside):
            return None
        return dataclasses.replace(
            innermost,
            rule=Rule.BLOCKS,
            why="it broadcasts the module (in_axes=None for it, or None for its "
            "parameters in nnx.StateAxes), so one epsilon would serve every "
            + ("iteration" if name == "nnx.scan" else "mapped example")
            + " and their gradients would be summed",
            fix="map the module over its stacked parameters (in_axes=0)"
            + (
                ", or carry it (nnx.Carry for it in nnx.StateAxes)"
                if name == "nnx.scan"
                else ""
            ),
        )

    def explain(self, error: ValueError) -> None:
        """NNX's own error when a transform broadcasts a module bridge records in."""
        message = str(error)
        if self.first_lifted is None or not (
            "Incorrect number of leaves" in message
            or "got axis spec None but output was batched" in message
        ):
            return
        raise broadcast_error(*self.first_lifted) from error
