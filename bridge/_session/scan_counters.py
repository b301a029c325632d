"""An iteration counter for the model's own `jax.lax.scan`, while a probe runs.

A `lax.scan` whose body closes over a layer (an RNN cell applied at every
time step, a block applied `n` times) calls the layer once per iteration
with the same parameters. Each iteration is a call of its own, so each
needs its own epsilon and its own recorded value, and the body must know
which iteration it runs: JAX gives a scan's body no index (a `fori_loop`'s
body has its counter; `jax_internals.fori_loop_rows` reads it).

So while a probe's session is active, `jax.lax.scan` called from the model's
code adds a counter to the scan's carry: an `int32` that is the index of the
iteration's `xs` (`length - 1` down to 0 under `reverse=True`, so that the
iteration's entry lines up with its `ys`). The body runs the model's
function unchanged, and `running` gives the counters of the scans whose
bodies are being traced now. A call there is then a call in a loop of known
bounds, the session's control-flow route (`bridge._session.backward`): its
epsilon and recorders are closed over, stacked on the iterations, and the
iteration takes its row by the counter. The model's outputs are unchanged
(the counter is dropped from the carry it returns); its program gains one
integer carry.

Only the model's code is counted: a scan that a library calls (Flax's
`nn.scan`, `nnx.scan`, Haiku's `hk.scan`, Equinox's loops: their packages
are registered by the adapters, `inside_functions.library_package`), JAX's
own (`jax.lax.map`, `fori_loop`) and bridge's are left as they are: the
libraries carry bridge's state through their own scans. A scan called by a
name bound before the probe ran (`from jax.lax import scan` at import) is
not counted either: a call in its body is refused, as the router says.

The wrapper is in `jax.lax` only while a probe runs (in any thread; in the
others, and outside the session, it passes every call on to JAX's scan),
and JAX's own function is put back when the last run ends, as
`bridge._session.jit` does for the model's `jax.jit`.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from . import context
from .inside_functions import is_library_module

_LOCK = threading.Lock()
#: Probe runs active now, in all threads.
_runs = 0
#: JAX's `jax.lax.scan`, while bridge's wrapper stands in for it.
_original: Callable | None = None
#: `(counter, length)` of each counted scan whose body is being traced now,
#: outermost first.
_RUNNING: contextvars.ContextVar[tuple[tuple[Any, int], ...]] = contextvars.ContextVar(
    "bridge_counted_scans", default=()
)
#: The modules of a library whose scans are counted all the same
#: (`count_scans_of`).
_COUNTED_LIBRARY_MODULES: set[str] = set()


def count_scans_of(module: str) -> None:
    """Count the scans the library module named `module` calls: an adapter
    whose library's scan carries none of bridge's state where it shares the
    parameters between iterations (Linen's `nn.scan` broadcasting `params`,
    as `nn.RNN` does) routes a call there as one in a loop of known bounds."""
    _COUNTED_LIBRARY_MODULES.add(module)


def running() -> tuple[tuple[Any, int], ...]:
    """`(counter, length)` of each counted scan whose body is being traced
    now, innermost first: the counter is a tracer of the scan body's trace,
    the index of the iteration's `xs`."""
    return tuple(reversed(_RUNNING.get()))


def _counts(caller: Any) -> bool:
    """Whether a scan called from the frame `caller` is the model's, during a
    probe's run."""
    if context.current() is None:
        return False
    module = caller.f_globals.get("__name__", "")
    return module in _COUNTED_LIBRARY_MODULES or not is_library_module(module)


def _length(xs: Any, length: int | None) -> int | None:
    import jax

    if length is not None:
        return length if isinstance(length, int) else None
    leaves = jax.tree.leaves(xs)
    shape = getattr(leaves[0], "shape", None) if leaves else None
    return shape[0] if shape else None


def _counted_scan(scan: Callable) -> Callable:
    signature = inspect.signature(scan)

    def counted(*args: Any, **kwargs: Any) -> Any:
        if not _counts(sys._getframe(1)):
            return scan(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:  # JAX says what is wrong
            return scan(*args, **kwargs)
        given = bound.arguments
        length = _length(given.get("xs"), given.get("length"))
        if length is None:  # JAX says what is wrong
            return scan(*args, **kwargs)
        import jax.numpy as jnp

        body = given["f"]
        reverse = bool(given.get("reverse", False))
        step = -1 if reverse else 1

        def counted_body(carry: Any, x: Any) -> Any:
            counter, inner = carry
            token = _RUNNING.set((*_RUNNING.get(), (counter, length)))
            try:
                inner, y = body(inner, x)
            finally:
                _RUNNING.reset(token)
            return (counter + step, inner), y

        given["f"] = counted_body
        given["init"] = (jnp.int32(length - 1 if reverse else 0), given["init"])
        (_, carry), ys = scan(*bound.args, **bound.kwargs)
        return carry, ys

    counted.__wrapped__ = scan  # type: ignore[attr-defined]
    return counted


def _acquire() -> None:
    global _runs, _original
    import jax

    with _LOCK:
        if _runs == 0:
            _original = jax.lax.scan
            jax.lax.scan = _counted_scan(_original)
        _runs += 1


def _release() -> None:
    """One probe run fewer: after the last, JAX's own scan back (unless
    something else replaced bridge's wrapper meanwhile: that stays)."""
    global _runs, _original
    import jax

    with _LOCK:
        _runs -= 1
        if _runs:
            return
        if getattr(jax.lax.scan, "__wrapped__", None) is _original:
            jax.lax.scan = _original
        _original = None


@contextlib.contextmanager
def counting() -> Iterator[None]:
    """Within it, the model's `jax.lax.scan`s count their iterations (see the
    module docstring)."""
    _acquire()
    try:
        yield
    finally:
        _release()
