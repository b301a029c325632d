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

from bridge.adapter_api import is_carrier_name

from ..shared import guests, jax_internals
from . import internals, surgery
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
        built = original(*args, **kwargs)
        # `ToLinen` loads every variable of its scope into the module it built,
        # and warns about (and adds) those the module lacks: bridge's own, in
        # `params` inside a Linen lifted transform. Give the module them.
        for name, value in _bridge_variables(module).items():
            setattr(built, name, nnx.Param(value))
        return run.instrument(built)

    object.__setattr__(module, "nnx_class", build)
    try:
        with surgery.running(run):
            return next_fun(*call_args, **call_kwargs)
    finally:
        object.__setattr__(module, "nnx_class", original)


def _bridge_variables(module: Any) -> dict[str, Any]:
    """The Linen adapter's variables in a Linen module's scope, by name."""
    return {
        name: value
        for collection in module.variables.values()
        for name, value in collection.items()
        if is_carrier_name(name)
    }


class GuestRun:
    """The NNX modules an `nnx.bridge.ToLinen` builds during one of its calls,
    inside a Linen model (see `call_to_linen`).

    Their submodules get reporting classes, named under the `ToLinen`'s path;
    each call's epsilon is the session's own. That is right where the calls
    run in the host's trace: a call inside a transform of the host's code, or
    of the NNX module's own (`nnx.scan`, whose body runs on new module
    objects), is listed but refused where selected.
    """

    def __init__(self, host: guests.Host, prefix: str):
        self.host = host
        self.prefix = prefix
        self.trace = jax_internals.current_trace()
        self.outer = internals.active_transforms()
        self.ids: dict[int, str] = {}

    def instrument(self, module: nnx.Module) -> nnx.Module:
        """`module`, built by `ToLinen` for this call, with reporting classes."""
        modules = surgery.instrument(module, self.prefix)
        self.ids.update({id(m): path for path, m in modules.items()})
        return module

    def report(self, module, method_name, method, args, kwargs, session):
        """A call of a module `instrument` gave a reporting class
        (`surgery.Reporter`)."""
        path = self.ids.get(id(module))
        blocked = self.host.transform_around(self.trace)
        if blocked is None and path is None:
            inner = [t for t in internals.active_transforms() if t not in self.outer]
            named = internals.transform_name(inner[-1]) if inner else "an NNX transform"
            blocked = f"{named} in the Flax NNX module's own code"
        elif blocked is None and jax_internals.current_trace() is not self.trace:
            blocked = "a JAX transform in the Flax NNX module's own code"
        return guests.observe(
            session,
            "nnx",
            path or vars(module).get(PATH_ATTRIBUTE, type(module).__name__),
            None if method_name == "__call__" else method_name,
            module,
            args,
            lambda: method(module, *args, **kwargs),
            blocked,
        )
