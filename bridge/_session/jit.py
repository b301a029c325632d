"""The model's own `jax.jit`, traced through while a probe runs.

A site is a call in the computation that runs. A `jax.jit` (or
`eqx.filter_jit`, which is built on it) inside the model breaks that in two
ways when JAX caches its trace: a function traced once before (by `init`,
by bridge's own discovery, by an earlier call at the same shapes) runs no
Python at all, so its `bridge.tap`s and submodule calls are never seen; and
a function called twice in one model re-uses its first trace, epsilon
included, so the two calls' gradients are summed into one site. And where
the Python does run, it runs in the jit's own trace, from which no recorded
value can leave.

So while a probe's session is active, bridge calls a jitted function of the
model's code as `jax.disable_jit` would: its Python runs inline, in the
trace the probe is in, once per call. Numbers are unchanged (an inner
`jit` only groups operations that XLA compiles together anyway); sharding
annotations given to the inner `jit` itself are dropped during the probe's
run. JAX's own jitted library functions (`jax.nn.relu`, `jnp.linalg`) are
left as they are: they hold no site.

JAX has no public hook for this. `jax.disable_jit` itself would unroll
every `lax.scan` into Python and so change the sites of scanned stacks, so
this module wraps what a jitted function's cache miss calls in
`jax._src.pjit` (`_infer_params` and `_run_python_pjit` from jax 0.8,
`_python_pjit_helper` before) so that, in a probe's run, it returns the
function's own outputs, computed in the caller's trace. The wrappers are
in `jax._src.pjit` only while a probe runs (in any thread; in the others
they pass every call on to JAX's function) and JAX's own functions are put
back when the last run ends: code that runs beside bridge, before or after
a probe, meets JAX as it is. `TESTED_ON` names the releases checked. A jitted function
that JAX serves from its C++ cache never reaches them: a probe entered
eagerly therefore runs under an XLA metadata context of its own, which
JAX's caches key on, so every call misses.
Where these internals are not found (another JAX), nothing is changed, and
a site the model's cached trace hides is caught by the check after the run
(`RunRecorder.check_reached`): an error, never a silent zero.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

#: The JAX releases this interception was tested on: both ends of the
#: supported range and the floor of Flax NNX (the floors job and the main
#: job run its tests). The `_python_pjit_helper` layout runs from 0.4.36 to
#: 0.7, the `_infer_params` / `_run_python_pjit` layout from 0.8. A release
#: outside them is used only where `_wrappers` finds one of these layouts in
#: its `jax._src.pjit`.
TESTED_ON = ("0.4.36", "0.7.1", "0.10.2")

#: How many probe runs are active now, per thread: jitted calls are inlined
#: only there.
_ACTIVE = threading.local()
_LOCK = threading.Lock()
#: `{name in jax._src.pjit: (JAX's function, bridge's wrapper)}`, made once;
#: empty where this JAX's layout is not known. None: not made yet.
_made: dict[str, tuple[Callable, Callable]] | None = None
#: Probe runs active now, in all threads: the wrappers are in `jax._src.pjit`
#: only while there is one, and JAX's own functions are put back after.
_runs = 0


class _Inlined:
    """`_infer_params`' answer for a call bridge runs inline."""

    __slots__ = ("fun",)

    def __init__(self, fun: Callable):
        self.fun = fun


class _NoJaxpr:
    """What `cache_miss` reads of the jaxpr of a call that ran inline."""

    effects: tuple = ()
    consts: tuple = ()


def _inlines(fun: Callable) -> bool:
    if not getattr(_ACTIVE, "depth", 0):
        return False
    target = getattr(fun, "func", fun)  # a functools.partial
    module = getattr(target, "__module__", None) or ""
    return not (module == "jax" or module.startswith(("jax.", "jaxlib")))


def _inline_result(outputs: Any) -> tuple:
    """What `cache_miss` unpacks from a call bridge ran inline, in every
    layout `_wrappers` knows: the outputs, then no fast path."""
    import jax

    return outputs, [], jax.tree.structure(()), [], _NoJaxpr(), None, None, None


def _calls(names: set[str]) -> bool:
    """Whether `jax.jit`'s cache miss calls these functions of its module."""
    from jax._src import pjit

    return any(
        getattr(const, "co_name", None) == "cache_miss" and names <= set(const.co_names)
        for const in pjit._cpp_pjit.__code__.co_consts
    )


def _wrappers() -> dict[str, tuple[Callable, Callable]]:
    """bridge's wrappers of what `jax.jit`'s cache miss calls, beside JAX's
    functions, made once (call with `_LOCK` held).

    Two layouts: jax >= 0.8 calls `_infer_params` then `_run_python_pjit`;
    jax 0.4.36 to 0.7 calls `_python_pjit_helper`. Both unpack an 8-tuple
    whose first item is the outputs and whose executable and profiler,
    `None` here, mean "no fast path"."""
    global _made
    if _made is not None:
        return _made
    _made = {}
    try:
        from jax._src import pjit
    except ImportError:  # pragma: no cover - another JAX's layout
        return _made
    if _calls({"_infer_params", "_run_python_pjit"}):
        infer_params = pjit._infer_params
        run_python_pjit = pjit._run_python_pjit

        def bridge_infer_params(fun, jit_info, args, kwargs):
            if sys._getframe(1).f_code.co_name == "cache_miss" and _inlines(fun):
                return _Inlined(fun), []
            return infer_params(fun, jit_info, args, kwargs)

        def bridge_run_python_pjit(p, args_flat, fun, args, kwargs):
            if isinstance(p, _Inlined):
                return _inline_result(p.fun(*args, **kwargs))
            return run_python_pjit(p, args_flat, fun, args, kwargs)

        _made = {
            "_infer_params": (infer_params, bridge_infer_params),
            "_run_python_pjit": (run_python_pjit, bridge_run_python_pjit),
        }
    elif _calls({"_python_pjit_helper"}):
        python_pjit_helper = pjit._python_pjit_helper

        def bridge_python_pjit_helper(fun, jit_info, *args, **kwargs):
            if sys._getframe(1).f_code.co_name == "cache_miss" and _inlines(fun):
                return _inline_result(fun(*args, **kwargs))
            return python_pjit_helper(fun, jit_info, *args, **kwargs)

        _made = {"_python_pjit_helper": (python_pjit_helper, bridge_python_pjit_helper)}
    return _made


def _acquire() -> bool:
    """One more probe run: bridge's wrappers in place; whether they could be."""
    global _runs
    with _LOCK:
        made = _wrappers()
        if not made:
            return False
        if _runs == 0:
            from jax._src import pjit

            for name, (_, wrapper) in made.items():
                setattr(pjit, name, wrapper)
        _runs += 1
        return True


def _release() -> None:
    """One probe run fewer: after the last, JAX's own functions back (unless
    something else replaced bridge's wrapper meanwhile: that stays)."""
    global _runs
    with _LOCK:
        _runs -= 1
        if _runs:
            return
        from jax._src import pjit

        for name, (original, wrapper) in _wrappers().items():
            if getattr(pjit, name) is wrapper:
                setattr(pjit, name, original)


def _eager() -> bool:
    from jax._src import core

    return core.trace_state_clean()


@contextlib.contextmanager
def traced_through() -> Iterator[bool]:
    """Within it, the model's jitted functions run inline (see the module's
    docstring). Yields whether they do: `False` on a JAX whose internals are
    not the ones read here."""
    if not _acquire():
        yield False
        return
    depth = getattr(_ACTIVE, "depth", 0)
    _ACTIVE.depth = depth + 1
    try:
        if depth == 0 and _eager():
            # The C++ cache of a jitted function called eagerly, with arrays,
            # is consulted before any Python runs; it keys on the metadata.
            from jax.experimental.xla_metadata import set_xla_metadata

            with set_xla_metadata(bridge_probe="inline"):
                yield True
        else:
            yield True
    finally:
        _ACTIVE.depth = depth
        _release()


def inlining() -> bool:
    """Whether the model's jitted functions run inline in this thread now:
    then none of them opens a trace of its own, and a trace JAX names `jit`
    around a call is one the model's code makes apart (`jax.make_jaxpr`,
    `equinox.filter_closure_convert`, a `jax.jit(...).trace`), which no
    value of the call leaves (`bridge._session.routing.TRACED_APART`)."""
    return bool(getattr(_ACTIVE, "depth", 0))


def inlining_supported() -> bool:
    """Whether this JAX lets bridge run the model's `jax.jit`s inline."""
    with _LOCK:
        return bool(_wrappers())
