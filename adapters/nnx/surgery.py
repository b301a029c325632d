"""Graph surgery: the modules of the probe's copy report their calls.

Every submodule of the copy gets a reporting subclass of its own class
(`instrument`), whose public methods and `__call__` report each call to the
reporter running now (`running`): the probe's `run.Run`, or the
`guest.GuestRun` of the NNX module an `nnx.bridge.ToLinen` builds inside a
Linen model. Each module also carries its site path as a static attribute
(`variables.PATH_ATTRIBUTE`), which survives NNX's split and merge inside
transforms. The user's module, its classes and its `Variable` objects are
never touched: the copy is the probe's own.

`nnx.bridge.ToNNX` hands every attribute of its module to Linen as a
variable, so bridge's attributes on the copy are hidden while it runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from flax import nnx

from bridge.adapter_api import Session, current_session

from ..shared import guests
from . import internals
from .variables import PATH_ATTRIBUTE, is_bridge_attribute


class Reporter(Protocol):
    """What a reporting method hands its call to (`run.Run`, `guest.GuestRun`)."""

    def report(
        self,
        module: nnx.Module,
        method_name: str,
        method: Callable,
        args: tuple,
        kwargs: dict,
        session: Session,
    ) -> Any: ...


#: The reporter of the calls running now: a reporting method reports only
#: calls of the modules of the copy running now (or of the NNX module an
#: `nnx.bridge.ToLinen` builds inside a Linen model).
_RUN: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar(
    "bridge_nnx_run", default=None
)

#: Containers are graph nodes (nnx.List is even an nnx.Module) but are never
#: called: they hold sites and are not sites themselves.
_CONTAINERS = (nnx.List, nnx.Dict)

#: Methods that configure a module rather than compute with it.
_NOT_SITES = frozenset(dir(nnx.Module)) | {"set_view"}

#: `{class: its reporting subclass}`, made once per class.
_REPORTING_CLASSES: dict[type, type] = {}


@contextlib.contextmanager
def running(run: Reporter) -> Iterator[None]:
    """Report the calls of the modules `run` instrumented while this runs."""
    token = _RUN.set(run)
    try:
        yield
    finally:
        _RUN.reset(token)


def instrument(model: nnx.Module, prefix: str = "") -> dict[str, nnx.Module]:
    """Give every submodule of `model` (a private copy) a reporting class.

    Returns `{path: module}`, each path under `prefix` (the path of the
    `nnx.bridge.ToLinen` site an NNX module is called in). A module reachable
    by several paths (shared) gets the first in graph order, the path under
    which `nnx.state` keys its parameters.
    """
    modules = {}
    for path, module in internals.iter_modules(model):
        if not path or isinstance(module, _CONTAINERS):
            continue
        if any(module is seen for seen in modules.values()):
            continue
        name = guests.joined(prefix, "/".join(str(part) for part in path))
        modules[name] = module
        module.__class__ = _reporting_class(type(module))
        setattr(module, PATH_ATTRIBUTE, name)
    return modules


def _reporting_class(cls: type) -> type:
    """A subclass of `cls` whose public methods report their calls (cached)."""
    if getattr(cls, "_bridge_reports", False):
        return cls
    reporting = _REPORTING_CLASSES.get(cls)
    if reporting is None:
        to_nnx = to_nnx_class()
        hides = to_nnx is not None and issubclass(cls, to_nnx)
        namespace = {
            name: _reporting_method(
                name, _hiding_bridge_attributes(method) if hides else method
            )
            for name, method in _public_methods(cls)
        }
        namespace["_bridge_reports"] = True
        namespace["__module__"] = cls.__module__
        namespace["__qualname__"] = cls.__qualname__
        with warnings.catch_warnings():
            # Subclassing re-reads the class's annotations: a user's deprecated
            # `nnx.Data[...]` annotation would warn again, for no fault of theirs.
            warnings.simplefilter("ignore", DeprecationWarning)
            reporting = type(cls)(
                cls.__name__, (cls,), namespace, **internals.class_keywords(cls)
            )
        _REPORTING_CLASSES[cls] = reporting
    return reporting


def _public_methods(cls: type) -> list[tuple[str, Callable]]:
    methods = []
    for name in dir(cls):
        if name != "__call__" and (name.startswith("_") or name in _NOT_SITES):
            continue
        method = inspect.getattr_static(cls, name)
        if inspect.isfunction(method):
            methods.append((name, method))
    return methods


def _reporting_method(name: str, method: Callable) -> Callable:
    @functools.wraps(method)
    def reporting(self, *args, **kwargs):
        run, session = _RUN.get(), current_session()
        if run is None or session is None:  # not while a probe runs the copy
            return method(self, *args, **kwargs)
        return run.report(self, name, method, args, kwargs, session)

    return reporting


def _hiding_bridge_attributes(method: Callable) -> Callable:
    """A method of `nnx.bridge.ToNNX`, which hands every attribute of its module
    but its own to Linen as variables: bridge's attributes on the copy (its
    path, the variables of sites inside transforms) are hidden while it runs."""

    @functools.wraps(method)
    def hiding(self, *args, **kwargs):
        attributes = vars(self)
        hidden = {
            name: attributes.pop(name)
            for name in list(attributes)
            if is_bridge_attribute(name)
        }
        try:
            return method(self, *args, **kwargs)
        finally:
            attributes.update(hidden)

    return hiding


def to_nnx_class() -> type | None:
    """`nnx.bridge.ToNNX`, where NNX's bridge was imported (a model using it
    must have)."""
    wrappers = sys.modules.get("flax.nnx.bridge.wrappers")
    return getattr(wrappers, "ToNNX", None)
