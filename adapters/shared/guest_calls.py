"""The report of one guest call: the host as a guest sees it, and the frames
of a guest library's active calls.

A library's guest side (its package's `guest` module) builds on `Guest` and
`observe`, through `guests`, which re-exports them: library packages import
`guests` alone. They are apart from `guests`, the host's side (which
libraries get an interceptor while a host runs its model, and the wrappers),
because they are the report of one call: named under the site around it and
reported plainly, as a host's own calls are. Where it runs (a transform of
the host's code or of the guest's own) the core reads from the computation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from bridge.adapter_api import Session

# A guest call's apply is told by JAX's trace stack (Haiku's lifted modules).
# Where this JAX lacks it, no guest is installed (`guests.hosting`): their
# calls are not sites, never wrong ones.
from . import jax_internals


@dataclasses.dataclass
class Host:
    """The adapter running the model now, and the trace it runs it in."""

    session: Session
    library: str
    trace: Any


# -- reporting a guest call -------------------------------------------------------


def enclosing_path(session: Session) -> str:
    """The path of the innermost site being called now (`""` at the root)."""
    enclosing = session.enclosing
    return enclosing[-1] if enclosing else ""


def depth(session: Session) -> int:
    """How many sites are being called now: a guest call made at another depth
    than its library's last call is inside a site of another library."""
    return len(session.enclosing)


def joined(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def observe(
    session: Session,
    path: str,
    method: str | None,
    module: Any,
    args: tuple,
    call: Callable[[], Any],
) -> Any:
    """Report one guest call to the session, plainly: its epsilon, its patch
    and its recording are the session's, wherever it runs."""
    return session.exit(session.enter(path, method, module, args), call())


@dataclasses.dataclass
class Frame:
    """One active guest call, as its library's guest interceptor sees it.

    `prefix` is the path of the other library's site the guest model was called
    in, `inner_depth` the session's depth inside this call: a call at that
    depth is nested in this one. `trace` is the trace the guest model's apply
    started in. Haiku: `lift` is the name of the `LiftingModule`
    (`hk.experimental.layer_stack`, `hk.lift`) this call is inside, which
    names the calls inside it.
    """

    prefix: str
    inner_depth: int
    trace: Any
    lift: str | None = None


class Guest:
    """A guest interceptor: the frames of its library's active calls.

    A library's subclass (in its package's `guest` module) reports each of its
    calls with `_observe`, or passes one that is no site with `_pass`.
    """

    def __init__(self, host: Host):
        self.host = host
        self.frames: list[Frame] = []

    def _frame(self, session: Session) -> tuple[Frame, bool]:
        """The frame of a new call, and whether it starts a guest model's apply
        (its library's first call inside another library's site)."""
        top = self.frames[-1] if self.frames else None
        if top is None or top.inner_depth != depth(session):
            trace = jax_internals.current_trace()
            return Frame(enclosing_path(session), depth(session), trace), True
        return dataclasses.replace(top), False

    def _observe(self, frame, path, method, module, args, run):
        self.frames.append(frame)
        try:
            return observe(self.host.session, path, method, module, args, run)
        finally:
            self.frames.pop()

    def _pass(self, frame: Frame, run: Callable[[], Any]) -> Any:
        """A call that is no site, whose nested calls may be."""
        self.frames.append(frame)
        try:
            return run()
        finally:
            self.frames.pop()
