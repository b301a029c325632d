"""Where a call runs inside Equinox's while loops: the adapter's side of the
core's one fallback.

Inside Equinox's checkpointed or bounded while loop (a `custom_vjp`, whose
backward pass calls the body again where the computation JAX builds does
not show it) a call cannot be read from the computation. There it takes
the session's control-flow route (`Session.call_in_control_flow`), for
which this module reads the loops around the call: `enclosing` names the
transforms between a call and the probe's call of the model, innermost
first, each with its rule (JAX's, `bridge.adapter_api.JAX_RULES`, and the
loops', `internals.RULES`), each Equinox loop's traces named as one;
`control_flow` reads where the call runs (a `ControlFlow`: each loop's row
and bound, from the loop's counter). A call there that no route reaches is
refused with the router's sentence (`bridge.adapter_api.blocked`), naming the
loop or the solve that holds it.

The trace stack is read through `bridge.adapters.shared.jax_internals`,
Equinox's frames through `internals`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from bridge.adapter_api import (
    BOUNDED_WHILE,
    CHECKPOINTED_WHILE,
    FORI_LOOP,
    JAX_RULES,
    ControlFlow,
    Rule,
    Transform,
)

from ..shared import jax_internals
from . import internals

#: A scan's name, and the loop JAX makes a `fori_loop` of static bounds.
SCANS = frozenset({"scan", "fori_loop"})


def traces(base: Any) -> Iterator[Any]:
    """The traces between this point and `base` (the trace the adapter's
    call of the model started in), innermost first."""
    trace = jax_internals.current_trace()
    while trace is not None and trace is not base:
        yield trace
        trace = jax_internals.parent(trace)


def name(trace: Any) -> str:
    """`vmap` for a `jax.vmap`'s trace, else JAX's name of the transform."""
    return "vmap" if jax_internals.is_vmap(trace) else jax_internals.traced_for(trace)


def transform_names(base: Any) -> tuple[str, ...] | None:
    """The names (`name`) of the transforms between here and `base`,
    innermost first; `None` where the trace stack cannot be read to `base`."""
    names = []
    trace = jax_internals.current_trace()
    while trace is not base:
        if trace is None:
            return None
        names.append(name(trace))
        trace = jax_internals.parent(trace)
    return tuple(names)


#: What a refusal names where the trace stack cannot be read (jax < 0.6.2).
UNKNOWN_TRANSFORM = "a transform whose enclosing trace this jax does not record"


def _read(base: Any) -> tuple[tuple[str, ...], list, dict] | None:
    """The transforms between here and `base`, innermost first, as
    `control_flow` and `route` read them: JAX's names, each trace of an
    Equinox loop named as one (the checkpointed kind's `jit`:
    `CHECKPOINTED_WHILE`; the bounded kind's nest of `cond`, `scan` and
    `checkpoint`: `BOUNDED_WHILE`), a `jit` that is a closure conversion
    named so (`internals.closure_converted`); the traces;
    and `{id of a loop's counter's trace: (step, max_steps, runs)}`. `None`
    where the trace stack cannot be read to `base`."""
    transforms = transform_names(base)
    if transforms is None:
        return None
    stack = list(traces(base))  # as `transforms` names them
    index = {id(trace): i for i, trace in enumerate(stack)}
    loops = {}
    within = {}  # positions of the loops' traces: the loop's name
    for step, max_steps, runs, depth in internals.running():
        start = index.get(id(jax_internals.trace_of(step)))
        if start is None or not depth:  # outside `base`, or no trace of its own
            continue
        if start + depth > len(stack):
            return None
        nest = range(start, start + depth)
        if depth > 1 and not all(transforms[i] in internals.BOUNDED_NEST for i in nest):
            return None
        loops[id(stack[start])] = (step, max_steps, runs)
        within.update(
            dict.fromkeys(nest, BOUNDED_WHILE if depth > 1 else CHECKPOINTED_WHILE)
        )
    transforms = tuple(within.get(i, name) for i, name in enumerate(transforms))
    if any(t in _JITS for t in transforms):
        # A `jit` trace is the model's `jax.jit`, traced through, or a
        # closure conversion, which blocks.
        converted = internals.closure_converted(stack, transforms)
        transforms = tuple(
            converted.get(id(trace), t) if t in _JITS else t
            for trace, t in zip(stack, transforms, strict=True)
        )
    return transforms, stack, loops


#: JAX's names of a `jax.jit`'s trace.
_JITS = frozenset({"jit", "pjit"})


def control_flow(base: Any) -> ControlFlow | None:
    """Where a call runs, where that is inside branches (`cond`, `switch`)
    and loops of known bounds (a `fori_loop` of static bounds, a `lax.scan`
    of the model's code, Equinox's while loops with `max_steps`) only,
    between here and `base` (a `jax.jit` is traced through): a call there
    is a site of `Session.call_in_control_flow`. `None` elsewhere, and
    where the trace stack or a loop's counter cannot be read."""
    read = _read(base)
    if read is None:
        return None
    transforms, stack, loops = read
    if not ControlFlow.expressible(transforms):
        return None
    fori_loops = jax_internals.fori_loop_rows(transforms.count(FORI_LOOP))
    if fori_loops is None:
        return None
    fori_loops = iter(fori_loops)
    found = []  # (row, length), innermost first
    runs = None  # whether the call runs for this example
    for trace, transform in zip(stack, transforms, strict=True):
        if transform == FORI_LOOP:
            found.append(next(fori_loops))
        elif id(trace) in loops:
            step, max_steps, step_runs = loops[id(trace)]
            found.append((step, max_steps))
            if step_runs is not None:
                runs = step_runs if runs is None else runs & step_runs
    if not found:
        return ControlFlow(transforms)
    if any(length is None for _, length in found):
        return None
    rows, lengths = zip(*reversed(found), strict=True)  # outermost first
    return ControlFlow(transforms, tuple(lengths), tuple(rows), runs)


def enclosing(base: Any) -> tuple[Transform, ...]:
    """The transforms between here and `base` (the trace of the adapter's
    call of the model), innermost first, each with its rule: Equinox's loops'
    (`internals.RULES`) and JAX's (`JAX_RULES`), by JAX's name (`_read`). One that
    neither knows blocks. Where the trace stack cannot be read to `base`
    (jax < 0.6.2 records no parent of a jaxpr trace), those it reads, then
    one that blocks standing for the rest (`UNKNOWN_TRANSFORM`)."""
    known = {**JAX_RULES, **internals.RULES}

    def rule(traced: str) -> Transform:
        return known.get(traced) or Transform(f"jax's {traced}", Rule.BLOCKS)

    read = _read(base)
    if read is None:
        return (*(rule(name(trace)) for trace in traces(base)), _UNRECORDED)
    return tuple(rule(transform) for transform in read[0])


#: What stands for the transforms past a trace whose parent this jax does
#: not record.
_UNRECORDED = Transform(
    UNKNOWN_TRANSFORM,
    Rule.BLOCKS,
    "bridge cannot tell which transforms hold the call",
    "upgrade jax: bridge reads the transforms around a call from jax 0.6.2",
)
