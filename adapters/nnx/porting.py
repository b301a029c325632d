"""Flax NNX's side of `bridge.transfer` and `bridge.compare`.

A parameterised module is one holding `nnx.Param` variables itself; its
weights are read from the probe's split state by attribute path (BatchNorm's
running statistics are `nnx.BatchStat` variables of the rest of the state).
NNX is channel-last with `(in, out)` kernels, the canonical layout already;
`LinearGeneral` kernels with head axes (attention projections) are flattened
row-major. NNX's modules hold Linen's weights and hyperparameters under
Linen's names, so Linen's converters read them. The new probe holds new
state: the user's module is untouched.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bridge.adapter_api import (
    Layer,
    LayerKinds,
    ParameterisedCall,
    Site,
    key_name,
    placed,
    replace_leaves,
)

from ..linen import porting as flax
from .internals import iter_modules


def _leaf_path(key_path: tuple) -> tuple[str, ...]:
    """A state leaf's path without the Variable's own `value` attribute."""
    names = tuple(key_name(key) for key in key_path)
    return names[:-1] if names and names[-1] == "value" else names


def _by_module(state: Any) -> dict[str, dict[str, Any]]:
    """`{module path: {variable name: array}}` of a split state."""
    grouped: dict[str, dict[str, Any]] = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        path = _leaf_path(key_path)
        grouped.setdefault("/".join(path[:-1]), {})[path[-1]] = leaf
    return grouped


def layers(probe: Any, sites: list[Site]) -> list[Layer]:
    """Each call of a module holding `nnx.Param` variables itself, in call order."""
    params, rest = _by_module(probe.params), _by_module(probe.rest)
    # The root module is no site, but may own parameters (a bare nnx.Linear).
    root = nnx.merge(probe.graphdef, probe.params, probe.rest, copy=True)
    return KINDS.layers(
        ParameterisedCall(
            site,
            site.module,
            params.get(site.path, {}),
            ("params", *_parts(site.path)),
            rest.get(site.path, {}),
            ("rest", *_parts(site.path)),
        )
        for site in [Site("", "", None, 0, root, None), *sites]
        if site.module is not None
    )


def _parts(path: str) -> tuple[str, ...]:
    return tuple(path.split("/")) if path else ()


def _linear_general(call: ParameterisedCall):
    module = call.module
    return flax.dense(call, len(module.in_features), len(module.out_features))


KINDS = LayerKinds(
    {
        nnx.Linear: flax.dense,
        nnx.LinearGeneral: _linear_general,
        nnx.Conv: flax.conv,
        nnx.LayerNorm: flax.layer_norm,
        nnx.RMSNorm: flax.rms_norm,
        nnx.GroupNorm: flax.group_norm,
        nnx.BatchNorm: flax.batch_norm,
        nnx.Embed: flax.embed,
    },
    named="nnx.",
    home="flax.nnx",
    kept_without_weights=(nnx.BatchNorm,),
)


def with_weights(probe: Any, updates: list[tuple[Layer, dict]]) -> Any:
    """A new probe with the given canonical weights, in new state objects."""
    replacements: dict[str, dict] = {"params": {}, "rest": {}}
    for _, (collection, *path), value in placed(updates):
        replacements[collection][tuple(path)] = value
    params = replace_leaves(probe.params, replacements["params"], _leaf_path)
    rest = replace_leaves(probe.rest, replacements["rest"], _leaf_path)
    new = type(probe)(
        probe.graphdef, params, rest, probe.vmap, probe.equinox_attributes
    )
    return new._looking_inside(probe._inside)


# -- for compare ----------------------------------------------------------------


def in_float64(probe: Any) -> Any:
    """A probe of a float64 copy of the module: its floating variables in
    float64, and each submodule's `dtype` and `param_dtype` that name a
    floating dtype set to float64 (on the copy); the probe given is
    unchanged."""
    params, rest = flax.as_float64((probe.params, probe.rest))
    module = nnx.merge(probe.graphdef, params, rest, copy=True)
    for _, submodule in iter_modules(module):
        for name in ("dtype", "param_dtype"):
            if flax.is_floating_dtype(getattr(submodule, name, None)):
                setattr(submodule, name, jnp.float64)
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    new = type(probe)(graphdef, params, rest, probe.vmap, probe.equinox_attributes)
    return new._looking_inside(probe._inside)
