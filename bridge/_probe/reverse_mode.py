"""JAX's reverse mode meeting a `while_loop`, told in bridge's words.

JAX cannot differentiate backward through a `lax.while_loop` (nor a
`lax.fori_loop` with traced bounds, which it runs as one) that carries a value
the gradient flows through, and says so only once the backward pass is traced
(`_while_transpose_error`), naming neither the loop nor bridge's ways out.
`value_and_grad` turns that one error into a `BridgeValueError` naming the
loop's line in the model's code (from the stack JAX attaches to it: where the
loop was traced) and the ways out; every other error passes as it is.

Why not refuse at discovery: whether a loop carries such a value is JAX's
own decision (a carry reached only through `stop_gradient`, an integer or a
custom rule carries none, and a loop over a counter or constants is
differentiated), which JAX's backward pass alone makes exactly; a reading of
the discovery's jaxpr would guess, and a wrong guess refuses a model JAX
differentiates. Under `jax.jit` the error comes while tracing, before any
FLOP; eagerly, the forward pass has run.
"""

from __future__ import annotations

import os
import sys

from .._errors import BridgeValueError
from .._session.inside_functions import is_library_module
from .._session.routing import JAX_RULES, TRACED_BOUNDS_FIX

#: How JAX's error begins (`jax._src.lax.control_flow.loops`), from jax
#: 0.4.36 to 0.10.
_JAX_MESSAGE = "Reverse-mode differentiation does not work for lax.while_loop"


def through_a_while_loop(error: BaseException) -> BridgeValueError | None:
    """Bridge's error for JAX's `error`, where it is JAX's refusal to
    differentiate backward through a while loop; `None` for any other."""
    if type(error) is not ValueError or not str(error).startswith(_JAX_MESSAGE):
        return None
    frame = _model_frame(error)
    where = "" if frame is None else " at {}:{} (in {})".format(*frame)
    return BridgeValueError(
        "`value_and_grad`: JAX cannot differentiate backward through the while "
        f"loop{where}, a jax.lax.while_loop (or a jax.lax.fori_loop with traced "
        "bounds, which JAX runs as one) carrying a value the gradient flows "
        "through (from the parameters or a selected site): how many iterations "
        "run is known only when the model runs, so JAX keeps none to go back "
        "through. Ways out: probe.apply(x, at=...) gives the sites' values, "
        f"without gradients; {JAX_RULES['while_body'].fix}; for a fori_loop, "
        f"{TRACED_BOUNDS_FIX}; or Equinox's checkpointed loop, "
        'equinox.internal.while_loop(cond, body, init, kind="checkpointed", '
        "max_steps=n), which JAX differentiates backward and whose steps bridge "
        "probes."
    )


def _model_frame(error: BaseException) -> tuple[str, int, str] | None:
    """`(file, line, function)` where the model's own code called the loop:
    the innermost frame, outside bridge and the libraries, of the stack JAX
    attaches as the error's cause (`JaxStackTraceBeforeTransformation`: the
    stack while the loop was traced); `None` where there is none."""
    traceback = getattr(error.__cause__, "__traceback__", None)
    libraries = _library_directories()
    found = None
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if not code.co_filename.startswith(libraries):
            name = getattr(code, "co_qualname", code.co_name)
            found = (code.co_filename, traceback.tb_lineno, name)
        traceback = traceback.tb_next
    return found


def _library_directories() -> tuple[str, ...]:
    """The directories of bridge's packages and the libraries' (JAX's, each
    registered adapter's): their frames are not the model's code. (JAX's
    frames carry no module name: they are told by their file.)"""
    directories = []
    for name, module in list(sys.modules.items()):
        if is_library_module(name):
            spec = getattr(module, "__spec__", None)
            # The import system's own record, not `module.__path__`: a
            # package may set that attribute to anything (PyTorch's
            # `torch._classes` answers every attribute with a namespace).
            locations = getattr(spec, "submodule_search_locations", None)
            directories.extend(os.path.join(path, "") for path in locations or ())
    return tuple(directories)
