"""A `lax.scan` body that JAX traces twice lists its sites once.

JAX traces the body of a scan of the model's own code again where its carry
changes type (it starts as a Python `0` that the body turns into a float).
The calls of the discarded trace are forgotten, so a site there is one,
never a phantom `#1` (a refused site is listed whatever trace JAX keeps).
The body's trace is the innermost scan's, told by the frame of the
`lax.scan` running it (`jax_internals.scan_call`): a body JAX traces twice is
traced both times from that frame. The Linen, NNX, Equinox and Haiku
adapters ask at each call and each tap that may run in a scan's body
(`ScanBodies.traced`).
"""

from __future__ import annotations

from typing import Any

from bridge.adapter_api import BodyTraces, Session

from . import jax_internals, unexpressible


class ScanBodies:
    """The bodies of the model's own `lax.scan`s traced in one run: for each
    scan's frame, its body's trace now. `base` is the trace the adapter's
    call of the model started in, `stop` that call's Python frame."""

    def __init__(self, session: Session, base: Any, stop: Any):
        self.base = base
        self.stop = stop
        self.traces = BodyTraces(session)
        self.bodies: dict[Any, Any] = {}

    def traced(self) -> None:
        """A call (or a tap) now, maybe inside a scan's body: where that body
        is traced again, the calls of its trace before are forgotten."""
        scan = jax_internals.scan_call(self.stop)
        if scan is None:
            return
        body = next(
            (
                t
                for t in unexpressible.traces(self.base)
                if unexpressible.name(t) in unexpressible.SCANS
            ),
            None,
        )
        first = self.bodies.setdefault(scan, body)
        if first is body:
            if scan not in set(self.traces):
                self.traces.begin(scan)
        else:  # the same scan's body, traced again
            self.traces.again(scan)
            self.bodies[scan] = body
