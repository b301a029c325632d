"""The probe at work in this context: a leaf every part may import.

Found through `ContextVar`s, so two threads (or two nested probes) never see
each other's. `active_session` is the session of the trace running now
(`bridge.tap` and the adapters' hooks report to it); `INSIDE` is the
`bridge._session.inside.Inside` of the probe whose discovery or run is in
progress, set by the core whatever the adapter: a `Request` made meanwhile
looks inside with it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

#: The name of the probe's own `jax.vmap` axis with `vmap=True`
#: (`bridge._probe.batching.BATCH_AXIS`): what the model's own vmaps are told
#: from.
PROBE_AXIS = "batch"

_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "bridge_session", default=None
)
INSIDE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "bridge_inside", default=None
)


def current() -> Any:
    """The session of the probe tracing the model now, if any (a
    `bridge._session.session.Session`)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def active(session: Any) -> Iterator[None]:
    """`session` is the current one for the length of the block."""
    token = _ACTIVE.set(session)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


_LOCAL_TAP: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "bridge_local_tap", default=False
)


def tapping_a_local() -> bool:
    """Whether the tap running now marks a local variable of the probe's
    `inside=` (the core's rewritten assignment), rather than a `bridge.tap`
    in the model's code: an adapter that cannot reach it raises, and the core
    lists the local as unreachable in its own words."""
    return _LOCAL_TAP.get()


@contextlib.contextmanager
def local_tap() -> Iterator[None]:
    """The tap within is a local's of `inside=` (`tapping_a_local`)."""
    token = _LOCAL_TAP.set(True)
    try:
        yield
    finally:
        _LOCAL_TAP.reset(token)
