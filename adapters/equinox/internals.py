"""The Equinox internals the Equinox adapter relies on: all of them, and only here.

- the modules of Equinox's own classes (`equinox._module`): `eqx.Module` and
  the classes it derives from are no class of a model, and their methods and
  `__init_subclass__` hooks are Equinox's (`is_equinox_base`). Equinox
  exports no list of them.
- the frames of Equinox's while loops with a bound, of
  `equinox.filter_closure_convert`, and of the solves built on them
  (optimistix, diffrax): below.

JAX's private trace stack, which the adapter reads too, is
`bridge.adapters.shared.jax_internals`.

## Equinox's while loops

The Equinox internals bridge reads to see inside its while loops with a
bound.

`equinox.internal.while_loop(..., kind="checkpointed", max_steps=n)` (what
diffrax's `RecursiveCheckpointAdjoint` and optimistix's iterative solves
differentiated through the loop run on) traces its body once, with
`equinox.filter_closure_convert`, into a jaxpr its forward and backward
`lax.while_loop`s evaluate: the body's Python runs in that one trace, which
JAX names `jit`. The `bounded` kind (what diffrax's `DirectAdjoint` runs)
calls the same body in a nest of `lax.scan`s of `lax.cond`s (rounds of
`base` steps, each level but the lowest inside a `jax.checkpoint`), which
JAX differentiates natively. A call in either is a site of the session's
control-flow route (`bridge._session.backward`, `CHECKPOINTED_WHILE`: a loop
of at most `max_steps` steps, which may stop before): its epsilon and its
recorders are closed over, so the loop's backward pass differentiates them,
and the step takes its row by the loop's counter. `running` gives each such
loop with the traces it runs its body in, which
`bridge.adapters.equinox.loops.control_flow` reads as one loop.

Equinox exports neither the counter nor the bound to the body, so this module
reads them from the Python call stack: the `step` local of `new_body_fun`
(`equinox/internal/_loop/common.py`, the counter `common_rewrite` adds to the
carry, 0, 1, 2, ... and not mapped by a `vmap`), the `max_steps` local of
`checkpointed_while_loop` (`equinox/internal/_loop/checkpointed.py`) or of
`bounded_while_loop` (`equinox/internal/_loop/bounded.py`) that called it,
and the `max_steps` and `base` locals of the bounded kind's levels
(`_while_loop`). Checked against Equinox 0.11.5 and 0.13.8; where they
cannot be read, a call there is refused as what JAX names it, never probed
wrongly. A bounded loop of `max_steps=1` calls its body with no loop around
it: a call there is a site of one call, as outside the loop.

A call bridge cannot route there is named after what holds it, not after the
trace JAX opens (`blocking`): a checkpointed loop without `max_steps` (its
body's trace is a `jit`), the bounded kind's nest (named, and never the
blocker: what holds the loop is), an optimistix solve (it traces the
function it solves once, in `equinox.filter_closure_convert`'s `jit`), and a
diffrax solve whose adjoint runs it in a plain `while_loop`. A function
converted with `equinox.filter_closure_convert` elsewhere (lineax's
function operators, a model's own) is traced once, in the `jit` trace of
`jax.make_jaxpr`, and run as that trace at every call: `closure_converted`
names that trace, which blocks (`bridge.adapter_api.CONVERTED`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from bridge.adapter_api import (
    BOUNDED_WHILE,
    CHECKPOINTED_WHILE,
    CONVERTED,
    CONVERTED_FIX,
    LOOP_AMONG,
    Rule,
    Transform,
)

from ..shared import jax_internals

_BASE_MODULES = frozenset({"builtins", "abc", "typing", "collections.abc"})


def is_equinox_base(klass: type) -> bool:
    """`eqx.Module` and what it derives from: no class of a model."""
    module = klass.__module__
    return module.startswith("equinox._module") or module in _BASE_MODULES


# -- Equinox's while loops -----------------------------------------------------------

_BODY = ("new_body_fun", os.path.join("equinox", "internal", "_loop", "common.py"))
_CHECKPOINTED = (
    "checkpointed_while_loop",
    os.path.join("equinox", "internal", "_loop", "checkpointed.py"),
)
#: The other kinds of the loop (`lax`, `bounded`) call the same body: a
#: counter seen below one of them is not a checkpointed loop's.
_LAX_KIND = ("while_loop", os.path.join("equinox", "internal", "_loop", "loop.py"))
_BOUNDED_KIND = (
    "bounded_while_loop",
    os.path.join("equinox", "internal", "_loop", "bounded.py"),
)
_OTHER_KINDS = (_LAX_KIND, _BOUNDED_KIND)


#: `bounded_while_loop`'s nest: each level with `max_steps > 1` is a scan of
#: `base` steps whose body is a `lax.cond`, checkpointed but at the lowest.
_BOUNDED_LEVEL = (
    "_while_loop",
    os.path.join("equinox", "internal", "_loop", "bounded.py"),
)
_CLOSURE_CONVERT = ("filter_closure_convert", os.path.join("equinox", "_ad.py"))
_OPTIMISTIX = tuple(
    (name, os.path.join("optimistix", f"_{name}.py"))
    for name in ("root_find", "minimise", "least_squares", "fixed_point")
)
_DIFFRAX = ("diffeqsolve", os.path.join("diffrax", "_integrate.py"))

#: The names `blocking` gives (`jax_transforms.describe` shows them as they
#: are), each with why a call there has no route and the way out.
UNBOUNDED = "equinox.internal.while_loop (checkpointed, no max_steps)"
#: The bounded kind's nest as a refusal names it (`describe`) where a call
#: there is refused for what holds the loop: the loop itself is routed.
BOUNDED = 'equinox.internal.while_loop (kind="bounded")'
#: A function converted with `equinox.filter_closure_convert` outside a loop
#: or solve named otherwise (`closure_converted`).
CLOSURE_CONVERTED = "equinox.filter_closure_convert"
#: The rules of the loops with a bound, as `loops.enclosing` names
#: them: branches and loops of known bounds alone around a call route it
#: through the session's control flow; among other transforms they block.
RULES = {
    CHECKPOINTED_WHILE: Transform(
        "equinox.internal.while_loop",
        Rule.FLOWS,
        LOOP_AMONG,
        "move the other transform out of the loop",
    ),
    BOUNDED_WHILE: Transform(
        BOUNDED,
        Rule.FLOWS,
        LOOP_AMONG,
        "move the other transform out of the loop",
    ),
    CLOSURE_CONVERTED: Transform(
        CLOSURE_CONVERTED, Rule.BLOCKS, CONVERTED, CONVERTED_FIX
    ),
}
_SOLVE_WHY = (
    "optimistix traces the function it solves once (in "
    "equinox.filter_closure_convert) and its solver's loop runs that trace, "
    "so no call of a step reaches bridge"
)
REFUSALS = {
    UNBOUNDED: (
        "without `max_steps` how many steps run is known only when the model "
        "runs, so no epsilon or recording can be shaped for them",
        "give the loop `max_steps=` (a Python int: a site there then holds "
        "every step, `(max_steps, ...)`)",
    ),
}


def refusal(name: str) -> tuple[str, str] | None:
    """`(why, fix)` of a name `blocking` gives, `None` for another."""
    if name in REFUSALS:
        return REFUSALS[name]
    if name.startswith("optimistix."):
        return _SOLVE_WHY, "call the layer outside the solve"
    if name.startswith("diffrax.diffeqsolve"):
        return (
            "that adjoint runs the solve in a plain jax.lax.while_loop, whose "
            "steps are known only when the model runs (and which JAX cannot "
            "reverse-differentiate)",
            "use adjoint=diffrax.RecursiveCheckpointAdjoint() (the default), "
            "whose steps bridge probes one by one",
        )
    return None


def _is(frame: Any, where: tuple[str, str]) -> bool:
    name, path = where
    return frame.f_code.co_name == name and frame.f_code.co_filename.endswith(path)


def running() -> list[tuple[Any, int | None, Any, int]]:
    """`(step, max_steps, runs, depth)` of each Equinox while loop with a
    bound whose body is being traced now, innermost first: the loop's counter
    (a tracer of the body's innermost trace), its bound (`None` where the
    loop has none), whether this step runs for this example (the `pred`
    local: under a `vmap` the loop runs until every example has stopped, and
    selects the old carry of the examples that have), and how many traces,
    from the counter's outwards, the loop runs its body in: 1 for the
    checkpointed kind (its `jit`), the nest of `lax.cond`, `lax.scan` and
    `jax.checkpoint` for the bounded kind (`bounded_depth`)."""
    found = []
    step = runs = None
    levels: list[tuple[Any, Any]] = []
    frame = sys._getframe(1)
    while frame is not None:
        if _is(frame, _BODY):
            step, runs = frame.f_locals.get("step"), frame.f_locals.get("pred")
            levels = []
        elif step is not None and _is(frame, _BOUNDED_LEVEL):
            levels.append((frame.f_locals.get("max_steps"), frame.f_locals.get("base")))
        elif step is not None and _is(frame, _CHECKPOINTED):
            max_steps = frame.f_locals.get("max_steps")
            bound = max_steps if isinstance(max_steps, int) else None
            found.append((step, bound, runs, 1))
            step = None
        elif step is not None and _is(frame, _BOUNDED_KIND):
            max_steps = frame.f_locals.get("max_steps")
            depth = bounded_depth(levels)
            if isinstance(max_steps, int) and depth is not None:
                found.append((step, max_steps, runs, depth))
            step = None
        elif any(_is(frame, kind) for kind in _OTHER_KINDS):
            step = None
        frame = frame.f_back
    return found


#: JAX's names of the traces of the bounded kind's nest.
BOUNDED_NEST = frozenset({"cond", "scan", "checkpoint / remat"})


def bounded_depth(levels: list[tuple[Any, Any]]) -> int | None:
    """How many traces the bounded kind's nest opens around its body, from
    the `(max_steps, base)` of each level of `_while_loop` (innermost first):
    a level of more than one step is a `lax.scan` of `lax.cond`s, inside a
    `jax.checkpoint` but at the lowest (`max_steps == base`); a level of one
    step calls the body as it is. `None` where they cannot be read."""
    if not all(
        isinstance(steps, int) and isinstance(base, int) for steps, base in levels
    ):
        return None
    return sum(2 + (steps != base) for steps, base in levels if steps > 1)


def blocking(traces: list[Any], names: list[str]) -> dict[int, str]:
    """The names (`refusal`'s) of the traces among `traces` (those between
    here and the probe's call of the model, innermost first, JAX naming them
    `names`) that an Equinox loop or a solve built on one runs a call in
    with no route: `id(trace)` to its name. Read from the Python call stack;
    what cannot be read keeps JAX's name."""
    index = {id(trace): i for i, trace in enumerate(traces)}
    found: dict[int, str] = {}
    step = None
    levels: list[tuple[Any, Any]] = []  # the bounded nest's, innermost first
    unsolved: list[Any] = []  # lax-kind bodies and closure conversions
    frame = sys._getframe(1)
    while frame is not None:
        if _is(frame, _BODY):
            step, levels = frame.f_locals.get("step"), []
        elif step is not None and _is(frame, _BOUNDED_LEVEL):
            levels.append((frame.f_locals.get("max_steps"), frame.f_locals.get("base")))
        elif step is not None and _is(frame, _CHECKPOINTED):
            if not isinstance(frame.f_locals.get("max_steps"), int):
                _name(found, index, traces, step, 1, UNBOUNDED)
            step = None
        elif step is not None and _is(frame, _BOUNDED_KIND):
            count = bounded_depth(levels) or 0
            nest = _name(found, index, traces, step, count, BOUNDED)
            if nest and not all(names[i] in BOUNDED_NEST for i in nest):
                for i in nest:  # not the nest this Equinox builds
                    del found[id(traces[i])]
            step = None
        elif step is not None and _is(frame, _LAX_KIND):
            unsolved.append(jax_internals.trace_of(step))
            step = None
        elif step is None and _is(frame, _CLOSURE_CONVERT):
            unsolved.append(_innermost_jit(traces, names, found))
        elif any(_is(frame, solve) for solve in _OPTIMISTIX):
            for trace in unsolved:
                if id(trace) in index:
                    found[id(trace)] = f"optimistix.{frame.f_code.co_name}"
            unsolved = []
        elif _is(frame, _DIFFRAX):
            adjoint = type(frame.f_locals.get("adjoint")).__name__
            for trace in unsolved:
                if id(trace) in index and names[index[id(trace)]] == "while_body":
                    found[id(trace)] = f"diffrax.diffeqsolve (adjoint={adjoint})"
            unsolved = []
        frame = frame.f_back
    return found


def closure_converted(traces: list[Any], names: tuple[str, ...]) -> dict[int, str]:
    """`id(trace)` to `CLOSURE_CONVERTED` for each trace among `traces`
    (innermost first, JAX naming them `names`) that
    `equinox.filter_closure_convert` traces a function in, but the body of a
    checkpointed while loop (`running`): each conversion running now, read
    from the Python call stack, takes the innermost `jit` not taken yet."""
    found: dict[int, str] = {}
    frame = sys._getframe(1)
    while frame is not None:
        if _is(frame, _CLOSURE_CONVERT) and not (
            frame.f_back is not None and _is(frame.f_back, _CHECKPOINTED)
        ):
            trace = _innermost_jit(traces, list(names), found)
            if trace is not None:
                found[id(trace)] = CLOSURE_CONVERTED
        frame = frame.f_back
    return found


def _name(
    found: dict[int, str],
    index: dict[int, int],
    traces: list[Any],
    step: Any,
    count: int,
    name: str,
) -> list[int]:
    """Name the `count` traces from the one `step` belongs to outwards;
    their positions (none where it is not among `traces`)."""
    start = index.get(id(jax_internals.trace_of(step)))
    if start is None or start + count > len(traces):
        return []
    for trace in traces[start : start + count]:
        found[id(trace)] = name
    return list(range(start, start + count))


def _innermost_jit(traces: list[Any], names: list[str], found: dict) -> Any:
    """The trace `equinox.filter_closure_convert` traces in: the innermost
    `jit` not already named."""
    return next(
        (
            trace
            for trace, name in zip(traces, names, strict=True)
            if name in ("jit", "pjit") and id(trace) not in found
        ),
        None,
    )
