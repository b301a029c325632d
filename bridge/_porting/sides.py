"""Each model of a port read on its inputs: the inputs as its library takes
them, and its parameterised calls as `Layer`s, in call order.

`transfer` and `compare` both take one set of inputs for two models (or a
second set, `args_b`/`kwargs_b`) and read each model through its adapter's
`PortingSide` (`bridge._porting.contract`); both do it here, the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .._errors import BridgeTypeError
from .contract import PortingSide, porting_side
from .layer import Layer


def parameterised_layers(
    probe: Any,
    argument: str,
    args: tuple,
    kwargs: dict,
    others: Sequence[PortingSide] = (),
) -> tuple[PortingSide, list[Layer]]:
    """`(porting side, [Layer per call of a parameterised module])`, in call
    order, found by abstract evaluation (`others`: the other model's porting
    side, which reads its library's values among the inputs)."""
    side = porting_side(probe, argument)
    args, kwargs = inputs_for(probe, args, kwargs, (side, *others))
    discovered = probe.discovered_sites(*args, **kwargs)
    return side, side.layers(probe, discovered)


def inputs_for(
    probe: Any, args: tuple, kwargs: dict, sides: Sequence[PortingSide] = ()
) -> tuple[tuple, dict]:
    """The inputs as `probe` takes them: a JAX model gets a value of another
    side's library given for both models (a porter's PyTorch `x`) as a NumPy
    array (`sides`: the porting sides of both models)."""
    if not getattr(probe, "runs_in_jax", False):
        return args, kwargs
    sides = [side for side in sides if hasattr(side, "to_host")]
    if not sides:
        return args, kwargs

    def on_host(leaf: Any) -> Any:
        for side in sides:
            found = ask(side, "to_host", leaf)
            if found is not None:
                return found
        return leaf

    return jax.tree.map(on_host, (tuple(args), dict(kwargs)))


def ask(side: PortingSide | None, hook: str, value: Any) -> Any:
    """What `side`'s optional `hook` (`to_host`, `numpy_dtype`,
    `to_float64`) makes of `value`; `None` where it has no such hook or
    `value` is not its library's."""
    own = getattr(side, hook, None)
    return None if own is None else own(value)


def host_array(side: PortingSide, value: Any) -> np.ndarray:
    """`value`, one of `side`'s model's, as a NumPy array on the host."""
    found = ask(side, "to_host", value)
    return np.asarray(value) if found is None else found


def numpy_dtype(side: PortingSide | None, dtype: Any) -> np.dtype | None:
    """`dtype` (NumPy's, JAX's, or one of `side`'s library's) as NumPy's;
    `None` for what names no dtype."""
    found = ask(side, "numpy_dtype", dtype)
    if found is not None:
        return np.dtype(found)
    try:
        return np.dtype(dtype)
    except TypeError:
        return None


def second_inputs(args, kwargs, args_b, kwargs_b) -> tuple[tuple, dict]:
    """The second model's inputs: its own where given, else the first's."""
    if args_b is not None and not isinstance(args_b, tuple | list):
        raise BridgeTypeError(
            "`args_b` must be a tuple of the second model's positional inputs, "
            f"e.g. args_b=(x_nhwc,); got {type(args_b).__name__}."
        )
    if kwargs_b is not None and not isinstance(kwargs_b, Mapping):
        raise BridgeTypeError(
            "`kwargs_b` must be a dict of the second model's keyword inputs; got "
            f"{type(kwargs_b).__name__}."
        )
    if args_b is None and kwargs_b is None:
        return args, kwargs
    return tuple(args if args_b is None else args_b), dict(kwargs_b or {})
