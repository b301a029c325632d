"""The JAX internals bridge's adapters rely on: all of them, and only here.

Where a call runs the core reads from the computation; what is read here
serves the adapters' few remaining needs: Equinox's while-loop fallback (the
transforms between a call and the probe's own trace, a static `fori_loop`'s
counter), the layout of the model's own `vmap`s around an Equinox call (for
`compare`), and the guest framework's check of the trace a guest call runs
in. JAX has no public API for the trace stack: `jax.extend` exports
`Primitive` but neither the current trace nor its parent. So this module
reads:

- `jax._src.core.trace_ctx.trace`, the trace now running, and a trace's
  `parent_trace` (JAX's "stackless" core, jax 0.4.36 onwards);
- `jax._src.interpreters.batching.BatchTrace`, the trace of a `jax.vmap`;
- a tracing trace's `frame.debug_info.traced_for`, JAX's name of the transform
  it traces (`scan`, `checkpoint / remat`), read with a fallback: it names
  transforms in errors and recognises `lax.scan` and `jax.checkpoint`;

`jax.extend.core` comes closest: `take_current_trace` changes the current
trace rather than reading it, and `unsafe_am_i_under_a_vmap_DO_NOT_USE` says
whether, not how deep or under what else.

One more is read inside Equinox's loops only: a static `lax.fori_loop`'s
counter and bounds, from the frames of `jax._src.lax.control_flow.loops`
(`fori_loop_rows`).

This module raises nothing at import: each adapter that uses it calls
`require(adapter)` at its own import, which checks that each exists and
raises an error naming that adapter and the supported versions where one
does not. An unsupported
JAX fails at `bridge.probe`, never with a wrong number.
"""

from __future__ import annotations

import inspect
import itertools
import os
import sys
from collections.abc import Iterator
from typing import Any

from bridge.adapter_api import unsupported

try:
    from jax._src import core as _core
    from jax._src.interpreters import batching as _batching
except ImportError as _error:
    _core = _batching = None
    _IMPORT_ERROR: str | None = str(_error)
else:
    _IMPORT_ERROR = None


def _missing() -> list[str]:
    if _IMPORT_ERROR is not None:
        return [_IMPORT_ERROR]
    missing = []
    if not hasattr(getattr(_core, "trace_ctx", None), "trace"):
        missing.append("jax._src.core.trace_ctx.trace")
    trace_class = getattr(_batching, "BatchTrace", None)
    if trace_class is None:
        missing.append("jax._src.interpreters.batching.BatchTrace")
    elif "parent_trace" not in inspect.signature(trace_class.__init__).parameters:
        missing.append("BatchTrace(parent_trace, ...)")
    if not isinstance(getattr(_batching, "fancy_primitive_batchers", None), dict):
        missing.append("jax.interpreters.batching.fancy_primitive_batchers")
    if "size" not in getattr(
        getattr(_batching, "AxisData", None), "__annotations__", {}
    ):
        missing.append("jax._src.interpreters.batching.AxisData.size")
    return missing


def supported() -> bool:
    """Whether this JAX has every internal read here (but the scan frame's)."""
    return not _missing()


def require(adapter: str) -> None:
    """Raise, naming `adapter` and the supported versions, where this JAX
    lacks an internal read here: the adapter calls it at its own import,
    before anything of it uses the trace stack. (Checked at each call, not
    once at this module's import: the module raises nothing, so it may stay
    imported from before a JAX module changed.)"""
    missing = _missing()
    if missing:
        raise unsupported("jax", adapter, missing)


def _loops_file() -> str | None:
    """The file of `lax.scan`'s and `fori_loop`'s own code."""
    try:
        from jax._src.lax.control_flow import loops
    except ImportError:
        return None
    return os.path.abspath(loops.__file__)


_LOOPS_FILE = _loops_file()


#: How a refusal names JAX's transforms, by a trace's `traced_for`.
TRANSFORM_NAMES = {
    "scan": "jax.lax.scan",
    "fori_loop": "jax.lax.fori_loop",
    "fori_loop (traced bounds)": "jax.lax.fori_loop with traced bounds",
    "checkpoint / remat": "jax.checkpoint",
    "checkpoint": "jax.checkpoint",  # its name on jax < 0.5
    "cond": "jax.lax.cond",
    "switch": "jax.lax.switch",
    "while_body": "jax.lax.while_loop",
    "while_cond": "jax.lax.while_loop",
    "vmap": "jax.vmap",
    "jit": "a jax.jit inside the model",
    "pjit": "a jax.jit inside the model",
}


def current_trace() -> Any:
    """The trace the computation at this point runs in."""
    return _core.trace_ctx.trace


def is_vmap(trace: Any) -> bool:
    return isinstance(trace, _batching.BatchTrace)


def trace_of(tracer: Any) -> Any:
    """The trace `tracer` belongs to (`None` for a concrete value)."""
    return getattr(tracer, "_trace", None)


def parent(trace: Any) -> Any:
    """The trace `trace` was opened in, or `None` if it cannot tell."""
    return getattr(trace, "parent_trace", None)


def mapped_dims(value: Any, trace: Any, depth: int) -> tuple[int | None, ...] | None:
    """Where each of the `depth` vmaps around this point maps `value`: the
    axis of its `BatchTracer` at that vmap's trace (`None`: not mapped there),
    innermost first, or `None` where a tracer's layout cannot be read. For a
    layer's input this is the `in_axes` the model's code gave its vmaps."""
    dims = []
    for _ in range(depth):
        if getattr(value, "_trace", None) is trace:
            dim = getattr(value, "batch_dim", None)
            if dim is not None and not isinstance(dim, int):
                return None  # a ragged axis: no position to name
            dims.append(dim)
            value = getattr(value, "val", None)
        else:
            dims.append(None)
        trace = parent(trace)
    return tuple(dims)


def traced_for(trace: Any) -> str:
    """JAX's name of the transform `trace` traces (`scan`, `checkpoint / remat`),
    or the trace's class name; a `fori_loop` whose bounds are traced (JAX
    runs it as a `while_loop`) is `FORI_LOOP_TRACED`."""
    name = _debug_name(trace) or type(trace).__name__
    if name == "fori_loop" and _fori_loop_kind(trace) == _FORI_WHILE_BODY:
        return FORI_LOOP_TRACED
    return name


#: `traced_for`'s name of a `fori_loop` of traced bounds.
FORI_LOOP_TRACED = "fori_loop (traced bounds)"


def _debug_name(trace: Any) -> str | None:
    debug = getattr(getattr(trace, "frame", None), "debug_info", None)
    return getattr(debug, "traced_for", None)


def _fori_loop_kind(trace: Any) -> str | None:
    """How JAX runs the `fori_loop` that `trace` traces the body of: its
    scan body's frame (`scanned_fun`, static bounds) or its while body's
    (`while_body_fun`, traced bounds), paired with the `fori_loop` traces
    from here outwards by order; `None` where no such frame is found."""
    position = 0
    current = current_trace()
    while current is not None and current is not trace:
        position += _debug_name(current) == "fori_loop"
        current = parent(current)
    kinds = (
        frame.f_code.co_name
        for frame in _loops_frames()
        if frame.f_code.co_name in (_FORI_BODY, _FORI_WHILE_BODY)
    )
    return next(itertools.islice(kinds, position, None), None)


def _loops_frames(stop: Any = None) -> Iterator[Any]:
    """The Python frames running `jax._src.lax.control_flow.loops`' own code
    (`lax.scan`, `fori_loop` and their bodies' wrappers), innermost first, up
    to the frame `stop`."""
    frame = sys._getframe(1)
    while frame is not None and frame is not stop:
        if os.path.abspath(frame.f_code.co_filename) == _LOOPS_FILE:
            yield frame
        frame = frame.f_back


_FORI_BODY = "scanned_fun"
_FORI_WHILE_BODY = "while_body_fun"
_FORI = "fori_loop"


def fori_loop_rows(count: int) -> list[tuple[Any, int]] | None:
    """`(iteration, length)` of the `count` innermost `lax.fori_loop`s of
    static bounds running now (JAX lowers each to a `lax.scan` whose carry
    holds the loop's counter), innermost first: the counter less the lower
    bound, a tracer of the loop's body, read from the frames of
    `jax._src.lax.control_flow.loops` (its scan body's `i`, `fori_loop`'s
    `lower_` and `length`). `None` where they cannot be read."""
    found: list[tuple[Any, int]] = []
    counter = None
    for frame in _loops_frames():
        if len(found) == count:
            break
        name, local = frame.f_code.co_name, frame.f_locals
        if name == _FORI_BODY and counter is None:
            counter = local.get("i")
        elif name == _FORI and counter is not None:
            lower, length = local.get("lower_"), local.get("length")
            if not (isinstance(lower, int) and isinstance(length, int)):
                return None
            found.append((counter - lower if lower else counter, length))
            counter = None
    return found if len(found) == count else None
