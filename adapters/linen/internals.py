"""The Flax Linen internals the Linen adapter relies on: all of them, and only here.

- the `wrapped_fn` functions that `flax.linen.transforms` makes of a function
  or a module class for each lifted transform (`nn.scan`, `nn.vmap`,
  `nn.remat`, ...): their code, found in the code of Flax's
  `decorator_lift_transform` and `module_class_lift_transform` (and their
  `_cached` variants), tells a lifted transform's call on the Python call
  stack (`transform_call`). Flax traces a lifted body more than once in one
  call, and tells a method interceptor (`nn.intercept_methods`, public)
  nothing about which call a trace belongs to.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import flax.linen as nn


def _wrappers() -> frozenset[Any]:
    """The code of the functions a Linen lifted transform's call runs in, for
    the whole call (every trace of its body): the `wrapped_fn`s that
    `flax.linen.transforms` makes of a function or a module class."""
    found = set()

    def walk(code: Any) -> None:
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                if const.co_name == "wrapped_fn":
                    found.add(const)
                walk(const)

    for maker in (
        "decorator_lift_transform",
        "decorator_lift_transform_cached",
        "module_class_lift_transform",
        "module_class_lift_transform_cached",
    ):
        function = getattr(nn.transforms, maker, None)
        if function is not None:
            walk(function.__code__)
    return frozenset(found)


_WRAPPERS = _wrappers()


def transform_call() -> Any:
    """The Python frame of the innermost Linen lifted transform's call running
    now, or `None`. Flax traces a body more than once in one call
    (`nn.scan`: to create its broadcast variables, then once per type of
    carry `lax.scan` meets); a functional transform's body (`nn.scan(fn)`)
    starts each trace with a call of its module at path `()`, which is a new
    trace of the same call, not a new call, while this frame is the same."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _WRAPPERS:
            return frame
        frame = frame.f_back
    return None
