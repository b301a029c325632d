"""The pullback that records sites inside branches and loops, through a
`lax.while_loop` the model runs elsewhere.

`bridge._session.backward.pulled_out` (what `probe.apply` records such
sites with, and Equinox's scanned stacks) brings each value out as the
cotangent `record` gives its recorders, whatever cotangent reaches
`record`: no number of that backward pass is a derivative anybody reads. It
must only reach every `record`, for the transpose of each loop and branch
around it to put the values in their rows (a loop's iterations, the branch
that ran). A `lax.while_loop` the model runs after a site (a tree search
on the network's outputs; a `fori_loop` with traced bounds) has no
transpose: JAX raises "Reverse-mode differentiation does not work for
lax.while_loop", and `apply` would fail where nothing is differentiated.

So within `while_loops_pass_zeros()`, in this thread, the transpose of a
while loop gives zero cotangents to its inputs (zero arrays, not JAX's
symbolic zeros, so that every `record` before it still runs its backward
pass): the values recorded are the same. A step that differentiates the
model (`value_and_grad`) never runs under it, so a while loop there still
raises. A site inside the while loop itself is refused before any work (the
router's `BLOCKS`), as before.

JAX has no public hook for this: the rule is JAX's transpose table,
`jax._src.interpreters.ad.primitive_transposes`, at
`jax._src.lax.control_flow.loops.while_p`. bridge's rule is there only
while a recording pullback runs (in any thread; in the others it passes
every call on to JAX's rule, which raises), and JAX's own is put back after
the last. Where
these internals are not found, nothing is changed: JAX's error is raised.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

#: Recording pullbacks running now, per thread.
_ACTIVE = threading.local()
_LOCK = threading.Lock()
#: Recording pullbacks running now, in all threads: bridge's rule is in
#: JAX's table only while there is one.
_runs = 0
#: `(table, while_p, JAX's rule)`, found once; `()` where not found.
_found: tuple | None = None


def _jax_rule() -> tuple:
    """JAX's transpose table, its while loop primitive and that primitive's
    rule; `()` where this JAX lays them out otherwise (call with `_LOCK`)."""
    global _found
    if _found is None:
        try:
            from jax._src.interpreters import ad
            from jax._src.lax.control_flow import loops

            table, primitive = ad.primitive_transposes, loops.while_p
            _found = (table, primitive, table[primitive])
        except (ImportError, AttributeError, KeyError):  # pragma: no cover
            _found = ()
    return _found


def _zeros(rule: Callable) -> Callable:
    """`rule`, JAX's transpose of a while loop, but in a recording pullback
    of this thread: zero cotangents for the loop's linear inputs."""

    def transpose(cotangents: Any, *primals: Any, **params: Any) -> list:
        if not getattr(_ACTIVE, "depth", 0):
            return rule(cotangents, *primals, **params)
        from jax._src.interpreters import ad

        return [
            ad.instantiate_zeros(ad.Zero(primal.aval))
            if ad.is_undefined_primal(primal)
            else None
            for primal in primals
        ]

    transpose.__wrapped__ = rule  # type: ignore[attr-defined]
    return transpose


def _acquire() -> None:
    global _runs
    with _LOCK:
        found = _jax_rule()
        if not found:
            return
        table, primitive, rule = found
        if _runs == 0:
            table[primitive] = _zeros(rule)
        _runs += 1


def _release() -> None:
    """One recording pullback fewer: after the last, JAX's own rule back
    (unless something else replaced bridge's meanwhile: that stays)."""
    global _runs
    with _LOCK:
        found = _jax_rule()
        if not found:
            return
        table, primitive, rule = found
        _runs -= 1
        if _runs == 0 and getattr(table[primitive], "__wrapped__", None) is rule:
            table[primitive] = rule


@contextlib.contextmanager
def while_loops_pass_zeros() -> Iterator[None]:
    """Within it, in this thread, a while loop's transpose gives zero
    cotangents (see the module docstring): for the pullback of a run whose
    cotangents only record."""
    _acquire()
    depth = getattr(_ACTIVE, "depth", 0)
    _ACTIVE.depth = depth + 1
    try:
        yield
    finally:
        _ACTIVE.depth = depth
        _release()
