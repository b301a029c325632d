"""The Flax NNX internals the NNX adapter relies on: all of them, and only here.

- `nnx.graphlib.GRAPH_CONTEXT.update_context_stacks`: which NNX transforms
  (`nnx.scan`, `nnx.vmap`, `nnx.remat`, `nnx.jit`, …) are running now, by
  their update-context tags. A call inside one runs on new module objects
  made by NNX's split and merge; which transform it is decides whether bridge's
  variables on the module are carried in and out (see
  `bridge.adapters.nnx`). NNX exposes no public "current transforms".
- `nnx.List` and pytree modules (flax 0.12's module system): checked here,
  as the mark of the NNX bridge is written for; older NNX is a different API.
- `Module._pytree__is_pytree`: whether a module class was declared with
  `pytree=False`; a reporting subclass must be declared the same way, and
  the class keyword is all NNX offers to say so (absent before it existed).
- NNX's transforms' own frames on the Python call stack: whether code of an
  NNX transform runs now (`in_transform_code`: a transform in tree mode
  pushes no update context), and the `broadcast_deque` local of the graph-mode
  wrapper of `nnx.scan` (`scan_broadcasts`: the states it broadcasts, which a
  module carried through the scan has not).
- `flax.nnx.transforms.iteration`, the module whose code calls
  `jax.lax.scan` for `nnx.scan` (`SCAN_MODULE`): while a probe runs, bridge
  counts that scan's iterations (`bridge.adapter_api.count_scans_of`).

At import this module checks that the transform stack exists and raises an
error naming the supported versions where it does not: an unsupported Flax
fails at `bridge.probe`, never with a silently dropped site.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from flax import nnx

from bridge.adapter_api import unsupported

#: NNX's graph internals: `flax.nnx.graphlib` (`nnx.graphlib`) since flax
#: 0.12.5, `flax.nnx.graph` before (the same `is_graph_node`, `GRAPH_CONTEXT`).
graphlib = getattr(nnx, "graphlib", None) or importlib.import_module("flax.nnx.graph")

#: `nnx.iter_modules(module)` since flax 0.12.1; the method (same walk, same
#: paths, the root included) in 0.12.0, deprecated since.
iter_modules = getattr(nnx, "iter_modules", None) or nnx.Module.iter_modules


def get_value(variable: nnx.Variable) -> Any:
    """`variable.get_value()` since flax 0.12.1; `.value` in 0.12.0."""
    if hasattr(type(variable), "get_value"):
        return variable.get_value()
    return variable.value


def set_value(variable: nnx.Variable, value: Any) -> None:
    """`variable.set_value(value)` since flax 0.12.1; `.value = ` in 0.12.0."""
    if hasattr(type(variable), "set_value"):
        variable.set_value(value)
    else:
        variable.value = value


def _missing() -> list[str]:
    missing = []
    if not hasattr(nnx, "List"):
        missing.append("nnx.List and pytree modules, NNX's module system of flax 0.12")
    context = getattr(graphlib, "GRAPH_CONTEXT", None)
    if not isinstance(getattr(context, "update_context_stacks", None), dict):
        missing.append("flax.nnx.graphlib.GRAPH_CONTEXT.update_context_stacks")
    return missing


_MISSING = _missing()
if _MISSING:
    raise unsupported("flax", "Flax NNX", _MISSING)


def active_transforms() -> tuple[Any, ...]:
    """The update-context tags of the NNX transforms running now, outermost
    first (`"scan"`, `"vmap"`, `"remat"`, or a transform's own tag object)."""
    stacks = graphlib.GRAPH_CONTEXT.update_context_stacks
    return tuple(tag for tag, stack in stacks.items() if stack)


def class_keywords(cls: type) -> dict[str, Any]:
    """The class keywords a subclass of the module class `cls` needs to be
    declared as `cls` was."""
    is_pytree = getattr(cls, "_pytree__is_pytree", None)
    return {} if is_pytree is None else {"pytree": is_pytree}


def depth(tag: str) -> int:
    """How many NNX transforms of kind `tag` (`"scan"`) are running now."""
    return len(graphlib.GRAPH_CONTEXT.update_context_stacks.get(tag, ()))


#: The folder of NNX's transforms, and the one of them bridge sees through.
_NNX_TRANSFORMS = os.path.join("flax", "nnx", "transforms") + os.sep
_NNX_JIT = "compilation.py"

#: The module of NNX's scan, which calls `jax.lax.scan` by that name.
SCAN_MODULE = "flax.nnx.transforms.iteration"

#: The file of NNX's scan, whose wrapper splits the modules it broadcasts.
_NNX_ITERATION = os.path.join("nnx", "transforms", "iteration.py")


def in_transform_code(stop: Any) -> bool:
    """Whether code of an NNX transform other than `nnx.jit` runs now (a
    frame of `flax/nnx/transforms/`), up to the frame `stop`."""
    frame = sys._getframe(1)
    while frame is not None and frame is not stop:
        filename = frame.f_code.co_filename
        if _NNX_TRANSFORMS in filename and not filename.endswith(_NNX_JIT):
            return True
        frame = frame.f_back
    return False


def scan_broadcasts(stop: Any) -> Any:
    """The states the graph-mode wrapper of the innermost `nnx.scan` running
    now split as broadcast (its `broadcast_deque` local), read up to the frame
    `stop`; `None` where no such frame runs (or it holds none)."""
    frame = sys._getframe(1)
    while frame is not None and frame is not stop:
        code = frame.f_code
        if code.co_name == "scan_wrapper" and code.co_filename.endswith(_NNX_ITERATION):
            return frame.f_locals.get("broadcast_deque")
        frame = frame.f_back
    return None
