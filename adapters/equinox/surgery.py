"""Tree surgery: a copy of the model whose submodules report their calls.

Each submodule of the model (at its pytree path, `layers/0`) is replaced with
a wrapper that reports its calls to the probe's session (`instrument`), and so
is each function-valued field such as `eqx.nn.MLP.activation` (`activation`,
`activation#1`, …). A wrapper is an instance of a subclass of the module's
own class with the same fields (`_site_class`): the surgery is invisible to
the model's code, whose `isinstance` checks, attribute and property reads,
private methods and unwrapping functions (a `Parameterize`-style parameter
wrapper that the model never calls but unwraps) see the module they expect.
Only calls are sites: `__call__`, and every other method the model calls on
a submodule from outside, private ones included (`base._log_prob`). A
wrapper's call is reported from where it runs by
`bridge.adapters.equinox.run`.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from bridge.adapter_api import BATCH_AXIS, key_name

from . import internals, run


def instrument(
    module: eqx.Module,
    prefix: tuple[str, ...],
    vmap: bool,
    token: Token | None = None,
) -> Any:
    """A copy of `module` whose submodules and function fields report their calls.

    Submodules are wrapped after their own children, so a wrapper holds an
    instrumented module. `eqx.nn.Lambda.fn` is not a site of its own: the
    Lambda's call is the same value.
    """

    def is_child(x: Any) -> bool:
        return x is not module and (isinstance(x, eqx.Module) or is_function(x))

    children, treedef = jax.tree_util.tree_flatten_with_path(module, is_leaf=is_child)
    replaced = []
    for key_path, child in children:
        path = (*prefix, *(key_name(key) for key in key_path))
        if isinstance(child, eqx.nn.StateIndex):
            pass  # a key into the State, looked up by identity: keep it as is
        elif isinstance(child, eqx.Module):
            if vmap and isinstance(child, eqx.nn.BatchNorm):
                # The probe's vmap is the batch: average over it.
                child = eqx.tree_at(lambda bn: bn.axis_name, child, BATCH_AXIS)
            inner = instrument(child, path, vmap, token)
            child = _wrapped(inner, "/".join(path), token)
        elif is_function(child) and not _is_plumbing(module, key_path):
            child = _FunctionSite(child, "/".join(path), token)
        replaced.append(child)
    return jax.tree_util.tree_unflatten(treedef, replaced)


def _is_plumbing(module: Any, key_path: tuple) -> bool:
    """A function field that is not a step of the forward pass: `eqx.nn.Lambda`'s
    `fn` (the Lambda's own call is that value), a pool's `operation`, the
    binary reduction `lax.reduce_window` traces on scalars, and the selectors
    `where` and `get` of `eqx.nn.Shared`."""
    if isinstance(module, eqx.nn.Lambda):
        return True
    field = key_name(key_path[0]) if key_path else None
    if isinstance(module, eqx.nn.Shared):
        return field in ("where", "get")
    return isinstance(module, eqx.nn.Pool) and field == "operation"


def is_function(x: Any) -> bool:
    return callable(x) and not isinstance(x, eqx.Module | type) and not eqx.is_array(x)


class Token:
    """Equal only to itself: makes each probe call's wrappers a new structure."""

    __slots__ = ()


#: The fields a wrapper adds to its module's own (`_site_class`); names no
#: model's field is likely to take.
_SITE_FIELDS = ("bridge_path", "bridge_token")


#: Methods that are protocol rather than a step of the forward pass.
_NOT_SITES = frozenset({"is_stateful"})


#: `type(module) -> its wrapper class` (`None`: a `_ForwardingSite`), made
#: once per class.
_SITE_CLASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_SITE_CLASSES_LOCK = threading.Lock()


def _wrapped(inner: eqx.Module, path: str, token: Any) -> eqx.Module:
    """`inner` as a site: an instance of a subclass of its own class
    (`_site_class`) holding the same fields, and bridge's; where its class
    is not to be subclassed, a `_ForwardingSite` holding it."""
    site_class = _site_class(type(inner))
    if site_class is None:
        forwarding = (
            _StatefulForwardingSite
            if isinstance(inner, eqx.nn.StatefulLayer)
            else _ForwardingSite
        )
        return forwarding(inner, path, token)
    wrapper = object.__new__(site_class)
    vars(wrapper).update(vars(inner))
    for name, value in zip(_SITE_FIELDS, (path, token), strict=True):
        object.__setattr__(wrapper, name, value)
    return wrapper


def _site_class(cls: type) -> type | None:
    """A subclass of the module class `cls` whose calls are sites, or `None`
    where `cls` is not to be subclassed.

    Tree surgery stays invisible to the model's code: a wrapper is an
    instance of the module's own class, with the same fields, so `isinstance`
    checks, attribute access, properties, operators (`__getitem__`) and the
    model's own unwrapping functions (`jax.tree.map(..., is_leaf=lambda x:
    isinstance(x, Parameterize))`) see the module they expect. Its calls and
    the calls of its methods from outside, private ones included
    (`self.base._log_prob(x)` is the site `base._log_prob`), are reported;
    each runs on a plain instance of `cls` (`_unwrapped`), so a method that
    the module calls on itself is part of the call, not a site of its own.
    Dunder methods other than `__call__` run as they are.

    A class with an `__init_subclass__` of its own (a registry of subclasses
    would learn of bridge's), with a field named like one of bridge's, or
    that refuses to be subclassed is wrapped by a `_ForwardingSite` instead.
    """
    with _SITE_CLASSES_LOCK:
        if cls in _SITE_CLASSES:
            return _SITE_CLASSES[cls]
        made = _make_site_class(cls)
        _SITE_CLASSES[cls] = made
        return made


def _make_site_class(cls: type) -> type | None:
    fields = {field.name for field in dataclasses.fields(cls)}
    hooked = any(
        "__init_subclass__" in vars(klass)
        for klass in cls.__mro__
        if not internals.is_equinox_base(klass)
    )
    if hooked or fields.intersection(_SITE_FIELDS):
        return None
    namespace: dict[str, Any] = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "__annotations__": {name: Any for name in _SITE_FIELDS},
        "bridge_path": eqx.field(static=True, default=""),
        "bridge_token": eqx.field(static=True, default=None),
    }
    for name in _method_names(cls, fields):
        namespace[name] = _observed_method(cls, name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the class's own, warned at its making
            return type(cls)(cls.__name__, (cls,), namespace)
    except Exception:  # a class that will not be subclassed (strict, final)
        return None


def _method_names(cls: type, fields: set[str]) -> list[str]:
    """The methods of `cls` whose calls are sites: `__call__` and every other
    method defined below `eqx.Module`, private ones included; not fields
    (a function as a field's default), static or class methods, properties,
    nor other dunder methods."""
    if issubclass(cls, eqx.nn.Shared):
        return []  # its call rebuilds the tree it shares nodes of: no layer
    names: dict[str, None] = {}
    for klass in cls.__mro__:
        if internals.is_equinox_base(klass):
            continue
        for name, attribute in vars(klass).items():
            dunder = name.startswith("__") and name.endswith("__")
            if (dunder and name != "__call__") or name in fields or name in _NOT_SITES:
                continue
            if not isinstance(attribute, staticmethod | classmethod | property | type):
                if _is_method(getattr(cls, name, None)):
                    names.setdefault(name)
    return list(names)


def _is_method(attribute: Any) -> bool:
    """A method as its class holds it: a function (equinox < 0.12 wraps it in
    a descriptor that gives the function back), or a callable that binds to
    its instance (`eqx.filter_jit`, `jax.jit` on a method)."""
    return inspect.isfunction(attribute) or (
        callable(attribute) and hasattr(type(attribute), "__get__")
    )


def _observed_method(cls: type, name: str) -> Callable:
    original = inspect.getattr_static(cls, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        inner = _unwrapped(self, cls)
        function = run.unjitted(inner, name)
        method_name = None if name == "__call__" else name
        return run.observed_call(
            self.bridge_path, method_name, inner, function, args, kwargs
        )

    method.__name__ = name
    method.__qualname__ = f"{cls.__qualname__}.{name}"
    method.__doc__ = getattr(original, "__doc__", None)
    return method


def _unwrapped(wrapper: Any, cls: type) -> Any:
    """A plain `cls` instance with the wrapper's fields."""
    module = object.__new__(cls)
    for name, value in vars(wrapper).items():
        if name not in _SITE_FIELDS:
            object.__setattr__(module, name, value)
    return module


class _ForwardingSite(eqx.Module):
    """Stands in for a submodule whose class is not to be subclassed (see
    `_site_class`): it answers every attribute and method of the module,
    private ones included; its call and the calls of its methods are sites.
    An `isinstance` check of the model's code does not see the module's class
    through it."""

    module: eqx.Module
    bridge_path: str = eqx.field(static=True)
    bridge_token: Any = eqx.field(static=True, default=None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._observed("__call__", args, kwargs)

    def __getattr__(self, name: str) -> Any:
        # Reached only for names the wrapper lacks: forward to the module.
        if name in _FORWARDING_FIELDS:
            raise AttributeError(name)
        attribute = getattr(self.module, name)
        dunder = name.startswith("__") and name.endswith("__")
        fields = {field.name for field in dataclasses.fields(self.module)}
        if dunder or name in fields or name in _NOT_SITES:
            return attribute
        static = inspect.getattr_static(type(self.module), name, None)
        if isinstance(static, staticmethod | classmethod) or not _is_method(
            getattr(type(self.module), name, None)
        ):
            return attribute
        return lambda *args, **kwargs: self._observed(name, args, kwargs)

    def _observed(self, name: str, args: tuple, kwargs: dict) -> Any:
        function = run.unjitted(self.module, name)
        method = None if name == "__call__" else name
        return run.observed_call(
            self.bridge_path, method, self.module, function, args, kwargs
        )

    def __getitem__(self, index: Any) -> Any:
        return self.module[index]

    def __len__(self) -> int:
        return len(self.module)

    def __iter__(self):
        return iter(self.module)


_FORWARDING_FIELDS = frozenset({"module", *_SITE_FIELDS})


class _StatefulForwardingSite(_ForwardingSite, eqx.nn.StatefulLayer):
    """A forwarding `StatefulLayer`, so `eqx.nn.Sequential` threads its state."""

    def is_stateful(self) -> bool:
        return self.module.is_stateful()


class _FunctionSite(eqx.Module):
    """Stands in for a function-valued field such as `eqx.nn.MLP.activation`."""

    function: Callable
    path: str = eqx.field(static=True)
    token: Token | None = eqx.field(static=True, default=None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return run.observed_call(
            self.path, None, self.function, self.function, args, kwargs
        )
