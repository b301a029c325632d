"""NNX sites inside JAX's own transforms in the model's code (`jax.vmap`,
`jax.checkpoint`, `lax.scan`, `lax.cond`, ...), which carry none of bridge's
variables on the module: a module closed over keeps its object, a module
passed as an argument is a pytree copy, and neither is an NNX transform's.

Inside the model's own `jax.vmap`s a call sees one example, yet the site
holds every example, mapped axes first, outermost first (the contract's
layout), with per-example gradients. The value is handed out whole through a
private primitive whose batching rule is the only code that sees it whole: at
each enclosing `vmap` the rule moves that vmap's axis to the front
(broadcasting a value that does not vary along it) and passes it one trace
out, until it reaches the probe's own trace. There the session takes it as
any site's value (epsilon, patch, recording), and the rule hands the result
back in, mapped along axis 0 at every level
(`bridge.adapters.shared.lifting.lift`, as the other adapters do). No tracer
leaves its trace, and autodiff sees ordinary operations.

Inside any other transform of JAX's (a `lax.scan`, `jax.checkpoint`,
`lax.cond`, ...) no value can leave and no epsilon can enter: the site is
listed with the shape its value has for the model and refused where selected
or patched, naming the innermost such transform (`around`, `REFUSALS`); a
`lax.scan` body JAX traces twice lists its sites once. A
`jax.jit` is none: while a probe runs, the model's own jits run inline, in
the probe's trace.

The trace stack is read through `bridge.adapters.shared.jax_internals`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..shared import jax_internals

_BRANCH = (
    "which branch runs is known only when the model runs, so a call in a "
    "branch may not run at all"
)

#: Why a site inside each JAX transform cannot be expressed, and what to do.
REFUSALS = {
    "jax.lax.scan": (
        "bridge's variables on the module do not ride through a jax.lax.scan "
        "of the model's own code, so no epsilon can enter and no value leave "
        "it per iteration",
        "write the loop as an nnx.scan over stacked layers",
    ),
    "jax.lax.fori_loop": (
        "bridge's variables on the module do not ride through a "
        "jax.lax.fori_loop of the model's own code, so no epsilon can enter "
        "and no value leave it per iteration",
        "write the loop as an nnx.scan over stacked layers",
    ),
    "jax.checkpoint": (
        "bridge's variables on the module do not ride through a "
        "jax.checkpoint of the model's own code, so no epsilon can enter and "
        "no value leave it",
        "rematerialise with nnx.remat, which carries them",
    ),
    "jax.lax.cond": (_BRANCH, "compute both branches and pick with jnp.where"),
    "jax.lax.switch": (_BRANCH, "compute every branch and pick with jnp.where"),
    "jax.lax.while_loop": (
        "how many iterations run is known only when the model runs, so no "
        "epsilon or recording can be shaped for them",
        "write the loop as an nnx.scan of fixed length",
    ),
}

_UNKNOWN = "a transform whose enclosing trace this jax does not record"


def around(base: Any) -> tuple[int, str | None]:
    """JAX's transforms between here and `base` (the trace of the probe's call
    of the model): `(depth, None)` where only `depth` `jax.vmap`s stand
    between (`0`: none), else `(0, name)` of the innermost other one, as a
    refusal names it."""
    trace = jax_internals.current_trace()
    depth = 0
    while trace is not base:
        if trace is None:  # jax < 0.6.2: a jaxpr trace records no parent
            return 0, _UNKNOWN
        if not jax_internals.is_vmap(trace):
            traced = jax_internals.traced_for(trace)
            return 0, jax_internals.TRANSFORM_NAMES.get(traced, f"jax's {traced}")
        trace = jax_internals.parent(trace)
        depth += 1
    return depth, None


def why(transform: str) -> tuple[str, str, str]:
    """`(transform, reason, fix)` of a call refused inside `transform`."""
    reason, fix = REFUSALS.get(
        transform,
        (
            "bridge's variables on the module do not ride through it, so no "
            "epsilon can enter and no value leave it",
            "move the call out of it",
        ),
    )
    return transform, reason, fix


#: The folder of NNX's transforms, and the one of them bridge sees through.
_NNX_TRANSFORMS = os.path.join("flax", "nnx", "transforms") + os.sep
_NNX_JIT = "compilation.py"


def inside_tree_mode_transform(stop: Any) -> bool:
    """Whether an NNX transform other than `nnx.jit` runs now, up to the
    frame `stop`. Called where no NNX transform has pushed its update
    context: such a one runs in tree mode (`graph=False`,
    `graph_updates=False`), the module a pytree of its own."""
    frame = sys._getframe(1)
    while frame is not None and frame is not stop:
        filename = frame.f_code.co_filename
        if _NNX_TRANSFORMS in filename and not filename.endswith(_NNX_JIT):
            return True
        frame = frame.f_back
    return False
