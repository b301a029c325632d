"""Flax Linen: `Module.perturb`, inserted from outside with `nn.intercept_methods`.

Every submodule method call passes through an interceptor that reports it to
the probe's session. At a selected call the interceptor calls the module's own
`perturb` on its output, reading the epsilon from a private variable
collection laid out like `params`
(`{scope path...: {"bridge_epsilon:__call__#k": eps}}`, see `carrier_name`).
Each call has its own variable name, so the gradients of a shared module's
calls are never summed, and the collection is passed to `apply` only when
there are epsilons, so unselected sites cost nothing.

Lifted transforms run their body in a scope of their own, and values seen
there are tracers of the transform's inner trace. Recordings leave through a
mutable collection, as Flax's own `sow` does. `nn.remat` and `nn.jit` carry
every collection. `nn.scan` and `nn.vmap` carry only those their
`variable_axes` name — users name `params`, never a perturbation collection, and
an unnamed one is silently dropped — so inside them the epsilons and
recordings ride with the parameters, under reserved names: they are sliced
per iteration going in and stacked coming out exactly as the parameters are.

The interceptor is `bridge.adapters.linen.run`; bridge's collections,
`bridge.adapters.linen.variables`; the sites inside lifted transforms,
`bridge.adapters.linen.transforms`, and inside the model's own JAX
transforms, `bridge.adapters.linen.jax_transforms`; how each call is
reached, the router decides (`bridge.adapters.linen.routes`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax

from bridge.adapter_api import (
    BridgeRuntimeError,
    BridgeTypeError,
    BridgeValueError,
    ProbeBase,
    Session,
)

from ..shared import guests, unexpressible
from . import internals, transforms
from .run import Interceptor
from .variables import (
    EPSILON_COLLECTION,
    RECORDING_COLLECTION,
    names_params,
    place_epsilons,
    recorded,
    with_recordings,
)

#: Keywords of `Module.apply` rather than of the model.
_APPLY_KEYWORDS = ("rngs", "mutable", "capture_intermediates")


class _NeedsParams(Exception):
    """Discovery met a transform that carries only `params`: run it again with
    `params` mutable, so recordings can leave the transform with them."""


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
    for reserved in (EPSILON_COLLECTION, RECORDING_COLLECTION):
        if reserved in variables:
            raise BridgeValueError(
                f"`variables` has a '{reserved}' collection, which bridge reserves "
                "for its own use. Remove it."
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
        unexpressible.refuse_patched(session)
        # `{transform: its name}` of the lifted transforms that broadcast
        # `params`, learnt by discovery (`transforms.Broadcasts`); a run
        # knows those around the sites it selects or patches.
        broadcasting: dict[tuple, str] = dict(
            origin.broadcast
            for site in (*session.selected.values(), *session.patched.values())
            if (origin := site.origin) is not None
            and getattr(origin, "broadcast", None) is not None
        )

        def apply(in_params: bool) -> tuple[Any, Any]:
            while True:
                start = session.checkpoint()
                try:
                    return self._apply(
                        trainable, args, kwargs, session, in_params, broadcasting
                    )
                except transforms.Broadcasts as found:
                    if found.key in broadcasting:
                        raise BridgeRuntimeError(
                            f"bridge could not list the calls inside {found.transform} "
                            "as refused sites. This is a bug in bridge: please "
                            "report it."
                        ) from found
                    session.restore(start)
                    broadcasting[found.key] = found.transform

        return session.run_with_fallback(
            apply, _NeedsParams, lambda origin: origin.in_params
        )

    def _apply(
        self,
        trainable: Any,
        args: tuple,
        kwargs: dict,
        session: Session,
        in_params: bool,
        broadcasting: dict[tuple, str],
    ) -> tuple[Any, Any]:
        apply_kwargs = {k: kwargs[k] for k in _APPLY_KEYWORDS if k in kwargs}
        model_kwargs = {k: v for k, v in kwargs.items() if k not in _APPLY_KEYWORDS}
        user_mutable = apply_kwargs.pop("mutable", False)
        epsilons, params = place_epsilons(session, trainable)
        variables = {**self.variables, "params": params}
        if epsilons:
            variables[EPSILON_COLLECTION] = epsilons
        mutable = with_recordings(user_mutable, in_params)
        interceptor = Interceptor(session, in_params, broadcasting, sys._getframe())
        try:
            with (
                guests.hosting("linen", interceptor.lifted_transform),
                session.taps.tapping(interceptor.tap),
                nn.intercept_methods(interceptor),
            ):
                outputs, state = self.module.apply(
                    variables, *args, mutable=mutable, **apply_kwargs, **model_kwargs
                )
        except ValueError as error:
            transform = internals.broadcasting(error) if in_params else None
            if transform is not None:
                # Discovery lists the calls inside as refused sites; a run
                # records in `params` only the sites discovery did not refuse.
                raise BridgeRuntimeError(
                    f"bridge recorded a site inside {transform}, which broadcasts "
                    "`params`, although discovery listed the calls there as "
                    "refused. This is a bug in bridge: please report it."
                ) from error
            raise
        session.carrier.hand_over(lambda where: recorded(state, where))
        if user_mutable is False:
            return outputs, None
        ours = {EPSILON_COLLECTION, RECORDING_COLLECTION}
        if in_params and not names_params(user_mutable):
            ours.add("params")
        return outputs, {k: v for k, v in state.items() if k not in ours}

    # -- taking the model out (`ActivationProbe.unwrap`) -------------------------

    def unwrap(self) -> tuple:
        """`(module, variables)`, what `bridge.probe` takes: the module, and
        the probe's variables (after `bridge.transfer`, the ported ones) in
        containers of their own, so that changing them changes no probe."""
        return self.module, jax.tree.map(lambda leaf: leaf, self.variables)
