"""`inside=`: which functions it rewrites, and their code swapped in while a
probe runs.

`rewrites_of` turns what `inside=` names (a class: its methods and its
same-package bases' methods; a plain function) into `Rewrite`s, compiled
once per function (`inside_source.compiled`). A `Rewrite` swaps the
function object's `__code__` while at least one probe using it runs
(`acquire`/`release`, counted across probes and threads under a lock) and
puts the original back after, also when the model raises.

The rewrites are kept for as long as their function lives and no longer:
the registry holds functions weakly, and a `Rewrite` its function weakly, so
a class defined in a loop or a test leaves nothing behind.
"""

from __future__ import annotations

import functools
import itertools
import threading
import types
import weakref
from typing import Any

from .._errors import BridgeTypeError, BridgeValueError
from .inside_source import SiteSource, compiled, has_source

#: Packages whose own classes are the bases of models, not model code: a
#: class's methods are rewritten along its MRO where its bases come from the
#: class's own package, and never in these (the class given is always
#: rewritten, wherever it comes from). The core knows JAX's and Python's; each
#: adapter registered with a `package` adds its library's
#: (`bridge._probe.registry.register_adapter`).
_LIBRARY_PACKAGES: set[str] = {"jax", "builtins", "abc"}


def add_library_package(package: str) -> None:
    """A registered adapter's library (`register_adapter(package=...)`): its
    classes are the bases of models, whose methods `inside=` leaves alone."""
    _LIBRARY_PACKAGES.add(package)


def is_library_module(module: str) -> bool:
    """Whether the module named `module` is a library's (a registered
    adapter's, JAX's) or bridge's own, not the model's code."""
    package = module.partition(".")[0]
    return package in _LIBRARY_PACKAGES or package == "bridge"


_lock = threading.Lock()
_keys = itertools.count(1)
#: function -> its Rewrite (compiled once), while the function lives.
_rewrites: weakref.WeakKeyDictionary[types.FunctionType, Rewrite] = (
    weakref.WeakKeyDictionary()
)
#: key -> Rewrite, while an `Inside` holds it (`tap` finds its sources).
BY_KEY: weakref.WeakValueDictionary[int, Rewrite] = weakref.WeakValueDictionary()


class Rewrite:
    """One function's rewritten code, and how many runs have it in place."""

    def __init__(self, function: types.FunctionType, prefix: str):
        # Weakly: the registry keeps a Rewrite only while its function lives.
        self._function = weakref.ref(function)
        self.name = function.__qualname__
        self.original = function.__code__
        self.key = next(_keys)
        #: Where each tapped assignment is, indexed by its `tap` call's `where`.
        self.sources: list[SiteSource] = []
        self.code = compiled(function, prefix, self.key, self.sources)
        self.users = 0

    def acquire(self) -> None:
        with _lock:
            function = self._function()
            if self.users == 0 and function is not None:
                function.__code__ = self.code
            self.users += 1

    def release(self) -> None:
        with _lock:
            self.users -= 1
            function = self._function()
            if self.users == 0 and function is not None:
                function.__code__ = self.original


def rewrites_of(entry: Any) -> list[Rewrite]:
    if isinstance(entry, type):
        functions = [(fn, "") for fn in _methods(entry)]
        if not functions:
            raise BridgeValueError(
                f"`inside`: the class {entry.__qualname__} has no method with "
                "Python source to rewrite (its methods are builtins or "
                "generated). Name the functions that compute the values instead."
            )
    else:
        function = _innermost(entry)
        if callable(function) and not isinstance(function, types.FunctionType):
            raise BridgeValueError(_no_source(entry))  # a builtin, C code
        if not isinstance(function, types.FunctionType):
            raise BridgeTypeError(
                "`inside` takes module classes and plain functions (or a list of "
                f"them); got {_describe(entry)}. Pass the class (e.g. "
                "nn.MultiHeadDotProductAttention) or the function (e.g. "
                "nn.dot_product_attention_weights)."
            )
        if function.__name__ == "<lambda>":
            raise BridgeValueError(
                f"`inside`: {_describe(entry)} is a lambda, which has no "
                "assignments to tap. Name the function that calls it, or define "
                "it with `def`."
            )
        if not has_source(function):
            raise BridgeValueError(_no_source(entry))
        functions = [(function, f"{function.__name__}/")]
    found = []
    with _lock:
        for function, prefix in functions:
            rewrite = _rewrites.get(function)
            if rewrite is None:
                rewrite = _rewrites[function] = Rewrite(function, prefix)
                BY_KEY[rewrite.key] = rewrite
            found.append(rewrite)
    return found


def _methods(cls: type) -> list[types.FunctionType]:
    """The methods with source of `cls` and of its bases from the same
    top-level package (a user's subclass of their own class, not a library's
    base classes), each unwrapped from its decorators.

    A method is a function defined in the class's body (its `__qualname__`
    says so), or a property's accessor: never a class attribute holding a
    function defined elsewhere (a field default such as `kernel_init`, an
    initializer's closure), nor a dataclass field's default."""
    found: dict[int, types.FunctionType] = {}
    package = _package(cls)
    for klass in cls.__mro__:
        if klass is not cls and (
            _package(klass) != package or package in _LIBRARY_PACKAGES
        ):
            continue
        fields = _field_names(klass)
        for name, attribute in vars(klass).items():
            if name in fields:
                continue
            for candidate in _accessors(attribute):
                function = _innermost(candidate)
                if (
                    isinstance(function, types.FunctionType)
                    and _defined_in(function, klass)
                    and has_source(function)
                ):
                    found.setdefault(id(function), function)
    return list(found.values())


def _package(klass: type) -> str:
    return (getattr(klass, "__module__", None) or "").split(".")[0]


def _field_names(klass: type) -> set[str]:
    """The names of `klass`'s fields: dataclass fields, annotated attributes."""
    own = vars(klass)
    return {*own.get("__dataclass_fields__", {}), *own.get("__annotations__", {})}


def _accessors(attribute: Any) -> list[Any]:
    """The functions a class attribute runs as methods."""
    if isinstance(attribute, staticmethod | classmethod):
        return [attribute.__func__]
    if isinstance(attribute, property):
        return [f for f in (attribute.fget, attribute.fset, attribute.fdel) if f]
    return [attribute]


def _defined_in(function: types.FunctionType, klass: type) -> bool:
    """Whether `function`'s `def` is in `klass`'s body."""
    owner, _, name = function.__qualname__.rpartition(".")
    return owner == klass.__qualname__ and name != "<lambda>"


def _innermost(value: Any) -> Any:
    """A function without its decorators' wrappers (`__wrapped__`) and
    `functools.partial`s."""
    seen = set()
    while id(value) not in seen:
        seen.add(id(value))
        if isinstance(value, functools.partial):
            value = value.func
        elif hasattr(value, "__wrapped__"):
            value = value.__wrapped__
    return value


def _describe(entry: Any) -> str:
    return f"{type(entry).__qualname__} {getattr(entry, '__qualname__', entry)!r}"


def _no_source(entry: Any) -> str:
    return (
        f"`inside`: no Python source for {_describe(entry)} (a builtin, a C "
        "extension, or code typed in a REPL): bridge rewrites a function from its "
        "source. Define it in a file, or mark its values with bridge.tap."
    )
