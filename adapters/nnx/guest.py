"""Flax NNX as a guest, and the Linen modules NNX models call.

NNX modules cannot be intercepted: their calls are plain Python calls. Inside
a Linen model, `nnx.bridge.ToLinen` builds a new NNX module from the Linen
variables on every call; Linen's interceptor (the Linen adapter's, or
Linen's guest) hands that call to `bridge.adapters.shared.guests.call_module`,
which finds `call_to_linen` here by name, once `flax.nnx` is imported. It
gives the module built reporting classes, as the NNX adapter gives its copy
(`bridge.adapters.nnx.surgery`), reporting to a `GuestRun`.

The other way round, `nnx.bridge.ToNNX` calls a Linen module's `apply` inside
an NNX model, where Linen's guest interceptor reports its calls; the NNX
adapter hides its own attributes from a `ToNNX` (`surgery.to_nnx_class`).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from ..shared import guests
from . import surgery
from .variables import PATH_ATTRIBUTE


def call_to_linen(
    host: guests.Host, module: Any, next_fun, call_args, call_kwargs
) -> Any:
    """Call a method of `module`, an `nnx.bridge.ToLinen`, with the NNX module
    it builds given reporting classes, so its submodules are sites named
    under the `ToLinen`'s path (`ToLinen_0/linear`), as Linen keys their
    parameters.

    `ToLinen.__call__` builds a new NNX module from the Linen variables on
    every call with `self.nnx_class(...)`; for the length of the call the
    bound `ToLinen` (Linen's own clone for this apply, not the user's
    module) builds it through a factory that instruments what it built.
    """
    if module.is_initializing():
        return next_fun(*call_args, **call_kwargs)
    run = GuestRun(host, guests.enclosing_path(host.session))
    original = module.__dict__["nnx_class"]

    def build(*args: Any, **kwargs: Any) -> Any:
        return run.instrument(original(*args, **kwargs))

    object.__setattr__(module, "nnx_class", build)
    try:
        with surgery.running(run):
            return next_fun(*call_args, **call_kwargs)
    finally:
        object.__setattr__(module, "nnx_class", original)


class GuestRun:
    """The NNX modules an `nnx.bridge.ToLinen` builds during one of its calls,
    inside a Linen model (see `call_to_linen`).

    Their submodules get reporting classes, named under the `ToLinen`'s path,
    and report plainly: inside a transform of the host's code or of the NNX
    module's own (`nnx.scan`, whose body runs on new module objects, named by
    the path they carry), the core reads where a call runs.
    """

    def __init__(self, host: guests.Host, prefix: str):
        self.host = host
        self.prefix = prefix
        self.ids: dict[int, str] = {}

    def instrument(self, module: nnx.Module) -> nnx.Module:
        """`module`, built by `ToLinen` for this call, with reporting classes."""
        modules = surgery.instrument(module, self.prefix)
        self.ids.update({id(m): path for path, m in modules.items()})
        return module

    def report(self, module, method_name, method, args, kwargs, session):
        """A call of a module `instrument` gave a reporting class
        (`surgery.Reporter`)."""
        path = self.ids.get(id(module)) or vars(module).get(
            PATH_ATTRIBUTE, type(module).__name__
        )
        return guests.observe(
            session,
            path,
            None if method_name == "__call__" else method_name,
            module,
            args,
            lambda: method(module, *args, **kwargs),
        )
