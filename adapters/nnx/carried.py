"""Sites of a module that `nnx.scan` carries rather than slices.

A module that `nnx.scan` CARRIES (`nnx.StateAxes({...: nnx.Carry})`, as
`nnx.RNN` scans its cell) keeps its parameters' full shape inside, and the
scan's carry must keep its structure: nothing may be added there. Its sites
work as Haiku's inside `hk.scan`: before the call the copy gets, per
selected site, the whole epsilon (and patch value) `(length, ...)`, a
recording buffer `(length, ...)` and an int32 step counter; inside, the
counter picks the step's row (`length - 1 - step` with `reverse`), the
recording is written with `.at[row].set` and the counter bumped; after the
call the recording is read off the copy. `length` and `reverse` come from
`lax.scan`'s frame (`bridge.adapters.shared.jax_internals.scan_frames`). Such a
site holds every step, `(length, *value shape)`, in the order of `xs`; a
patch value is given in that shape (its row is taken), a patch function
sees one step's value, and `with_inputs=True` records each step's inputs.

Carried and broadcast (`StateAxes({...: None})`, `in_axes=None`) look alike
inside the body, and NNX silently drops a broadcast module's updates. So
discovery never guesses: a call inside `nnx.scan` whose parameters keep
their outer shapes (or that has none) is only noted on the first pass,
changing nothing; if there was one, discovery runs again with a `(length,)`
int32 marker on each such module. Inside, a marker the scan sliced to `()`
belongs to a sliced module (the stacked route of
`bridge.adapters.nnx.transforms`); otherwise the body
bumps it, and after the call a marker still holding the very array placed
was dropped: the module was broadcast, and discovery raises. A carried
module inside nested scans or inside another transform within the scan
raises `NotImplementedError` naming it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bridge.adapter_api import (
    Rule,
    Transform,
    add_epsilon,
    carrier_name,
    differentiable_part,
    positional_arrays,
    route,
)

from ..shared import jax_internals
from . import internals
from .variables import BridgeVariable, Origin


class NeedsCarried(Exception):
    """Discovery met a module inside `nnx.scan` whose parameters keep their
    full shape there (carried or broadcast, not sliced): it runs again with a
    marker on each such module, to tell which."""


def keeps_shape(module: nnx.Module, outside: nnx.Module) -> bool:
    """Whether the module's parameters inside the transform have the shapes
    they have outside it (true of a module without any): not sliced."""
    return _param_shapes(module) == _param_shapes(outside)


def has_params(module: nnx.Module) -> bool:
    """Whether the module (or a submodule) has parameters of its own."""
    return bool(_param_shapes(module))


def broadcast_by_scan(stop: Any, outside: nnx.Module) -> bool:
    """Whether the innermost `nnx.scan` running now broadcasts the module
    whose copy outside it is `outside` (`None` for its parameters): among the
    states its graph-mode wrapper split as broadcast (its `broadcast_deque`
    local, read up to the frame `stop`) is one of the module's parameter
    arrays. False where that cannot be read (a carried module keeps the
    same shapes; the scan's markers tell them apart, `discover`)."""
    broadcast = internals.scan_broadcasts(stop)
    try:
        leaves = jax.tree.leaves(list(broadcast))
    except TypeError:
        return False
    ids = {id(leaf) for leaf in leaves}
    return any(
        id(internals.get_value(variable)) in ids
        for _, variable in nnx.iter_graph(outside)
        if isinstance(variable, nnx.Param) and not isinstance(variable, BridgeVariable)
    )


def discover(run, module, marker, step_key, call, names, method, args, kwargs, session):
    """Discovery of a call whose module nnx.scan did not slice: the site
    holds every step, `(length, *value shape)`, as the scan's ys would.
    `run` is the `run.Run` of the copy."""
    frames = jax_internals.scan_frames(run.stop)
    if frames is None:
        raise jax_internals.unreadable_scan("Flax NNX")
    depth = internals.depth("scan")
    if names != ("nnx.scan",) or len(frames) != 1 or depth > 1:
        inner = [n for n in names if n != "nnx.scan"]
        where = (
            f"inside {' inside '.join(reversed(inner))} inside nnx.scan"
            if inner
            else "inside nested scans (nnx.scan or lax.scan inside nnx.scan)"
        )
        # Listed, and refused where selected or patched.
        scan = Transform(
            "nnx.scan",
            Rule.BLOCKS,
            "the scan carries the module (its parameters keep their full shape "
            f"there), and it is called {where}, where the carried route of "
            "bridge's variables does not reach",
            "call the carried module directly inside one nnx.scan",
        )
        return run.refused(
            call,
            route(call.path, (scan,)),
            method,
            module,
            args,
            kwargs,
            session,
        )
    length, reverse = frames[0]
    # Dropped if the scan broadcasts the module.
    internals.set_value(marker, internals.get_value(marker) + 1)
    run.variables.checks.append((call.path, step_key, names))  # in call order
    value = method(module, *args, **kwargs)
    call.origin = Origin(
        call.path,
        names,
        (length, reverse),
        session.arrays.abstract(differentiable_part(value)),
        session.arrays.abstract(positional_arrays(args)),
    )
    value = session.exit(call, value, record=False)
    session.recorder.holds_iterations(call.name, value, length)
    return value


def run_step(module, call, method, args, kwargs, session):
    """A selected (or patched) call whose module nnx.scan carries: its
    epsilon, patch value and recording hold every step; the carried
    counter picks the row."""
    site = session.selected.get(call.name) or session.patched[call.name]
    length, reverse = site.origin.scan
    variables = vars(module)

    def key(kind):
        return carrier_name(kind, call.method, call.index)

    counter = variables[key("step")]
    step = internals.get_value(counter)
    row = length - 1 - step if reverse else step
    epsilon = variables.get(key("epsilon"))
    patch = variables.get(key("patch"))

    def perturb(value):
        return add_epsilon(
            value, jax.tree.map(lambda e: e[row], internals.get_value(epsilon))
        )

    value = method(module, *args, **kwargs)
    rows = (  # this step's row of the stacked patch
        None
        if patch is None
        else jax.tree.map(lambda p: p[row], internals.get_value(patch))
    )
    value = session.exit(
        call,
        value,
        perturb if epsilon is not None else None,
        record=False,
        patch=rows,
    )
    internals.set_value(counter, step + 1)
    if call.name not in session.selected:
        return value
    recording = variables[key("recording")]
    values, inputs = internals.get_value(recording)
    values = _set_row(values, row, differentiable_part(value))
    if inputs is not None:
        inputs = _set_row(inputs, row, positional_arrays(args))
    internals.set_value(recording, (values, inputs))
    session.carrier.defer(call.name, (call.path, key("recording"), ("nnx.scan",)))
    return value


def body_trace(module: nnx.Module) -> Any:
    """The trace a parameter of the module's copy inside an NNX transform
    belongs to: the transform's body's, where the transform maps or slices
    it (`None` where no parameter is a tracer)."""
    for _, variable in nnx.iter_graph(module):
        if isinstance(variable, nnx.Param) and not isinstance(variable, BridgeVariable):
            trace = jax_internals.trace_of(internals.get_value(variable))
            if trace is not None:
                return trace
    return None


def _param_shapes(module: nnx.Module) -> dict:
    """The shapes of a module's parameters (its submodules' too), not bridge's."""
    return {
        path: jnp.shape(internals.get_value(variable))
        for path, variable in nnx.iter_graph(module)
        if isinstance(variable, nnx.Param) and not isinstance(variable, BridgeVariable)
    }


def _set_row(rows: Any, row: Any, values: Any) -> Any:
    return jax.tree.map(lambda r, v: r.at[row].set(v), rows, values)
