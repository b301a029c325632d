"""Flax Linen: every submodule call of `apply`, reached with `nn.intercept_methods`.

Every submodule method call passes through an interceptor
(`bridge.adapters.linen.run`) that names it by its module's scope path and
reports it to the probe's session, which gives a selected call its epsilon,
its patch and its recording where the call runs: in the model's trace, in
Flax's lifted transforms (`nn.scan`, `nn.vmap`, `nn.remat`, `nn.jit`,
`nn.cond`) or in the model's own JAX transforms, read from the computation
JAX builds. The model's variables go to its `apply` as they are: bridge adds
no collection of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax

from bridge.adapter_api import (
    BridgeTypeError,
    BridgeValueError,
    ProbeBase,
    Session,
)

from ..shared import guests
from .run import Interceptor

#: Keywords of `Module.apply` rather than of the model.
_APPLY_KEYWORDS = ("rngs", "mutable", "capture_intermediates")


def probe(module: nn.Module, *variables: Any, vmap: bool = False) -> LinenProbe:
    if len(variables) != 1:
        raise BridgeTypeError(
            "A Flax Linen module needs its variables: bridge.probe(module, "
            "variables) with variables = module.init(key, x) (a dict with a "
            f"'params' collection); got {len(variables)} variable arguments."
        )
    (variables,) = variables
    if not isinstance(variables, Mapping):
        raise BridgeTypeError(
            "`variables` must be the dict returned by module.init(key, x), e.g. "
            f"{{'params': ...}}; got {type(variables).__name__}."
        )
    if variables and "params" not in variables:
        raise BridgeValueError(
            "`variables` has no 'params' collection (its keys are "
            f"{sorted(variables)}). Pass what module.init returns, or wrap bare "
            "parameters: bridge.probe(module, {'params': params})."
        )
    return LinenProbe(module, variables, vmap)


@jax.tree_util.register_pytree_node_class
class LinenProbe(ProbeBase):
    """A Flax Linen module with its variables. See `bridge.ActivationProbe`."""

    #: What `bridge.transfer` and `bridge.compare` know of this library.
    porting_side = "bridge.adapters.linen.porting"

    #: The module (its attributes) is in the treedef, the variables are leaves,
    #: and an origin is a scope path: a discovery is reused by structure.
    reuses_discovery = True

    def __init__(self, module: nn.Module, variables: Mapping, vmap: bool = False):
        self.module = module
        self.variables = variables
        self.vmap = vmap

    def tree_flatten(self):
        return (self.variables,), (self.module, self.vmap)

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(static[0], children[0], static[1])

    def __repr__(self) -> str:
        return f"LinenProbe({type(self.module).__name__}, vmap={self.vmap})"

    def _trainable(self) -> Any:
        return self.variables.get("params", {})

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        mutable = kwargs.get("mutable", False)
        if not (
            isinstance(mutable, bool | str)
            or (
                isinstance(mutable, list | tuple)
                and all(isinstance(m, str) for m in mutable)
            )
            or callable(mutable)
        ):
            raise BridgeTypeError(
                "`mutable` goes to Module.apply: a collection name, a list of names "
                f"(e.g. mutable=['batch_stats']), True or False; got {mutable!r}."
            )

    def _run(
        self, trainable: Any, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        apply_kwargs = {k: kwargs[k] for k in _APPLY_KEYWORDS if k in kwargs}
        model_kwargs = {k: v for k, v in kwargs.items() if k not in _APPLY_KEYWORDS}
        mutable = apply_kwargs.pop("mutable", False)
        variables = {**self.variables, "params": trainable}
        interceptor = Interceptor(session)
        with (
            guests.hosting("linen"),
            session.taps.tapping(interceptor.tap),
            nn.intercept_methods(interceptor),
        ):
            returned = self.module.apply(
                variables, *args, mutable=mutable, **apply_kwargs, **model_kwargs
            )
        if mutable is False:
            return returned, None
        return returned

    # -- taking the model out (`ActivationProbe.unwrap`) -------------------------

    def unwrap(self) -> tuple:
        """`(module, variables)`, what `bridge.probe` takes: the module, and
        the probe's variables (after `bridge.transfer`, the ported ones) in
        containers of their own, so that changing them changes no probe."""
        return self.module, jax.tree.map(lambda leaf: leaf, self.variables)
