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

Where the guest call runs — in the trace the host runs the model in, or
inside a transform between the two: a lifted transform of the host's code
(`nnx.scan`, `nn.scan`, a `jax.vmap` in an Equinox model) or of the guest's
own (`nn.scan` inside the Linen module, `hk.scan`,
`hk.experimental.layer_stack`) — the core reads from the computation, as it
does for the host's own calls: a site inside a scan holds every iteration.

NNX modules cannot be intercepted: their calls are plain Python calls. Under
`nnx.bridge.ToLinen`, a *wrapper* (a Linen module that builds an NNX module
on each call), Linen's interceptor sees the `ToLinen` call and hands it to
NNX's guest side (`call_module`), which gives the NNX module it builds the
reporting classes the NNX adapter gives its copy. Equinox modules are plain
callables too, reached by tree surgery on an Equinox model only: one called
inside another library's model is not a site, and selecting a path inside
one that an NNX module holds raises saying so (`check_not_inside`).

This module is the host's side of the framework and knows libraries only by
name: the host (`hosting`, `hosted`), the wrappers (`call_module`), the
Equinox modules another library's model holds (`check_not_inside`). The
report of a guest call (`observe`, `Guest`, `Frame`, `Host`) is
`guest_calls`; the table of libraries is
`guest_libraries`. Each library's guest side lives in its own package,
registered in `guest_libraries` by `"module:attribute"` strings that this
module imports on first use, once the library is in `sys.modules`, as
adapters are: Linen's interceptor in `bridge.adapters.linen.guest`,
Haiku's in `bridge.adapters.haiku.guest`, NNX's side of `ToLinen` and `ToNNX`
in `bridge.adapters.nnx.guest`. Library packages import this module alone
(it re-exports what they build on from `guest_calls`), never the reverse.

A host adapter opts in with `@hosted("library")` on the method that calls its
model (or `with hosting(...)`): the trace that method runs in is the host's.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from bridge.adapter_api import BridgeValueError, current_session

from . import jax_internals
from .guest_calls import Frame as Frame
from .guest_calls import Guest as Guest
from .guest_calls import Host as Host
from .guest_calls import depth as depth
from .guest_calls import enclosing_path as enclosing_path
from .guest_calls import joined as joined
from .guest_calls import observe as observe
from .guest_libraries import LIBRARIES, imported, title, wrapped_by

# -- loading a library's guest side ------------------------------------------------


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


# -- the host ----------------------------------------------------------------------

_HOST: contextvars.ContextVar[Host | None] = contextvars.ContextVar(
    "bridge_guest_host", default=None
)


@contextlib.contextmanager
def hosting(library: str) -> Iterator[Host | None]:
    """Run the host's model with guest interceptors for the other libraries.
    Outside a probe's session this does nothing."""
    session = current_session()
    if session is None or not jax_internals.supported():
        yield None
        return
    host = Host(session, library, jax_internals.current_trace())
    token = _HOST.set(host)
    try:
        with contextlib.ExitStack() as stack:
            for name, guest in LIBRARIES.items():
                if name != library and guest.intercepting and imported(guest):
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


# -- wrappers: a module of one library that builds and calls another's ------------


def wraps_guest(library: str, module: Any) -> bool:
    """Whether `module`, a module of `library`, builds a module of another
    library and calls it (`nnx.bridge.ToLinen`)."""
    return wrapped_by(library, module) is not None


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
        guest = wrapped_by(library, module)
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
                    f"{title(host)} model, or a path inside it: bridge "
                    "cannot see the calls of an Equinox module called from "
                    "another library's model. Equinox modules are plain "
                    "callables that no interceptor catches, and bridge reaches "
                    "their calls by tree surgery on an Equinox model it is given. "
                    "Probe that module on its own with bridge.probe(...), or mark "
                    "values inside it with bridge.tap(name, value): a site named "
                    "'name' under the path of the module that calls it."
                )
