"""The dm-haiku internals the Haiku adapter relies on: all of them, and only here.

Haiku runs a module's call inside its lifted transforms (`layer_stack`,
`hk.scan`, `hk.remat`, `hk.vmap`, …) from its own Python frames, and tells a
method interceptor (`hk.intercept_methods`, public) nothing about them. The
call router decides a site's route from the transforms that enclose it
(`bridge.adapters.haiku.transforms.route`), so this module reads them off the
Python call stack, innermost first (`enclosing`): the code objects of Haiku's own
functions, by qualified name (`_LayerStack.__call__.<locals>.layer`,
`transform_with_state.<locals>.apply_fn`, `thread_hk_state_in_kwargs`, the
nested functions of `hk.scan` and the other stateful transforms), and
`hk.scan`'s own `length` and `reverse` arguments from its frame. It also reads:

- `apply._original_fn`, the function `hk.transform` wraps (set by
  `haiku._src.transform.tie_in_original_fn`, marked experimental), to run a
  plain transform as `hk.transform_with_state` when a site's epsilon must
  ride in state through a lifted transform;
- the class `haiku._src.lift.LiftingModule` (by name; not exported), whose
  calls return lifted parameters rather than activations;
- the parameters of the frame running now (`haiku._src.base.current_frame()
  .params`), by module name: inside a layer stack's or `hk.scan`'s body they
  are tracers of its trace (`module_params`), without calling a module
  method the interceptor would see.

No public API gives any of these. At import this module checks that each
exists and raises an error naming the supported versions where one does not:
an unsupported Haiku fails at `bridge.probe`, never with a wrong number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax

from bridge.adapter_api import counter_calling, unsupported

from ..shared import jax_internals

#: The modules whose functions are recognised on the call stack.
_SOURCES = ("stateful", "layer_stack", "transform")
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
_INNER_APPLY = "transform_with_state.<locals>.apply_fn"
#: `hk.remat` and `hk.jit` thread state in and out of the JAX transform: state
#: set inside comes out, unstacked, as for a call outside.
_THREADS_STATE = "thread_hk_state_in_kwargs"
#: The names `enclosing` gives Haiku's transforms, as `transforms.RULES` keys
#: them; those that carry bridge's state first.
LAYER_STACK = "hk.experimental.layer_stack"
SCAN = "hk.scan"
#: The modules whose `jax.lax.scan` runs a layer stack and an `hk.scan`
#: (counted while a probe runs: `transforms.count_scans_of`).
SCAN_MODULES = ("haiku._src.layer_stack", "haiku._src.stateful")
THREADS_STATE = "hk.remat or hk.jit"
CARRYING = frozenset({LAYER_STACK, SCAN, THREADS_STATE})
LIFT = "hk.lift"
#: An `hk.scan` whose one carry would hold another's rows: nested in one, or
#: with a layer stack, which slices state per layer.
SHARED_SCAN = "hk.scan (shared carry)"
#: By the function of `haiku._src.stateful` whose nested functions run the
#: body.
_TRANSFORM_NAMES = {
    "scan": SCAN,
    "fori_loop": "hk.fori_loop",
    "while_loop": "hk.while_loop",
    "vmap": "hk.vmap",
    "stateful_branch": "hk.cond",
    "with_output_structure_hint": "hk.cond",
    "switch": "hk.switch",
    "grad": "hk.grad",
    "value_and_grad": "hk.value_and_grad",
    _THREADS_STATE: THREADS_STATE,
}


@dataclasses.dataclass
class Enclosing:
    """The Haiku transforms around a call, read from the Python call stack.

    Attributes:
      body: the innermost layer stack body's frame.
      stack_call: the `_LayerStack.__call__` frame that runs it.
      transforms: Haiku's transforms, innermost first, as `_TRANSFORM_NAMES`
        and `transforms.RULES` name them; a transform whose frames follow
        one another named once.
      scan: `(length, reverse)` of the `hk.scan` whose carry holds the call's
        rows.
      scan_body: the innermost `hk.scan` body's frame.
      scans: how many layer stack and `hk.scan` bodies run the call: each
        in a `jax.lax.scan` of Haiku's.
    """

    body: Any = None
    stack_call: Any = None
    transforms: tuple[str, ...] = ()
    scan: tuple[int, bool] | None = None
    scan_body: Any = None
    scans: int = 0


def _qualnames() -> dict[Any, str]:
    """`{code object: qualified name}` for Haiku's transforms: what
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


def enclosing(stop: Any) -> Enclosing:
    """Haiku's transforms run the body from their own frames; walk up to the
    frame of the probe's own `apply` (`stop`) and name them."""
    found = Enclosing()
    names: list[str] = []
    inner_applies = layer_bodies = scans = 0
    scan_frame = None
    frame = sys._getframe(2)
    while frame is not None and frame is not stop:
        code = frame.f_code
        named = None
        if code.co_filename.startswith(_HAIKU_SOURCE):
            qualname = _qualname(code)
            if qualname == _LAYER_STACK_BODY:
                layer_bodies += 1
                named = LAYER_STACK
                if found.body is None:
                    found.body = frame
            elif qualname == _LAYER_STACK_CALL and found.stack_call is None:
                # The stack whose body runs this call, not one being entered.
                if found.body is not None:
                    found.stack_call = frame
            elif qualname == _INNER_APPLY:
                inner_applies += 1
            elif code.co_filename.endswith("stateful.py") and qualname == "scan":
                scan_frame = scan_frame or frame
            elif code.co_filename.endswith("stateful.py") and "<locals>" in qualname:
                named = _TRANSFORM_NAMES.get(qualname.split(".")[0])
                scans += named == SCAN
                if named == SCAN and found.scan_body is None:
                    found.scan_body = frame
        # A transform runs the body from one frame or a few in a row (hk.vmap's
        # `mapped_fun` and `pure_fun`): named once. A layer stack's is one.
        if named is not None and (named == LAYER_STACK or names[-1:] != [named]):
            names.append(named)
        frame = frame.f_back
    blocked = any(name not in CARRYING for name in names)
    # One `apply_fn` is the probe's own, one more each layer_stack body's; any
    # other is an inner transform the user lifted, whose state is their own.
    # Where it stands among the others is not read: it is named last, where
    # nothing else of Haiku's blocks first.
    if inner_applies > 1 + layer_bodies:
        names.append(LIFT)
    elif scans and not blocked:
        if scans > 1 or layer_bodies or scan_frame is None:
            # A per-iteration counter in a carry sliced per layer, or in two
            # nested carries, is not built: that scan carries nothing (a rule
            # is one transform's, not a pair's), named so where nothing else
            # of Haiku's blocks, which a refusal names first.
            names = [SHARED_SCAN if name == SCAN else name for name in names]
        else:
            # hk.scan's own arguments, `length` as apply computes it.
            local = scan_frame.f_locals
            found.scan = (int(local["length"]), bool(local["reverse"]))
    found.transforms = tuple(names)
    found.scans = layer_bodies + scans
    return found


def body_trace(body: Any) -> Any:
    """The trace a layer stack's or `hk.scan`'s body (its frame, `body`)
    runs in: that of the iteration counter the scan carries while a probe
    runs (`bridge.adapter_api.counter_calling`), else that of the first
    tracer among the body's own locals (its carry, its slice of `xs`, the
    layers' parameters); `None` where neither is found."""
    counter = counter_calling(body)
    if counter is not None:
        return jax_internals.trace_of(counter)
    local = body.f_locals
    names = body.f_code.co_varnames
    for leaf in jax.tree.leaves([local[name] for name in names if name in local]):
        trace = jax_internals.trace_of(leaf)
        if trace is not None:
            return trace
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


def original_function(apply: Callable) -> Callable | None:
    """The function `hk.transform` wrapped, from Haiku's own `apply` only: a
    wrapper that copied `_original_fn` with `functools.wraps` may compute
    something else."""
    original = getattr(apply, "_original_fn", None)
    code = getattr(apply, "__code__", None)
    if (
        original is None
        or code is None
        or not code.co_filename.startswith(_HAIKU_SOURCE)
    ):
        return None
    return original


def module_params(module: Any) -> list[Any]:
    """The values of `module`'s own parameters in the frame running now."""
    base = sys.modules["haiku._src.base"]
    return list(base.current_frame().params.get(module.module_name, {}).values())


def _missing() -> list[str]:
    missing = []
    try:
        known = set(_QUALNAMES.values())
    except (ImportError, AttributeError) as error:
        return [f"haiku._src modules: {error}"]
    for qualname in (_LAYER_STACK_CALL, _LAYER_STACK_BODY, _INNER_APPLY):
        if qualname not in known:
            missing.append(qualname)
    if not any(q.startswith(f"{_THREADS_STATE}.<locals>") for q in known):
        missing.append(f"{_THREADS_STATE}'s wrapper")
    scan = getattr(sys.modules["haiku._src.stateful"], "scan", None)
    parameters = inspect.signature(scan).parameters if scan else {}
    if not {"length", "reverse"} <= set(parameters):
        missing.append("haiku._src.stateful.scan(..., length, reverse)")
    lift = importlib.import_module("haiku._src.lift")
    if not inspect.isclass(getattr(lift, "LiftingModule", None)):
        missing.append("haiku._src.lift.LiftingModule")
    base = importlib.import_module("haiku._src.base")
    frame = getattr(base, "Frame", None)
    if not callable(getattr(base, "current_frame", None)) or "params" not in getattr(
        frame, "_fields", ()
    ):
        missing.append("haiku._src.base.current_frame().params")
    if not hasattr(hk.transform(lambda: None).apply, "_original_fn"):
        missing.append("Transformed.apply._original_fn")
    return missing


_MISSING = _missing()
if _MISSING:
    raise unsupported("dm-haiku", "Haiku", _MISSING)
