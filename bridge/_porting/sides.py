"""Each model of a port read on its inputs: the inputs as its library takes
them, and its parameterised calls as `Layer`s, in call order.

`transfer` and `compare` both take one set of inputs for two models (or a
second set, `args_b`/`kwargs_b`) and read each model through its adapter's
`PortingSide` (`bridge._porting.contract`); both do it here, the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import BridgeTypeError
from .contract import PortingSide, porting_side
from .layer import Layer


def parameterised_layers(
    probe: Any, argument: str, args: tuple, kwargs: dict
) -> tuple[PortingSide, list[Layer]]:
    """`(porting side, [Layer per call of a parameterised module])`, in call
    order, found by abstract evaluation."""
    side = porting_side(probe, argument)
    args, kwargs = inputs_for(probe, args, kwargs)
    discovered = probe.discovered_sites(*args, **kwargs)
    return side, side.layers(probe, discovered)


def inputs_for(probe: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs as `probe` takes them: a JAX model gets a PyTorch tensor
    given for both models (a porter's `x`) as a NumPy array."""
    if not getattr(probe, "runs_in_jax", False):
        return args, kwargs
    return jax.tree.map(_host_if_torch, (tuple(args), dict(kwargs)))


def _host_if_torch(leaf: Any) -> Any:
    if type(leaf).__module__.split(".")[0] != "torch" or not hasattr(leaf, "detach"):
        return leaf
    leaf = leaf.detach().cpu()
    if leaf.is_floating_point() and str(leaf.dtype) == "torch.bfloat16":
        return jnp.asarray(leaf.float().numpy(), jnp.bfloat16)
    return leaf.numpy()


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
