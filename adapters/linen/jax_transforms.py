"""Linen sites inside JAX's own transforms in the model's code (`jax.vmap`,
`jax.checkpoint`, `lax.scan`, `lax.cond`, ...), outside Flax's lifted
transforms: Flax carries none of bridge's collections through them.

Inside the model's own `jax.vmap`s a call sees one example, yet the site
holds every example, mapped axes first, outermost first (the contract's
layout), with per-example gradients: the value is handed out to the
model's trace and back (`bridge.adapters.shared.lifting`), where its
epsilon is added (`JaxTransforms.mapped`). Inside any other transform of
JAX's, no value can leave and no epsilon can enter: the call (or a
`bridge.tap`) is listed with its whole value and refused where selected or
patched, naming the innermost such transform (`JaxTransforms.unreachable`,
`RAW_REFUSALS`); a `lax.scan` body JAX traces twice lists its sites once
(`bridge.adapters.shared.scan_bodies`).
"""

from __future__ import annotations

from typing import Any

from bridge.adapter_api import TRACED_BOUNDS, TRACED_BOUNDS_FIX, Session, refusal

from ..shared import guests, jax_internals, lifting, unexpressible
from ..shared.scan_bodies import ScanBodies
from .transforms import LINEN_NAMES, REFUSALS, transform_call
from .variables import EPSILON_COLLECTION, Origin, perturbation

#: JAX's names of its transforms (a trace's `traced_for`), as the model's
#: code calls them.
JAX_NAMES = jax_internals.TRANSFORM_NAMES


#: Why a value inside a JAX transform of the model's own code (not a Flax
#: lifted transform) cannot be a site bridge probes, and what to do, where it
#: is neither the model's root trace nor only its own `jax.vmap`s around it.
RAW_REFUSALS = {
    "cond": REFUSALS["nn.cond"],
    "switch": REFUSALS["nn.switch"],
    "while_body": REFUSALS["nn.while_loop"],
    "while_cond": REFUSALS["nn.while_loop"],
    jax_internals.FORI_LOOP_TRACED: (TRACED_BOUNDS, TRACED_BOUNDS_FIX),
}


RAW_REFUSAL = (
    "a value there belongs to the transform's own trace, which hands out only "
    "what the model's code returns from it, so bridge can neither record it "
    "nor give it an epsilon",
    "move it out of the transform, or use Flax's own lifted transform "
    "(nn.remat, nn.scan with variable_axes={'params': 0}, nn.vmap), which "
    "bridge sees through",
)


def raw_transform(names: list[str]) -> str:
    """The transform that holds a value seen inside the model's own JAX
    transforms (`names`, JAX's, innermost first): the innermost that is
    neither a `jax.vmap` (whose value bridge hands out) nor a `jax.jit`
    (traced through)."""
    for name in names:
        if name not in ("vmap", "jit", "pjit"):
            return name
    return names[0] if names else "a JAX transform"


class JaxTransforms:
    """The model's own JAX transforms around the calls of one Linen `apply`
    outside Flax's lifted transforms. `base` and `stop` are the trace and the
    Python frame of the probe's `apply`."""

    def __init__(self, session: Session, base: Any, stop: Any):
        self.session = session
        self.base = base
        self.stop = stop
        # The bodies of the model's own `lax.scan`s, by the scan's frame.
        self.scan_bodies = ScanBodies(session, base, stop)

    def tap(self, name: str, value: Any, scope: tuple[str, ...]) -> Any:
        """A `bridge.tap` outside Flax's lifted transforms, in the call of the
        module at `scope`: the session's own where the model's trace holds
        it, handed out of the model's own `jax.vmap`s (mapped axes first),
        else listed and refused."""
        session = self.session
        self.scan_bodies.traced()
        depth = lifting.mapped_depth(self.base)
        if depth == 0:
            return session.tap_here(name, value)
        if depth is not None:
            return lifting.lift(value, depth, lambda full: session.tap_here(name, full))
        path = session.naming.under_enclosing(name)
        return self.unreachable(lambda: value, (), None, None, path, scope)

    def unreachable(self, run, call_args, module, method, path, scope) -> Any:
        """A call (or a tap) inside a JAX transform of the model's own code
        that gives its value no route out (`jax.checkpoint`, `lax.scan`,
        `lax.cond`): listed with its whole value, run as it is, refused where
        selected or patched, naming the transform (`RAW_REFUSALS`)."""
        session = self.session
        flow = unexpressible.control_flow(self.base)
        if flow is not None:  # the session's control-flow route
            return session.call_in_control_flow(
                path, method, module, call_args, flow, run, Origin(scope)
            )
        names = [unexpressible.name(t) for t in unexpressible.traces(self.base)]
        transform = raw_transform(names)
        shown = JAX_NAMES.get(transform, transform)
        if transform_call() is not None:
            # A Linen module the model closes over, called in a lifted
            # transform's body (`nn.cond(pred, lambda _, x: self.left(x), ...)`):
            # the transform is the model's `nn.cond`.
            loop = unexpressible.LOOPS_AND_BRANCHES.get(transform)
            shown = LINEN_NAMES.get(loop, shown)
        call = session.enter(
            path, method, module, call_args, origin=Origin(scope), record=False
        )
        why, fix = RAW_REFUSALS.get(transform, RAW_REFUSAL)
        where = " inside ".join(JAX_NAMES.get(n, n) for n in names)
        call.origin = Origin(
            scope,
            blocked=refusal(
                call.name,
                shown,
                f"{why} (it runs inside {where})",
                fix,
            ),
        )
        return unexpressible.listed(session, call, run(), self.base, self.stop)

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
