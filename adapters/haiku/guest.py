"""Haiku as a guest: Haiku modules called inside another library's model.

An `hk.transform`ed function's `apply` may be called inside an NNX, Linen or
Equinox model. While that library's adapter runs its model,
`bridge.adapters.shared.guests` (which finds this module by name, once
`haiku` is imported) enters `intercepting`: `hk.intercept_methods` catches
every Haiku module call made inside it, and each call the Haiku adapter
counts as a site (`is_site`) is reported named by `module_name` under the
path of the site around it, as in the Haiku adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import haiku as hk

from bridge.adapter_api import current_session

from ..shared import guests
from . import internals
from .run import is_site


class _HaikuGuest(guests.Guest):
    """Haiku modules called inside another library's model (an `hk.transform`ed
    function's `apply`): sites named by `module_name`, as in the Haiku adapter."""

    def __init__(self, host: guests.Host):
        super().__init__(host)
        # `{depth: name}` of the `LiftingModule` (`hk.experimental.layer_stack`,
        # `hk.lift`) last called at that depth: the calls inside it are named
        # under it, as their parameters are (`__layer_stack_no_per_layer/linear`).
        self.lifts: dict[int, str] = {}

    def __call__(self, next_fun, call_args, call_kwargs, context):
        session = current_session()
        if (
            session is not self.host.session
            or not is_site(context)
            or hk.running_init()  # the model's code building a Haiku model
        ):
            return next_fun(*call_args, **call_kwargs)
        depth = guests.depth(session)
        if internals.is_lifting(context.module):
            # Returns the lifted parameters, not an activation: not a site.
            self.lifts[depth] = context.module.module_name
            return next_fun(*call_args, **call_kwargs)
        frame, starts = self._frame(session)
        # An apply starting in the host's trace is inside no `LiftingModule`
        # (`_frame` gives a starting frame the trace running now); one starting
        # inside a transform is inside the one last called at its depth, if any.
        if starts and frame.trace is self.host.trace:
            self.lifts.pop(depth, None)
        elif starts:
            frame.lift = self.lifts.get(depth)
        name = context.module.module_name
        if frame.lift is not None:
            name = guests.joined(frame.lift, name)
        frame.inner_depth = depth + 1
        method = context.method_name
        return self._observe(
            frame,
            guests.joined(frame.prefix, name),
            None if method == "__call__" else method,
            context.module,
            call_args,
            lambda: next_fun(*call_args, **call_kwargs),
        )


@contextlib.contextmanager
def intercepting(host: guests.Host) -> Iterator[None]:
    """Report the Haiku module calls made inside, while `host` runs its model."""
    with hk.intercept_methods(_HaikuGuest(host)):
        yield
