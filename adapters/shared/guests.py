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
`nnx.bridge.ToLinen` (Linen's interceptor sees the `ToLinen` call), the NNX
module that `ToLinen` builds from the Linen variables is given reporting
classes as the NNX adapter gives its copy (`call_linen_module`). Equinox
modules are plain callables too, and the Equinox adapter reaches them by tree
surgery on the model it is given: an Equinox module called inside another
library's model is not a site, and selecting a path inside one that an NNX
module holds raises saying so (`equinox_attributes`).

A host adapter opts in with `@hosted("library")` on the method that calls its
model (or `with hosting(...)`): the trace that method runs in is the host's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

from bridge.adapter_api import (
    BodyTraces,
    BridgeValueError,
    Session,
    current_session,
    is_carrier_name,
)

try:
    # Telling whether a guest call runs in the host's trace needs JAX's trace
    # stack (the Equinox and NNX adapters read it too). Where this JAX lacks
    # it, no guest is installed: their calls are not sites, never wrong ones,
    # and the Linen and Haiku adapters, which need no JAX internals, still work.
    from . import jax_internals
except ImportError:
    jax_internals = None

#: The libraries whose module calls a guest interceptor can catch, by the
#: module that must already be imported for a model to use them.
_INTERCEPTABLE = {"linen": "flax.linen", "haiku": "haiku"}

_LIBRARY_NAMES = {
    "linen": "Flax Linen",
    "nnx": "Flax NNX",
    "haiku": "Haiku",
    "equinox": "Equinox",
}


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
        return f"{where} the {_LIBRARY_NAMES[self.library]} model's own code"


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
    if session is None or jax_internals is None:
        yield None
        return
    host = Host(
        session, library, jax_internals.current_trace(), describe or (lambda: None)
    )
    token = _HOST.set(host)
    try:
        with contextlib.ExitStack() as stack:
            for guest, module_name in _INTERCEPTABLE.items():
                if guest != library and module_name in sys.modules:
                    stack.enter_context(_GUEST_INTERCEPTORS[guest](host))
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
    if (
        blocked is not None
        and not session.discovering
        and (entered.name in session.selected or entered.name in session.patches)
    ):
        raise BridgeValueError(
            f"Site {entered.name!r}, a {_LIBRARY_NAMES[library]} module called "
            f"inside another library's model, is inside {blocked}: bridge "
            "cannot see through it there. Its value there belongs to the "
            "transform's own trace (one iteration's inside a scan, one "
            "example's inside a vmap): a recording cannot leave it, and an "
            "epsilon from outside would serve every iteration and sum their "
            "gradients. Select sites outside the transform with `at=`, or "
            f"probe the {_LIBRARY_NAMES[library]} module on its own."
        )
    return session.exit(entered, call(), record=blocked is None)


@dataclasses.dataclass
class _Frame:
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


class _Guest:
    """A guest interceptor: the frames of its library's active calls."""

    library = ""
    #: Whether a guest model's first call is its root, made where its apply is
    #: (Linen); Haiku has no root module.
    starts_at_apply = True

    def __init__(self, host: Host):
        self.host = host
        self.frames: list[_Frame] = []

    def _frame(self, session: Session, root: Any = None) -> tuple[_Frame, bool]:
        """The frame of a new call, and whether it starts a guest model's apply
        (its library's first call inside another library's site)."""
        top = self.frames[-1] if self.frames else None
        if top is None or top.inner_depth != depth(session):
            trace = jax_internals.current_trace()
            return (
                _Frame(
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

    def _blocked(self, frame: _Frame, own_transform: str | None) -> str | None:
        """The transform a guest call is inside, if any: the host's around the
        guest model's apply, or the guest model's own inside it."""
        guest = _LIBRARY_NAMES[self.library]
        trace = jax_internals.current_trace()
        around = frame.trace is not self.host.trace
        if around and (self.starts_at_apply or self.host.describe() is not None):
            return self.host.transform_around(frame.trace)
        if own_transform is not None:
            return f"{own_transform} in the {guest} module's own code"
        if around:
            # Haiku has no root module: the first call seen may already be
            # inside a transform of the Haiku function.
            host = _LIBRARY_NAMES[self.host.library]
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

    def _pass(self, frame: _Frame, run: Callable[[], Any]) -> Any:
        """A call that is no site, whose nested calls may be."""
        self.frames.append(frame)
        try:
            return run()
        finally:
            self.frames.pop()


class _LinenGuest(_Guest):
    """Linen modules called inside another library's model (`nnx.bridge.ToNNX`
    calls `module.apply`): sites named by scope path, as in the Linen adapter."""

    library = "linen"

    def __call__(self, next_fun, call_args, call_kwargs, context):
        session = current_session()
        if session is not self.host.session:
            return next_fun(*call_args, **call_kwargs)
        module, method = context.module, context.method_name
        if module.is_initializing():  # the model's code building a Linen model
            return next_fun(*call_args, **call_kwargs)
        root = module.scope.root
        frame, starts = self._frame(session, root)
        if not starts and root is not self.frames[-1].root:
            self._entering_lifted_scope(self.frames[-1], module, method)
        run = functools.partial(
            call_linen_module, module, next_fun, call_args, call_kwargs
        )
        if (
            module.path == ()
            or method == "setup"
            or (method.startswith("_") and method != "__call__")
        ):
            return self._pass(frame, run)
        lifted = root is not frame.apply_root
        frame.inner_depth = depth(session) + 1
        return self._observe(
            frame,
            joined(frame.prefix, "/".join(module.path)),
            None if method == "__call__" else method,
            module,
            call_args,
            run,
            (frame.transform or "a Flax lifted transform") if lifted else None,
        )

    def _entering_lifted_scope(self, parent: _Frame, module: Any, method: str) -> None:
        """As the Linen adapter's interceptor (`entering_linen_lifted_scope`)."""
        transform = entering_linen_lifted_scope(parent.bodies, module, method)
        if transform is not None:
            parent.transform = transform


class _HaikuGuest(_Guest):
    """Haiku modules called inside another library's model (an `hk.transform`ed
    function's `apply`): sites named by `module_name`, as in the Haiku adapter."""

    library = "haiku"
    starts_at_apply = False

    def __init__(self, host: Host):
        super().__init__(host)
        # `{depth: name}` of the `LiftingModule` (`hk.experimental.layer_stack`,
        # `hk.lift`) last called at that depth: the calls inside it are named
        # under it, as their parameters are (`__layer_stack_no_per_layer/linear`).
        self.lifts: dict[int, str] = {}

    def __call__(self, next_fun, call_args, call_kwargs, context):
        session = current_session()
        if (
            session is not self.host.session
            or not _is_haiku_site(context)
            or _haiku_running_init()  # the model's code building a Haiku model
        ):
            return next_fun(*call_args, **call_kwargs)
        if type(context.module).__name__ == "LiftingModule":
            # Returns the lifted parameters, not an activation: not a site.
            self.lifts[depth(session)] = context.module.module_name
            return next_fun(*call_args, **call_kwargs)
        frame, starts = self._frame(session)
        if starts and jax_internals.current_trace() is self.host.trace:
            self.lifts.pop(depth(session), None)
        elif starts:
            frame.lift = self.lifts.get(depth(session))
        name = context.module.module_name
        if frame.lift is not None:
            name = joined(frame.lift, name)
        lift = "hk.experimental.layer_stack (or hk.lift)" if frame.lift else None
        frame.inner_depth = depth(session) + 1
        method = context.method_name
        return self._observe(
            frame,
            joined(frame.prefix, name),
            None if method == "__call__" else method,
            context.module,
            call_args,
            lambda: next_fun(*call_args, **call_kwargs),
            lift,
        )


def entering_linen_lifted_scope(
    bodies: BodyTraces, module: Any, method: str
) -> str | None:
    """A Linen call in a new scope root (inside a lifted transform), whose
    parent frame holds `bodies`. A lifted transform's own module (`ScanBlock`,
    scope path `()`) is called before its body runs: it starts a new call of
    the body, and its transform's name is returned. A body's first call
    starts its trace, first or repeated (Flax traces a body more than once).
    In `nn.scan(nn.remat(Block))` the scan's body is the own module of the
    remat, `CheckpointBlock`, a base class of `ScanCheckpointBlock`: it is
    traced again as any body is, not a new call."""
    key = (module.path, module.name, method, type(module))
    if module.path == () and not any(
        started[0] == () and issubclass(started[3], type(module))
        for started in bodies
        if started[3] is not type(module)
    ):
        bodies.clear()
        bodies.begin(key)
        return linen_transform_name(module)
    bodies.begin_or_again(key)
    return linen_transform_name(module) if module.path == () else None


def _haiku_running_init() -> bool:
    import haiku as hk

    return hk.running_init()


def _is_haiku_site(context: Any) -> bool:
    """A module method call the Haiku adapter counts as a site."""
    from ..haiku.probe import is_site

    return is_site(context)


@contextlib.contextmanager
def _intercepting_linen(host: Host) -> Iterator[None]:
    import flax.linen as nn

    with nn.intercept_methods(_LinenGuest(host)):
        yield


@contextlib.contextmanager
def _intercepting_haiku(host: Host) -> Iterator[None]:
    import haiku as hk

    with hk.intercept_methods(_HaikuGuest(host)):
        yield


_GUEST_INTERCEPTORS = {"linen": _intercepting_linen, "haiku": _intercepting_haiku}


# -- NNX inside Linen: `nnx.bridge.ToLinen` ---------------------------------------


def call_linen_module(module: Any, next_fun, call_args, call_kwargs) -> Any:
    """Call a Linen module's method; for `nnx.bridge.ToLinen`, with the NNX
    module it builds given reporting classes, so its submodules are sites
    named under the `ToLinen`'s path (`ToLinen_0/linear`), as Linen keys
    their parameters.

    `ToLinen.__call__` builds a new NNX module from the Linen variables on
    every call with `self.nnx_class(...)`; for the length of the call the
    bound `ToLinen` (Linen's own clone for this apply, not the user's
    module) builds it through a factory that instruments what it built.
    """
    host = _HOST.get()
    session = current_session()
    if (
        not is_to_linen(module)
        or host is None
        or session is not host.session
        or module.is_initializing()
    ):
        return next_fun(*call_args, **call_kwargs)
    from flax import nnx

    from ..nnx import probe as nnx_adapter

    run = nnx_adapter.GuestRun(host, enclosing_path(session))
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
        with nnx_adapter.running(run):
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


def _to_linen_class() -> type | None:
    """`nnx.bridge.ToLinen`, where NNX was imported (a model must have)."""
    wrappers = sys.modules.get("flax.nnx.bridge.wrappers")
    return getattr(wrappers, "ToLinen", None)


def is_to_linen(module: Any) -> bool:
    to_linen = _to_linen_class()
    return to_linen is not None and isinstance(module, to_linen)


def to_nnx_class() -> type | None:
    """`nnx.bridge.ToNNX`, where NNX was imported."""
    wrappers = sys.modules.get("flax.nnx.bridge.wrappers")
    return getattr(wrappers, "ToNNX", None)


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
                    f"{_LIBRARY_NAMES[host]} model, or a path inside it: bridge "
                    "cannot see the calls of an Equinox module called from "
                    "another library's model. Equinox modules are plain "
                    "callables that no interceptor catches, and bridge reaches "
                    "their calls by tree surgery on an Equinox model it is given. "
                    "Probe that module on its own with bridge.probe(...), or mark "
                    "values inside it with bridge.tap(name, value): a site named "
                    "'name' under the path of the module that calls it."
                )


# -- naming transforms --------------------------------------------------------------


_LINEN_TRANSFORMS = {
    "Scan": "nn.scan",
    "Vmap": "nn.vmap",
    "Checkpoint": "nn.remat",
    "Jit": "nn.jit",
    "While_loop": "nn.while_loop",
    "Map_variables": "nn.map_variables",
}


def linen_transform_name(module: Any) -> str:
    """`ScanBlock` (the class `nn.scan(Block)` makes) -> `nn.scan`."""
    name = type(module).__name__
    for prefix, transform in _LINEN_TRANSFORMS.items():
        if name.startswith(prefix):
            return transform
    return "a Flax lifted transform"


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
