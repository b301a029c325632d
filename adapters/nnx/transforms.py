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
read back from the copy after the call (`Lifted`). A call inside a transform
that would not carry them (a module broadcast with `in_axes=None`,
`graph=False` or `graph_updates=False`, loops and branches) is listed, with
its whole shape, and refused only where selected or patched, naming the
innermost such transform (`bridge.adapters.shared.unexpressible`).

`nnx.jit` is none: while a probe runs the model's own jits run inline, in the
probe's trace, and a call on the copy `nnx.jit` merged is a call like any
other. A module that `nnx.scan` carries rather than slices is
`bridge.adapters.nnx.carried`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from bridge.adapter_api import (
    BRANCH,
    TRACED_BOUNDS,
    TRACED_BOUNDS_FIX,
    UNBOUNDED_LOOP,
    BridgeNotImplementedError,
    add_epsilon,
    carrier_name,
)

from ..shared import jax_internals
from . import carried, internals
from .variables import PATH_ATTRIBUTE, Origin, Recording, broadcast_error

#: NNX transforms (their update-context tags) that carry a module's `Param`
#: variables in and out, mapped or not, so they carry bridge's too.
_CARRYING = {"scan": "nnx.scan", "vmap": "nnx.vmap", "remat": "nnx.remat"}

#: Why a site inside each NNX transform cannot be expressed, and what to do.
_REFUSALS = {
    "nnx.while_loop": (
        UNBOUNDED_LOOP,
        "write the loop as an nnx.scan of fixed length",
    ),
    # One of static bounds is a site of the control-flow route.
    "nnx.fori_loop": (TRACED_BOUNDS, TRACED_BOUNDS_FIX),
    "nnx.cond": (
        BRANCH,
        "compute both branches and pick with jnp.where",
    ),
    "nnx.switch": (
        BRANCH,
        "compute every branch and pick with jnp.where",
    ),
}

#: The reason of a call inside an NNX transform in tree mode.
TREE_MODE = (
    "an NNX transform with graph=False or graph_updates=False",
    "it runs the module as a pytree, which carries none of bridge's variables "
    "on the module",
    "use the transform in graph mode (the default)",
)


def transform_name(tag: Any) -> str:
    """An NNX transform's name (`nnx.scan`), from its update-context tag."""
    if isinstance(tag, str):
        return f"nnx.{tag.removesuffix('_body')}"
    name = type(tag).__name__.lower()
    for transform in ("jit", "shard_map", "pmap", "cond", "switch"):
        if transform in name:
            return f"nnx.{transform}"
    return f"an NNX transform ({type(tag).__name__})"


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
        """A call inside an NNX transform, on the module's copy NNX merged."""
        path = vars(module).get(PATH_ATTRIBUTE)
        transforms = self.run.transforms()
        unsupported = [t for t in transforms if t not in _CARRYING]
        if path is None:
            raise BridgeNotImplementedError(
                f"A {type(module).__name__} submodule that is not one of the "
                "model's own is called inside "
                + (", ".join(transform_name(t) for t in transforms) or "a transform")
                + " in the model's own code: bridge cannot tell which site it is. "
                "Call the model's own submodules there."
            )
        if not transforms or unsupported:
            # Listed, and refused where selected or patched.
            return self._refused(
                module, site_method, method, args, kwargs, session, path, unsupported
            )
        names = tuple(_CARRYING[t] for t in transforms)
        if session.recorder.learns_sites():
            broadcast = self._broadcast(module, path, names[-1])
            if broadcast is not None:
                return self.run.listed(
                    module, site_method, method, args, kwargs, session, path, broadcast
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

    def _refused(self, module, site_method, method, args, kwargs, session, path, tags):
        """A call inside NNX transforms that do not carry bridge's variables
        (`tags`, outermost first; none in tree mode): listed, refused where
        selected or patched, naming the innermost."""
        names = [transform_name(t) for t in tags]
        if names:
            transform = names[-1]
            why, fix = _REFUSALS.get(
                transform,
                (
                    "bridge carries its variables through nnx.scan, nnx.vmap and "
                    "nnx.remat only",
                    "use one of those transforms",
                ),
            )
        else:
            transform, why, fix = TREE_MODE
        why = (transform, why, fix)
        return self.run.listed(
            module, site_method, method, args, kwargs, session, path, why
        )

    def _broadcast(self, module, path: str, innermost: str) -> tuple | None:
        """The reason of a call whose module the innermost `nnx.vmap` or
        `nnx.scan` broadcasts (`in_axes=None` for it, or `None` for its
        parameters in `nnx.StateAxes`): its parameters keep their full shape,
        which a vmap gives only a broadcast module, and a scan also a carried
        one (told apart by what the scan broadcasts,
        `carried.broadcast_by_scan`). `None` otherwise, or where it cannot be
        told (a module without parameters: the scan's markers or NNX's own
        error tell, `CopyVariables.hand_over` and `explain`)."""
        outside = self.run.modules[path]
        if innermost not in ("nnx.vmap", "nnx.scan") or not carried.has_params(module):
            return None
        if not carried.keeps_shape(module, outside):
            return None
        if innermost == "nnx.scan" and not carried.broadcast_by_scan(
            self.run.stop, outside
        ):
            return None
        return (
            innermost,
            "it broadcasts the module (in_axes=None for it, or None for its "
            "parameters in nnx.StateAxes), so one epsilon would serve every "
            + ("iteration" if innermost == "nnx.scan" else "mapped example")
            + " and their gradients would be summed",
            "map the module over its stacked parameters (in_axes=0)"
            + (
                ", or carry it (nnx.Carry for it in nnx.StateAxes)"
                if innermost == "nnx.scan"
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
