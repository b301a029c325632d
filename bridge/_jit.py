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
this module reads two functions of `jax._src.pjit` (jax 0.5 onwards): the
jitted function's cache miss calls `_infer_params`, then `_run_python_pjit`;
bridge answers the first with a marker and the second with the function's
own outputs. A jitted function that JAX serves from its C++ cache never
reaches them: a probe entered eagerly therefore runs under an XLA metadata
context of its own, which JAX's caches key on, so every call misses.
Where these internals are not found (another JAX), nothing is changed, and
a site the model's cached trace hides is caught by the check after the run
(`RunRecorder.check_reached`): an error, never a silent zero.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator

#: How many probe runs are active now, per thread: jitted calls are inlined
#: only there.
_ACTIVE = threading.local()
_INSTALL_LOCK = threading.Lock()
_installed: bool | None = None  # None: not tried yet; False: not possible


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


def _install() -> bool:
    """Wrap `_infer_params` and `_run_python_pjit` once; whether it could."""
    global _installed
    with _INSTALL_LOCK:
        if _installed is not None:
            return _installed
        try:
            from jax._src import pjit
        except ImportError:  # pragma: no cover - another JAX's layout
            _installed = False
            return False
        infer_params = getattr(pjit, "_infer_params", None)
        run_python_pjit = getattr(pjit, "_run_python_pjit", None)
        cache_miss_reads = pjit._cpp_pjit.__code__.co_consts
        if (
            infer_params is None
            or run_python_pjit is None
            or not any(
                getattr(const, "co_name", None) == "cache_miss"
                and {"_infer_params", "_run_python_pjit"} <= set(const.co_names)
                for const in cache_miss_reads
            )
        ):
            _installed = False
            return False

        def bridge_infer_params(fun, jit_info, args, kwargs):
            caller = sys._getframe(1).f_code.co_name
            if caller == "cache_miss" and _inlines(fun):
                return _Inlined(fun), []
            return infer_params(fun, jit_info, args, kwargs)

        def bridge_run_python_pjit(p, args_flat, fun, args, kwargs):
            if isinstance(p, _Inlined):
                outputs = p.fun(*args, **kwargs)
                return outputs, [], None, [], _NoJaxpr(), None, None, []
            return run_python_pjit(p, args_flat, fun, args, kwargs)

        pjit._infer_params = bridge_infer_params
        pjit._run_python_pjit = bridge_run_python_pjit
        _installed = True
        return True


def _eager() -> bool:
    from jax._src import core

    return core.trace_state_clean()


@contextlib.contextmanager
def traced_through() -> Iterator[bool]:
    """Within it, the model's jitted functions run inline (see the module's
    docstring). Yields whether they do: `False` on a JAX whose internals are
    not the ones read here."""
    if not _install():
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


def inlining_supported() -> bool:
    """Whether this JAX lets bridge run the model's `jax.jit`s inline."""
    return _install()
