"""The report of one guest call: the host as a guest sees it, the frames of
a guest library's active calls, and the transform a call is inside.

A library's guest side (its package's `guest` module) builds on `Guest` and
`observe`, through `guests`, which re-exports them: library packages import
`guests` alone. They are apart from `guests`, the host's side (which
libraries get an interceptor while a host runs its model, and the wrappers),
because they judge one call where it runs: whether it is in the trace the
host runs the model in, and if not, which transform's, in the words of the
error that refuses it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from bridge.adapter_api import (
    BodyTraces,
    BridgeValueError,
    Rule,
    Session,
    Transform,
    route,
)

# Telling whether a guest call runs in the host's trace needs JAX's trace
# stack. Where this JAX lacks it, no guest is installed (`guests.hosting`):
# their calls are not sites, never wrong ones.
from . import jax_internals
from .guest_libraries import title


@dataclasses.dataclass
class Host:
    """The adapter running the model now, and the trace it runs it in."""

    session: Session
    library: str
    trace: Any
    describe: Callable[[], str | None]

    def transform_around(self, trace: Any) -> str | None:
        """The host's transform that a call in `trace` is inside, or `None`."""
        if trace is self.trace:
            return None
        named = self.describe()
        where = f"{named} in" if named else f"{trace_name(trace)} in"
        return f"{where} the {title(self.library)} model's own code"


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
    library: str,
    path: str,
    method: str | None,
    module: Any,
    args: tuple,
    call: Callable[[], Any],
    blocked: str | None,
) -> Any:
    """Report one guest call to the session: its epsilon is the session's.

    A call inside a transform (`blocked` names it) is listed by discovery and
    otherwise only counted; selecting or patching it raises the router's
    sentence: the guest library carries none of bridge's state through its
    host's transforms, so every one of them blocks.
    """
    entered = session.enter(path, method, module, args, record=blocked is None)
    if blocked is not None and (
        entered.name in session.selected or entered.name in session.patches
    ):
        guest = title(library)
        transform = Transform(
            blocked,
            Rule.BLOCKS,
            f"a {guest} module called inside another library's model, it is "
            f"inside {blocked}, where its value belongs to the transform's own "
            "trace (one iteration's inside a scan, one example's inside a "
            "vmap): a recording cannot leave it, and an epsilon from outside "
            "would serve every iteration and sum their gradients",
            f"probe the {guest} module on its own",
        )
        raise BridgeValueError(route(entered.name, (transform,)).sentence)
    return session.exit(entered, call(), record=blocked is None)


@dataclasses.dataclass
class Frame:
    """One active guest call, as its library's guest interceptor sees it.

    `prefix` is the path of the other library's site the guest model was called
    in, `inner_depth` the session's depth inside this call: a call at that
    depth is nested in this one. `trace` is the trace the guest model's apply
    started in. Linen: `apply_root` is the scope root of that apply, `root`
    this call's (another inside a lifted transform), `transform` the lifted
    transform entered last and `bodies` the checkpoints of the lifted bodies
    traced from this call. Haiku: `lift` is the name of the `LiftingModule`
    (`hk.experimental.layer_stack`, `hk.lift`) this call is inside.
    """

    prefix: str
    inner_depth: int
    trace: Any
    apply_root: Any = None
    root: Any = None
    transform: str | None = None
    bodies: BodyTraces | None = None
    lift: str | None = None


class Guest:
    """A guest interceptor: the frames of its library's active calls.

    A library's subclass (in its package's `guest` module) sets `library` and
    reports each of its calls with `_observe`, or passes one that is no site
    with `_pass`.
    """

    library = ""
    #: Whether a guest model's first call is its root, made where its apply is
    #: (Linen); Haiku has no root module.
    starts_at_apply = True

    def __init__(self, host: Host):
        self.host = host
        self.frames: list[Frame] = []

    def _frame(self, session: Session, root: Any = None) -> tuple[Frame, bool]:
        """The frame of a new call, and whether it starts a guest model's apply
        (its library's first call inside another library's site)."""
        top = self.frames[-1] if self.frames else None
        if top is None or top.inner_depth != depth(session):
            trace = jax_internals.current_trace()
            return (
                Frame(
                    enclosing_path(session),
                    depth(session),
                    trace,
                    root,
                    root,
                    bodies=BodyTraces(session),
                ),
                True,
            )
        return dataclasses.replace(top, root=root, bodies=BodyTraces(session)), False

    def _blocked(self, frame: Frame, own_transform: str | None) -> str | None:
        """The transform a guest call is inside, if any: the host's around the
        guest model's apply, or the guest model's own inside it."""
        guest = title(self.library)
        trace = jax_internals.current_trace()
        around = frame.trace is not self.host.trace
        if around and (self.starts_at_apply or self.host.describe() is not None):
            return self.host.transform_around(frame.trace)
        if own_transform is not None:
            return f"{own_transform} in the {guest} module's own code"
        if around:
            # Haiku has no root module: the first call seen may already be
            # inside a transform of the Haiku function.
            host = title(self.host.library)
            return (
                f"{trace_name(trace)} in the {host} model's own code or the "
                f"{guest} function's"
            )
        if trace is frame.trace:
            return None
        return f"{trace_name(trace)} in the {guest} module's own code"

    def _observe(self, frame, path, method, module, args, run, own_transform=None):
        self.frames.append(frame)
        try:
            return observe(
                self.host.session,
                self.library,
                path,
                method,
                module,
                args,
                run,
                self._blocked(frame, own_transform),
            )
        finally:
            self.frames.pop()

    def _pass(self, frame: Frame, run: Callable[[], Any]) -> Any:
        """A call that is no site, whose nested calls may be."""
        self.frames.append(frame)
        try:
            return run()
        finally:
            self.frames.pop()


# -- naming transforms --------------------------------------------------------------


def trace_name(trace: Any) -> str:
    """What JAX calls the transform `trace` traces, for an error message."""
    if jax_internals.is_vmap(trace):
        return "a jax.vmap"
    traced_for = jax_internals.traced_for(trace)
    if traced_for == "scan":
        return "a lax.scan"
    if "checkpoint" in traced_for or "remat" in traced_for:
        return "a jax.checkpoint"
    return f"a JAX transform ({traced_for})"
