"""The Equinox internals bridge reads to see inside a checkpointed while loop.

`equinox.internal.while_loop(..., kind="checkpointed", max_steps=n)` (what
diffrax's `RecursiveCheckpointAdjoint` and optimistix's iterative solves
differentiated through the loop run on) traces its body once, with
`equinox.filter_closure_convert`, into a jaxpr its forward and backward
`lax.while_loop`s evaluate: the body's Python runs in that one trace, which
JAX names `jit`. A call there is a site of the session's control-flow route
(`bridge._session.backward`, `CHECKPOINTED_WHILE`): its epsilon and its
recorders are closed over, so the closure conversion makes them inputs the
loop's custom backward pass differentiates, and the step takes its row by the
loop's counter.

Equinox exports neither the counter nor the bound to the body, so this module
reads them from the Python call stack: the `step` local of `new_body_fun`
(`equinox/internal/_loop/common.py`, the counter `common_rewrite` adds to the
carry, 0, 1, 2, ... and not mapped by a `vmap`) and the `max_steps` local of
`checkpointed_while_loop` (`equinox/internal/_loop/checkpointed.py`) that
called it. Checked against Equinox 0.11.5 and 0.13.8; where they cannot be
read, a call there is refused as what JAX names it, never probed wrongly.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_BODY = ("new_body_fun", os.path.join("equinox", "internal", "_loop", "common.py"))
_CHECKPOINTED = (
    "checkpointed_while_loop",
    os.path.join("equinox", "internal", "_loop", "checkpointed.py"),
)
#: The other kinds of the loop (`lax`, `bounded`) call the same body: a
#: counter seen below one of them is not a checkpointed loop's.
_OTHER_KINDS = (
    ("while_loop", os.path.join("equinox", "internal", "_loop", "loop.py")),
    ("bounded_while_loop", os.path.join("equinox", "internal", "_loop", "bounded.py")),
)


def _is(frame: Any, where: tuple[str, str]) -> bool:
    name, path = where
    return frame.f_code.co_name == name and frame.f_code.co_filename.endswith(path)


def running() -> list[tuple[Any, int | None, Any]]:
    """`(step, max_steps, runs)` of each checkpointed while loop whose body is
    being traced now, innermost first: the loop's counter (a tracer of the
    body's trace), its bound (`None` where the loop has none), and whether
    this step runs for this example (the `pred` local: under a `vmap` the
    loop runs until every example has stopped, and selects the old carry of
    the examples that have)."""
    found = []
    step = runs = None
    frame = sys._getframe(1)
    while frame is not None:
        if _is(frame, _BODY):
            step, runs = frame.f_locals.get("step"), frame.f_locals.get("pred")
        elif step is not None and _is(frame, _CHECKPOINTED):
            max_steps = frame.f_locals.get("max_steps")
            bound = max_steps if isinstance(max_steps, int) else None
            found.append((step, bound, runs))
            step = None
        elif any(_is(frame, kind) for kind in _OTHER_KINDS):
            step = None
        frame = frame.f_back
    return found
