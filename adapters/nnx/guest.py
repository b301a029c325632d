"""Flax NNX as a guest, and the Linen modules NNX models call.

NNX modules cannot be intercepted: their calls are plain Python calls. Inside
a Linen model, `nnx.bridge.ToLinen` builds a new NNX module from the Linen
variables on every call; Linen's interceptor (the Linen adapter's, or
Linen's guest) hands that call to `bridge.adapters.shared.guests.call_module`,
which finds `call_to_linen` here by name, once `flax.nnx` is imported. It
gives the module built reporting classes, as the NNX adapter gives its copy
(`probe.GuestRun`).

The other way round, `nnx.bridge.ToNNX` calls a Linen module's `apply` inside
an NNX model, where Linen's guest interceptor reports its calls; the NNX
adapter hides its own attributes from a `ToNNX` (`to_nnx_class`).
"""

from __future__ import annotations

import sys
from typing import Any

from flax import nnx

from bridge.adapter_api import is_carrier_name

from ..shared import guests


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
    # Here, not at the top: `probe` imports this module (`to_nnx_class`).
    from .probe import GuestRun, running

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
        with running(run):
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


def to_nnx_class() -> type | None:
    """`nnx.bridge.ToNNX`, where NNX's bridge was imported (a model using it
    must have)."""
    wrappers = sys.modules.get("flax.nnx.bridge.wrappers")
    return getattr(wrappers, "ToNNX", None)
