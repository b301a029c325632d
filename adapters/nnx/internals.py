"""The Flax NNX internals the NNX adapter relies on: all of them, and only here.

- `nnx.graphlib.GRAPH_CONTEXT.update_context_stacks`: which NNX transforms
  (`nnx.scan`, `nnx.vmap`, `nnx.remat`, `nnx.jit`, …) are running now, by
  their update-context tags: named in the error for a guest library's call
  inside one. NNX exposes no public "current transforms".
- `nnx.List` and pytree modules (flax 0.12's module system): checked here,
  as the mark of the NNX bridge is written for; older NNX is a different API.
- `Module._pytree__is_pytree`: whether a module class was declared with
  `pytree=False`; a reporting subclass must be declared the same way, and
  the class keyword is all NNX offers to say so (absent before it existed).

At import this module checks that the transform stack exists and raises an
error naming the supported versions where it does not: an unsupported Flax
fails at `bridge.probe`, never with a silently dropped site.
"""

from __future__ import annotations

import importlib
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


def transform_name(tag: Any) -> str:
    """An NNX transform's name (`nnx.scan`), from its update-context tag."""
    if isinstance(tag, str):
        return f"nnx.{tag.removesuffix('_body')}"
    kind = type(tag).__name__.lower()
    for transform in ("jit", "shard_map", "pmap", "cond", "switch"):
        if transform in kind:
            return f"nnx.{transform}"
    return f"an NNX transform ({type(tag).__name__})"
