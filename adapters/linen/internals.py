"""The Flax internals the Linen adapter relies on: all of them, and only here.

Checked against flax 0.10.1 (the floor CI tests) and 0.12.8. No public API
gives either of these:

- Which Linen lifted transform a call runs inside (`transform_call`): read
  off the Python call stack, as the frames of the `wrapped_fn`s that
  `flax.linen.transforms` makes of a function or a module class (found once,
  by walking the code of its `*lift_transform*` makers).
- Whether a lifted transform broadcasts `params` (`nn.RNN`'s `nn.scan`, an
  `nn.vmap` with `variable_axes={'params': None}`): its configuration lives
  in the closure Flax builds, so bridge learns it from the error Flax raises
  when a recording among the parameters depends on the loop
  (`broadcasting`, matching the error's text).

Where Flax changes either, `transform_call` finds no frame (the calls inside
lifted transforms are then refused, naming the transform, before any work)
or `broadcasting` finds no text (Flax's own error is raised): never a wrong
number.
"""

from __future__ import annotations

import os
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


_AXES_SCAN_BODY = ("body_fn", os.path.join("flax", "core", "axes_scan.py"))


def in_invariants_pass() -> bool:
    """Whether the innermost `nn.scan` body running now runs in the pass
    Flax makes over it before the scan (`flax.core.axes_scan`, the body's
    `init_mode`), to find what it broadcasts: its other values are
    discarded."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == _AXES_SCAN_BODY[0] and code.co_filename.endswith(
            _AXES_SCAN_BODY[1]
        ):
            return frame.f_locals.get("init_mode") is True
        frame = frame.f_back
    return False


#: Flax's errors where a transform broadcasts `params` that a recording made
#: inside depends on, and the transform each names.
_BROADCAST_ERRORS = {
    "broadcasted variable has a data dependency": "nn.scan",
    "got axis spec None but output was batched": "nn.vmap",
}


def broadcasting(error: ValueError) -> str | None:
    message = str(error)
    for text, transform in _BROADCAST_ERRORS.items():
        if text in message:
            return transform
    return None
