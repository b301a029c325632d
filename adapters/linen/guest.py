"""Flax Linen as a guest: Linen modules called inside another library's model.

`nnx.bridge.ToNNX` calls `module.apply` inside an NNX model; a Haiku function
or an Equinox module may call a Linen model's `apply` too. While another
library's adapter runs its model, `bridge.adapters.shared.guests` (which
finds this module by name, once `flax.linen` is imported) enters
`intercepting`: `nn.intercept_methods` catches every Linen module call made
inside it, and each is reported as a site named by its scope path under the
path of the site around it, as in the Linen adapter. Inside a lifted
transform (`nn.scan`, `nn.vmap`, ...) the core reads where a call runs from
the computation.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import flax.linen as nn

from bridge.adapter_api import current_session

from ..shared import guests
from .run import is_no_site


class _LinenGuest(guests.Guest):
    """Linen modules called inside another library's model (`nnx.bridge.ToNNX`
    calls `module.apply`): sites named by scope path, as in the Linen adapter."""

    def __call__(self, next_fun, call_args, call_kwargs, context):
        session = current_session()
        if session is not self.host.session:
            return next_fun(*call_args, **call_kwargs)
        module, method = context.module, context.method_name
        if module.is_initializing():  # the model's code building a Linen model
            return next_fun(*call_args, **call_kwargs)
        frame, _ = self._frame(session)
        run = functools.partial(
            guests.call_module, "linen", module, next_fun, call_args, call_kwargs
        )
        if is_no_site(module.path, context):
            return self._pass(frame, run)
        frame.inner_depth = guests.depth(session) + 1
        return self._observe(
            frame,
            guests.joined(frame.prefix, "/".join(module.path)),
            None if method == "__call__" else method,
            module,
            call_args,
            run,
        )


@contextlib.contextmanager
def intercepting(host: guests.Host) -> Iterator[None]:
    """Report the Linen module calls made inside, while `host` runs its model."""
    with nn.intercept_methods(_LinenGuest(host)):
        yield
