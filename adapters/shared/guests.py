"""Guests: modules of one library called inside a model of another.

A host adapter reaches the submodule calls of the model it was given with its
own library's mechanism: a reporting copy (NNX), an interceptor (Linen,
Haiku), tree surgery (Equinox). A module of another library called inside
that model — a Linen module under `nnx.bridge.ToNNX`, an `hk.transform`ed
function's `apply` called in an Equinox module, an NNX module under
`nnx.bridge.ToLinen` — is invisible to that mechanism. So while the host runs
the model (`hosting`), each other library whose calls can be caught from
outside, and that is already imported, gets a *guest* interceptor: Linen's
`nn.intercept_methods` and Haiku's `hk.intercept_methods` catch every module
call made inside them, in any code. A guest call is reported to the probe's
session with its own library's name joined under the path of the site around
it: `encoder` + `Dense_0` -> `encoder/Dense_0`. Its epsilon is the session's
own, added to the call's value, and the session records the value.

That is right only where the guest call runs in the trace the host runs the
model in. Inside a transform between the two — a lifted transform of the
host's code (`nnx.scan`, `nn.scan`, a `jax.vmap` in an Equinox model) or of
the guest's own (`nn.scan` inside the Linen module, `hk.scan`,
`hk.experimental.layer_stack`) — the value is one iteration's, a tracer of
the transform's trace, and a session epsilon would serve every iteration and
sum their gradients. Such a call is still listed as a site (with the shape of
one iteration), but selecting or patching it raises, naming the transform.

NNX modules cannot be intercepted: their calls are plain Python calls. Under
`nnx.bridge.ToLinen`, a *wrapper* (a Linen module that builds an NNX module
on each call), Linen's interceptor sees the `ToLinen` call and hands it to
NNX's guest side (`call_module`), which gives the NNX module it builds the
reporting classes the NNX adapter gives its copy. Equinox modules are plain
callables too, reached by tree surgery on an Equinox model only: one called
inside another library's model is not a site, and selecting a path inside
one that an NNX module holds raises saying so (`check_not_inside`).

This module is the framework and knows libraries only by name: the host
(`hosting`), the report of a guest call (`observe`, `Guest`), the checks of
the trace it runs in. Each library's guest side lives in its own package,
registered in `_LIBRARIES` by `"module:attribute"` strings imported on first
use, once the library is in `sys.modules`, as adapters are: Linen's
interceptor in `bridge.adapters.linen.guest`, Haiku's in
`bridge.adapters.haiku.guest`, NNX's side of `ToLinen` and `ToNNX` in
`bridge.adapters.nnx.guest`. Library packages import this module, never the
reverse.

A host adapter opts in with `@hosted("library")` on the method that calls its
model (or `with hosting(...)`): the trace that method runs in is the host's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from bridge.adapter_api import BodyTraces, BridgeValueError, Session, current_session

# Telling whether a guest call runs in the host's trace needs JAX's trace
# stack. Where this JAX lacks it, no guest is installed (`hosting`): their
# calls are not sites, never wrong ones.
from . import jax_internals

# -- the libraries, by name --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GuestLibrary:
    """A library as guests know it. Its guest side is named by
    `"module:attribute"` strings, imported on first use: this module imports
    no library package."""

    #: The library's name in error messages.
    title: str
    #: The module every model using the library has imported: until it is in
    #: `sys.modules`, nothing of the library's guest side is imported.
    imported_as: str
    #: `intercepting(host)`: a context manager that reports the library's
    #: module calls made anywhere inside it.
    intercepting: str | None = None
    #: The library whose modules may wrap this library's: build a module of
    #: it on each call and call it (`"linen"` for NNX's `nnx.bridge.ToLinen`).
    wrapped_in: str | None = None
    #: The wrapper class, looked up in `sys.modules` and never imported (a
    #: model using it has imported it): telling a wrapper costs no import.
    wrapper: str | None = None
    #: `call_wrapper(host, wrapper, next_fun, call_args, call_kwargs)`: the
    #: wrapper's call, with the modules it builds reporting their calls.
    call_wrapper: str | None = None


_LIBRARIES = {
    "linen": GuestLibrary(
        "Flax Linen",
        "flax.linen",
        intercepting="bridge.adapters.linen.guest:intercepting",
    ),
    "haiku": GuestLibrary(
        "Haiku", "haiku", intercepting="bridge.adapters.haiku.guest:intercepting"
    ),
    "nnx": GuestLibrary(
        "Flax NNX",
        "flax.nnx",
        wrapped_in="linen",
        wrapper="flax.nnx.bridge.wrappers:ToLinen",
        call_wrapper="bridge.adapters.nnx.guest:call_to_linen",
    ),
    # A host only: Equinox modules are plain callables, which nothing catches.
    "equinox": GuestLibrary("Equinox", "equinox"),
}


def _imported(library: GuestLibrary) -> bool:
    return sys.modules.get(library.imported_as) is not None


@functools.cache
def _load(where: str) -> Any:
    """The attribute `"module:attribute"` names, its module imported."""
    module_name, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def _guest_side(where: str) -> Any:
    """`_load(where)`, or `None` where the guest library's adapter refuses this
    release of it (`unsupported`): its calls inside the host's model are then
    no sites, never wrong ones, and the host's own sites are unaffected."""
    try:
        return _load(where)
    except ImportError:
        return None


def _title(library: str) -> str:
    return _LIBRARIES[library].title


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
        where = f"{named} in" if named else f"{_trace_name(trace)} in"
        return f"{where} the {_title(self.library)} model's own code"


_HOST: contextvars.ContextVar[Host | None] = contextvars.ContextVar(
    "bridge_guest_host", default=None
)


@contextlib.contextmanager
def hosting(
    library: str, describe: Callable[[], str | None] | None = None
) -> Iterator[Host | None]:
    """Run the host's model with guest interceptors for the other libraries.

    `describe()` names the host's own transform running now (`nnx.scan`), if
    the host can tell; otherwise the error names JAX's transform. Outside a
    probe's session this does nothing.
    """
    session = current_session()
    if session is None or not jax_internals.supported():
        yield None
        return
    host = Host(
        session, library, jax_internals.current_trace(), describe or (lambda: None)
    )
    token = _HOST.set(host)
    try:
        with contextlib.ExitStack() as stack:
            for name, guest in _LIBRARIES.items():
                if name != library and guest.intercepting and _imported(guest):
                    intercepting = _guest_side(guest.intercepting)
                    if intercepting is not None:
                        stack.enter_context(intercepting(host))
            yield host
    finally:
        _HOST.reset(token)


def hosted(library: str) -> Callable[[Callable], Callable]:
    """`hosting(library)` around every call of the decorated method: the one
    line a host adapter adds on the method that calls its model."""

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with hosting(library):
                return method(*args, **kwargs)

        return wrapped

    return decorate


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
    otherwise only counted; selecting or patching it raises.
    """
    entered = session.enter(path, method, module, args, record=blocked is None)
    if blocked is not None and (
        entered.name in session.selected or entered.name in session.patches
    ):
        raise BridgeValueError(
            f"Site {entered.name!r}, a {_title(library)} module called "
            f"inside another library's model, is inside {blocked}: bridge "
            "cannot see through it there. Its value there belongs to the "
            "transform's own trace (one iteration's inside a scan, one "
            "example's inside a vmap): a recording cannot leave it, and an "
            "epsilon from outside would serve every iteration and sum their "
            "gradients. Select sites outside the transform with `at=`, or "
            f"probe the {_title(library)} module on its own."
        )
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
        guest = _title(self.library)
        trace = jax_internals.current_trace()
        around = frame.trace is not self.host.trace
        if around and (self.starts_at_apply or self.host.describe() is not None):
            return self.host.transform_around(frame.trace)
        if own_transform is not None:
            return f"{own_transform} in the {guest} module's own code"
        if around:
            # Haiku has no root module: the first call seen may already be
            # inside a transform of the Haiku function.
            host = _title(self.host.library)
            return (
                f"{_trace_name(trace)} in the {host} model's own code or the "
                f"{guest} function's"
            )
        if trace is frame.trace:
            return None
        return f"{_trace_name(trace)} in the {guest} module's own code"

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


# -- wrappers: a module of one library that builds and calls another's ------------


def _wrapped_by(library: str, module: Any) -> GuestLibrary | None:
    """Where `module`, a module of `library`, is a wrapper: the library of the
    module it builds and calls on each call (NNX for an `nnx.bridge.ToLinen`)."""
    for guest in _LIBRARIES.values():
        if guest.wrapped_in != library or not _imported(guest):
            continue
        module_name, _, attribute = guest.wrapper.partition(":")
        wrapper = getattr(sys.modules.get(module_name), attribute, None)
        if wrapper is not None and isinstance(module, wrapper):
            return guest
    return None


def wraps_guest(library: str, module: Any) -> bool:
    """Whether `module`, a module of `library`, builds a module of another
    library and calls it (`nnx.bridge.ToLinen`)."""
    return _wrapped_by(library, module) is not None


def call_module(
    library: str, module: Any, next_fun: Callable, call_args: tuple, call_kwargs: dict
) -> Any:
    """Call `module`, a module of `library`, from an interceptor of its calls.

    A wrapper (`wraps_guest`) called while a host runs its model in this
    session is called by the guest side of the library it wraps, which makes
    the submodules of the module it builds sites under the wrapper's path.
    """
    host = _HOST.get()
    if host is not None and current_session() is host.session:
        guest = _wrapped_by(library, module)
        if guest is not None:
            call_wrapper = _load(guest.call_wrapper)
            return call_wrapper(host, module, next_fun, call_args, call_kwargs)
    return next_fun(*call_args, **call_kwargs)


# -- Equinox modules held by another library's model ------------------------------


def is_equinox_module(value: Any) -> bool:
    equinox = sys.modules.get("equinox")
    return equinox is not None and isinstance(value, equinox.Module)


def check_not_inside(
    equinox_attributes: tuple[str, ...], host: str, at: Any, patch: Any
) -> None:
    """Raise, before any work, where a path given in `at` or as a `patch` key
    names an Equinox module the model holds (`equinox_attributes`, their
    attribute paths) or a path inside one: neither is a site."""
    if not equinox_attributes:
        return
    patterns = at if isinstance(at, list) else [at]
    patterns = [*patterns, *(patch or {})]
    for pattern in patterns:
        if not isinstance(pattern, str):
            continue
        for path in equinox_attributes:
            if pattern == path or pattern.startswith((f"{path}/", f"{path}.")):
                raise BridgeValueError(
                    f"{pattern!r} names {path!r}, an Equinox module held by this "
                    f"{_title(host)} model, or a path inside it: bridge "
                    "cannot see the calls of an Equinox module called from "
                    "another library's model. Equinox modules are plain "
                    "callables that no interceptor catches, and bridge reaches "
                    "their calls by tree surgery on an Equinox model it is given. "
                    "Probe that module on its own with bridge.probe(...), or mark "
                    "values inside it with bridge.tap(name, value): a site named "
                    "'name' under the path of the module that calls it."
                )


# -- naming transforms --------------------------------------------------------------


def _trace_name(trace: Any) -> str:
    """What JAX calls the transform `trace` traces, for an error message."""
    if jax_internals.is_vmap(trace):
        return "a jax.vmap"
    traced_for = jax_internals.traced_for(trace)
    if traced_for == "scan":
        return "a lax.scan"
    if "checkpoint" in traced_for or "remat" in traced_for:
        return "a jax.checkpoint"
    return f"a JAX transform ({traced_for})"
