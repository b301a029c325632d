"""dm-haiku: every module method call reported by `hk.intercept_methods`.

Every module method call passes through an interceptor, installed around
`apply` from outside, that reports it to the probe's session, and every
`bridge.tap` through the session's tap handler. The epsilon, the patch and
the recording are the core's: it reads where each call runs from the
computation JAX builds (`bridge._session.computation`), so a site inside
Haiku's lifted transforms is a site like any other: a layer stack's and
`hk.scan`'s sites hold every layer or iteration (`(layers, *value shape)`,
in the order of `xs`), `hk.remat` and `hk.jit` are crossed as JAX's
`checkpoint` and `jit`, `hk.cond`/`hk.switch` as branches (`ran` says where
each ran), `hk.vmap` as the model's own `jax.vmap` (the site holds every
mapped example), and a `hk.while_loop` is refused with the core's sentence.

The interceptor is `bridge.adapters.haiku.run`; naming a call inside a
layer stack, the one use of Haiku's internals, is
`bridge.adapters.haiku.internals`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Any

import haiku as hk
import jax

from bridge.adapter_api import (
    BridgeTypeError,
    ProbeBase,
    Session,
)

from ..shared import guests
from .run import Interceptor

_PLAIN_USAGE = (
    "bridge.probe(transformed, params) with params = transformed.init(rng, x)"
)
_STATE_USAGE = (
    "bridge.probe(transformed, params, state) with params, state = "
    "transformed.init(rng, x)"
)


def probe(
    transformed: hk.Transformed | hk.TransformedWithState,
    *variables: Any,
    vmap: bool = False,
) -> HaikuProbe:
    with_state = isinstance(transformed, hk.TransformedWithState)
    if len(variables) == 1 and _is_params_and_state(variables[0]):
        raise BridgeTypeError(
            "bridge.probe got the (params, state) pair that "
            "hk.transform_with_state's init returns as one argument: unpack it, "
            f"{_STATE_USAGE}: bridge.probe(transformed, *variables)."
        )
    if with_state:
        if len(variables) != 2:
            raise BridgeTypeError(
                "An hk.transform_with_state model needs its params and its state: "
                f"{_STATE_USAGE}; got {len(variables)} variable arguments."
            )
        params, state = variables
        _check_mapping("state", state, _STATE_USAGE)
    else:
        if len(variables) != 1:
            hint = (
                " An hk.transform model has no state: if it uses hk.get_state or "
                "hk.set_state, transform it with hk.transform_with_state and pass "
                "bridge.probe(transformed, params, state)."
                if len(variables) > 1
                else ""
            )
            raise BridgeTypeError(
                f"An hk.transform model needs its params: {_PLAIN_USAGE}; got "
                f"{len(variables)} variable arguments.{hint}"
            )
        (params,) = variables
        state = None
    _check_mapping("params", params, _STATE_USAGE if with_state else _PLAIN_USAGE)
    return HaikuProbe(transformed, params, state, _takes_rng(transformed), vmap)


@jax.tree_util.register_pytree_node_class
class HaikuProbe(ProbeBase):
    """A Haiku transformed function with its params (and state).

    See `bridge.ActivationProbe`. `rng=` given to `value_and_grad`, `apply` or
    `sites` goes to the transformed function's `apply`.
    """

    #: What `bridge.transfer` and `bridge.compare` know of this library.
    porting_side = "bridge.adapters.haiku.porting"

    #: The transformed functions are in the treedef, params and state are
    #: leaves, and a site has no origin of the adapter's: a discovery is
    #: reused by structure.
    reuses_discovery = True

    def __init__(
        self,
        transformed: hk.Transformed | hk.TransformedWithState,
        params: Mapping,
        state: Mapping | None,
        takes_rng: bool,
        vmap: bool = False,
    ):
        self.transformed = transformed
        self.params = params
        self.state = state
        self.takes_rng = takes_rng
        self.vmap = vmap

    @property
    def with_state(self) -> bool:
        return self.state is not None

    def tree_flatten(self):
        static = (self.transformed, self.takes_rng, self.vmap)
        return (self.params, self.state), static

    @classmethod
    def tree_unflatten(cls, static, children):
        transformed, takes_rng, vmap = static
        params, state = children
        return cls(transformed, params, state, takes_rng, vmap)

    def __repr__(self) -> str:
        kind = "transform_with_state" if self.with_state else "transform"
        return f"HaikuProbe({kind}, vmap={self.vmap})"

    def _trainable(self) -> Any:
        return self.params

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        if "rng" in kwargs and not self.takes_rng:
            raise BridgeTypeError(
                "`rng` goes to the transformed function's apply, but this one was "
                "made with hk.without_apply_rng and takes no rng. Drop `rng=`, or "
                "transform the model without hk.without_apply_rng."
            )

    @guests.hosted("haiku")
    def _run(
        self, trainable: Any, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        model_kwargs = {k: v for k, v in kwargs.items() if k != "rng"}
        leading = (kwargs.get("rng"),) if self.takes_rng else ()
        state = (self.state,) if self.with_state else ()
        # The layer stacks around a call are read off the stack up to this
        # frame: what runs the probe (a user's jit, a scan of it) is not the
        # model's.
        interceptor = Interceptor(session, sys._getframe())
        with session.taps.tapping(interceptor.tap), hk.intercept_methods(interceptor):
            result = self.transformed.apply(
                trainable, *state, *leading, *args, **model_kwargs
            )
        return result if self.with_state else (result, None)

    # -- taking the model out (`ActivationProbe.unwrap`) -------------------------

    def unwrap(self) -> tuple:
        """`(transformed, params)`, or `(transformed, params, state)` for
        `hk.transform_with_state`, what `bridge.probe` takes: the probe's
        params and state (after `bridge.transfer`, the ported ones) in
        containers of their own, so that changing them changes no probe."""
        params, state = jax.tree.map(lambda leaf: leaf, (self.params, self.state))
        if self.with_state:
            return self.transformed, params, state
        return self.transformed, params


def _takes_rng(transformed: hk.Transformed | hk.TransformedWithState) -> bool:
    """Whether `apply` takes an rng (`hk.without_apply_rng` removes it).

    Haiku gives every apply it builds a signature; its rng parameter is named
    `rng`, after `params` (and `state`).
    """
    position = 2 if isinstance(transformed, hk.TransformedWithState) else 1
    try:
        parameters = list(inspect.signature(transformed.apply).parameters.values())
    except (TypeError, ValueError):
        return True  # not inspectable: assume Haiku's default signature
    return len(parameters) > position and parameters[position].name == "rng"


def _is_params_and_state(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(part, Mapping) for part in value)
    )


def _check_mapping(name: str, value: Any, usage: str) -> None:
    if not isinstance(value, Mapping):
        hint = (
            " If you passed the (params, state) pair that "
            "hk.transform_with_state's init returns, unpack it."
            if isinstance(value, tuple)
            else ""
        )
        raise BridgeTypeError(
            f"`{name}` must be the dict of dicts that transformed.init returns "
            f"({usage}); got {type(value).__name__}.{hint}"
        )
