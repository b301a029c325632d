"""Flax Linen as a guest: Linen modules called inside another library's model.

`nnx.bridge.ToNNX` calls `module.apply` inside an NNX model; a Haiku function
or an Equinox module may call a Linen model's `apply` too. While another
library's adapter runs its model, `bridge.adapters.shared.guests` (which
finds this module by name, once `flax.linen` is imported) enters
`intercepting`: `nn.intercept_methods` catches every Linen module call made
inside it, and each is reported as a site named by its scope path under the
path of the site around it, as in the Linen adapter.

Lifted transforms (`nn.scan`, `nn.vmap`, ...) run their body in a new scope
root; the Linen adapter's own interceptor tells them the same way
(`entering_linen_lifted_scope`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
import weakref
from collections.abc import Iterator
from typing import Any

import flax.linen as nn

from bridge.adapter_api import BodyTraces, current_session

from ..shared import guests


class _LinenGuest(guests.Guest):
    """Linen modules called inside another library's model (`nnx.bridge.ToNNX`
    calls `module.apply`): sites named by scope path, as in the Linen adapter."""

    library = "linen"

    def __call__(self, next_fun, call_args, call_kwargs, context):
        session = current_session()
        if session is not self.host.session:
            return next_fun(*call_args, **call_kwargs)
        module, method = context.module, context.method_name
        if module.is_initializing():  # the model's code building a Linen model
            return next_fun(*call_args, **call_kwargs)
        root = module.scope.root
        frame, starts = self._frame(session, root)
        if not starts and root is not self.frames[-1].root:
            self._entering_lifted_scope(
                self.frames[-1], module, method, body_of(context)
            )
        run = functools.partial(
            guests.call_module, "linen", module, next_fun, call_args, call_kwargs
        )
        if (
            module.path == ()
            or method == "setup"
            or (method.startswith("_") and method != "__call__")
        ):
            return self._pass(frame, run)
        lifted = root is not frame.apply_root
        frame.inner_depth = guests.depth(session) + 1
        return self._observe(
            frame,
            guests.joined(frame.prefix, "/".join(module.path)),
            None if method == "__call__" else method,
            module,
            call_args,
            run,
            (frame.transform or "a Flax lifted transform") if lifted else None,
        )

    def _entering_lifted_scope(
        self, parent: guests.Frame, module: Any, method: str, body: Any
    ) -> None:
        """As the Linen adapter's interceptor (`entering_linen_lifted_scope`)."""
        transform = entering_linen_lifted_scope(parent.bodies, module, method, body)
        if transform is not None:
            parent.transform = transform


@contextlib.contextmanager
def intercepting(host: guests.Host) -> Iterator[None]:
    """Report the Linen module calls made inside, while `host` runs its model."""
    with nn.intercept_methods(_LinenGuest(host)):
        yield


def entering_linen_lifted_scope(
    bodies: BodyTraces, module: Any, method: str, body: Any = None
) -> str | None:
    """A Linen call in a new scope root (inside a lifted transform), whose
    parent frame holds `bodies`. A lifted transform's own module (`ScanBlock`,
    scope path `()`) is called before its body runs: it starts a new call of
    the body, and its transform's name is returned. A body's first call
    starts its trace, first or repeated (Flax traces a body more than once).
    In `nn.scan(nn.remat(Block))` the scan's body is the own module of the
    remat, `CheckpointBlock`, a base class of `ScanCheckpointBlock`: it is
    traced again as any body is, not a new call. A functional transform
    (`nn.scan(f)(self, x)`) has no module of its own: each trace of its body
    starts with a call of a clone of `self` at path `()`, a new trace of the
    same call while the transform's call (`transform_call`) is the same; the
    clone's `setup` before each trace starts nothing."""
    key = (module.path, module.name, method, type(module), body)
    call = transform_call()
    if call is not None and module.path == () and method == "setup":
        # A functional transform sets up its module's clone before each trace
        # of each body (every branch of an `nn.cond`): what starts a trace is
        # the call that follows.
        return linen_transform_name(module)
    if (
        module.path == ()
        and not any(
            started[0] == () and issubclass(started[3], type(module))
            for started in bodies
            if started[3] is not type(module)
        )
        and (call is None or _CALLS.get(bodies) is not call)
    ):
        bodies.clear()
        bodies.begin(key)
        if call is not None:
            _CALLS[bodies] = call
        return linen_transform_name(module)
    bodies.begin_or_again(key)
    return linen_transform_name(module) if module.path == () else None


def body_of(context: Any) -> Any:
    """The function an intercepted Linen call runs (`context.orig_method`),
    unwrapped from the partial and the bound method Flax makes of it for each
    trace: what tells the branches of one `nn.cond` apart, and is the same in
    each trace of one body."""
    function = getattr(context, "orig_method", None)
    function = getattr(function, "func", function)
    return getattr(function, "__func__", function)


#: The Python frame of the lifted transform's call each `BodyTraces` saw begin
#: last (kept alive, so that no later call's frame takes its id).
_CALLS: weakref.WeakKeyDictionary[BodyTraces, Any] = weakref.WeakKeyDictionary()


def _wrappers() -> frozenset[Any]:
    """The code of the functions a Linen lifted transform's call runs in, for
    the whole call (every trace of its body): the `wrapped_fn`s that
    `flax.linen.transforms` makes of a function or a module class."""
    found = set()

    def walk(code: Any) -> None:
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                if const.co_name == "wrapped_fn":
                    found.add(const)
                walk(const)

    for maker in (
        "decorator_lift_transform",
        "decorator_lift_transform_cached",
        "module_class_lift_transform",
        "module_class_lift_transform_cached",
    ):
        function = getattr(nn.transforms, maker, None)
        if function is not None:
            walk(function.__code__)
    return frozenset(found)


_WRAPPERS = _wrappers()


def transform_call() -> Any:
    """The Python frame of the innermost Linen lifted transform's call running
    now, or `None`. Flax traces a body more than once in one call
    (`nn.scan`: to create its broadcast variables, then once per type of
    carry `lax.scan` meets); a functional transform's body (`nn.scan(fn)`)
    starts each trace with a call of its module at path `()`, which is a new
    trace of the same call, not a new call, while this frame is the same."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _WRAPPERS:
            return frame
        frame = frame.f_back
    return None


_LINEN_TRANSFORMS = {
    "Scan": "nn.scan",
    "Vmap": "nn.vmap",
    "Checkpoint": "nn.remat",
    "Jit": "nn.jit",
    "While_loop": "nn.while_loop",
    "Map_variables": "nn.map_variables",
}


def linen_transform_name(module: Any) -> str:
    """`ScanBlock` (the class `nn.scan(Block)` makes) -> `nn.scan`."""
    name = type(module).__name__
    for prefix, transform in _LINEN_TRANSFORMS.items():
        if name.startswith(prefix):
            return transform
    return "a Flax lifted transform"
