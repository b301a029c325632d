"""The dm-haiku internals the Haiku adapter relies on: all of them, and only here.

Inside `hk.experimental.layer_stack` a module is named relative to the layer
(`lin`), and the stack's params under the name of the `LiftingModule` the
stack calls first (`__layer_stack_no_per_layer/lin`). A method interceptor
(`hk.intercept_methods`, public) is told neither, so this module reads
which layer stack's body runs a call off the Python call stack: the code
objects of Haiku's own functions, by qualified name
(`_LayerStack.__call__`, `_LayerStack.__call__.<locals>.layer`), never a
frame's locals; and it recognises the class
`haiku._src.lift.LiftingModule` (by name; not exported), whose calls return
lifted parameters rather than activations.

No public API gives either. At import this module checks that each exists
and raises an error naming the supported versions where one does not: an
unsupported Haiku fails at `bridge.probe`, never with a wrong number.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from typing import Any

import haiku as hk
import jax

from bridge.adapter_api import unsupported

#: The modules whose functions are recognised on the call stack.
_SOURCES = ("layer_stack",)
#: Haiku's own source, to recognise its transforms on the Python call stack.
_HAIKU_SOURCE = os.path.dirname(hk.__file__) + os.sep
_JAX_SOURCE = os.path.dirname(jax.__file__) + os.sep
#: Haiku names each module method's scope with jax's `extend_name_stack`, a
#: `contextlib.contextmanager` used as a decorator in older jax (0.4.36 to at
#: least 0.7.1; its own class later): that frame then sits between a
#: `LiftingModule` call and the layer stack that made it.
_CONTEXTLIB_SOURCE = contextlib.__file__
_LAYER_STACK_CALL = "_LayerStack.__call__"
_LAYER_STACK_BODY = "_LayerStack.__call__.<locals>.layer"


def _qualnames() -> dict[Any, str]:
    """`{code object: qualified name}` for Haiku's layer stack: what
    `code.co_qualname` gives from Python 3.11, built here for 3.10."""
    table: dict[Any, str] = {}

    def walk(code: Any, qualname: str) -> None:
        table[code] = qualname
        for const in code.co_consts:
            if inspect.iscode(const):
                walk(const, f"{qualname}.<locals>.{const.co_name}")

    for name in _SOURCES:
        module = importlib.import_module(f"haiku._src.{name}")
        for value in vars(module).values():
            functions = vars(value).values() if inspect.isclass(value) else [value]
            for function in functions:
                function = inspect.unwrap(function) if callable(function) else None
                if inspect.isfunction(function):
                    walk(function.__code__, function.__qualname__)
    return table


_QUALNAMES = _qualnames()


def _qualname(code: Any) -> str:
    return getattr(code, "co_qualname", None) or _QUALNAMES.get(code, code.co_name)


def layer_stack_call(stop: Any) -> Any:
    """The `_LayerStack.__call__` frame whose body runs the call running now
    (`None` outside a layer stack), read up to the frame of the probe's own
    `apply` (`stop`)."""
    in_body = False
    frame = sys._getframe(2)
    while frame is not None and frame is not stop:
        code = frame.f_code
        if code.co_filename.startswith(_HAIKU_SOURCE):
            qualname = _qualname(code)
            if qualname == _LAYER_STACK_BODY:
                in_body = True
            elif qualname == _LAYER_STACK_CALL and in_body:
                return frame
        frame = frame.f_back
    return None


def layer_stack_caller() -> Any:
    """The `_LayerStack.__call__` frame that called a `LiftingModule`, if a
    layer stack (not a user's `hk.lift`) called it."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(
        (_HAIKU_SOURCE, _JAX_SOURCE, _CONTEXTLIB_SOURCE)
    ):
        if _qualname(frame.f_code) == _LAYER_STACK_CALL:
            return frame
        frame = frame.f_back
    return None


def is_lifting(module: Any) -> bool:
    """Haiku's `LiftingModule` (behind `hk.experimental.lift` and `layer_stack`),
    which is not exported."""
    kind = type(module)
    return kind.__name__ == "LiftingModule" and kind.__module__.startswith("haiku")


def _missing() -> list[str]:
    missing = []
    try:
        known = set(_QUALNAMES.values())
    except (ImportError, AttributeError) as error:
        return [f"haiku._src modules: {error}"]
    for qualname in (_LAYER_STACK_CALL, _LAYER_STACK_BODY):
        if qualname not in known:
            missing.append(qualname)
    lift = importlib.import_module("haiku._src.lift")
    if not inspect.isclass(getattr(lift, "LiftingModule", None)):
        missing.append("haiku._src.lift.LiftingModule")
    return missing


_MISSING = _missing()
if _MISSING:
    raise unsupported("dm-haiku", "Haiku", _MISSING)
