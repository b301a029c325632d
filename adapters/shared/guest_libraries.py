"""The libraries guests know, by name: the table of each library's guest
side and the look-ups in `sys.modules` that import nothing.

It is apart from `guests` (the host's side) and `guest_calls` (the report of
a call) because both read it and it depends on neither: what a library is
called in error messages, whether a model has imported it, and whether a
module of one library is a wrapper building another's. Each library's guest
side is named by `"module:attribute"` strings, loaded by `guests` on first
use, once the library is in `sys.modules`, as adapters are.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any


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


LIBRARIES = {
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


def imported(library: GuestLibrary) -> bool:
    return sys.modules.get(library.imported_as) is not None


def title(library: str) -> str:
    return LIBRARIES[library].title


def wrapped_by(library: str, module: Any) -> GuestLibrary | None:
    """Where `module`, a module of `library`, is a wrapper: the library of the
    module it builds and calls on each call (NNX for an `nnx.bridge.ToLinen`)."""
    for guest in LIBRARIES.values():
        if guest.wrapped_in != library or not imported(guest):
            continue
        module_name, _, attribute = guest.wrapper.partition(":")
        wrapper = getattr(sys.modules.get(module_name), attribute, None)
        if wrapper is not None and isinstance(module, wrapper):
            return guest
    return None
