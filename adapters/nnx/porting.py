"""Flax NNX's side of `bridge.transfer` and `bridge.compare`.

A parameterised module is one holding `nnx.Param` variables itself; its
weights are read from the probe's split state by attribute path (BatchNorm's
running statistics are `nnx.BatchStat` variables of the rest of the state).
NNX is channel-last with `(in, out)` kernels, the canonical layout already;
`LinearGeneral` kernels with head axes (attention projections) are flattened
row-major. The new probe holds new state: the user's module is untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from bridge.adapter_api import (
    Layer,
    Site,
    dense_kernel,
    flatten_trailing,
    flattened,
    key_name,
    replace_leaves,
)

from ..linen.porting import hyperparameters


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
    found = []
    # The root module is no site, but may own parameters (a bare nnx.Linear).
    root = nnx.merge(probe.graphdef, probe.params, probe.rest, copy=True)
    for site in [Site("", "", None, 0, root, None), *sites]:
        if site.module is None:
            continue
        own = params.get(site.path)
        if not own and not isinstance(site.module, nnx.BatchNorm):
            continue
        layer = _layer(site, own or {}, rest.get(site.path, {}))
        found.append(
            dataclasses.replace(layer, hyperparameters=hyperparameters(layer, site))
        )
    return found


_NORM_KINDS = {
    nnx.LayerNorm: "layernorm",
    nnx.RMSNorm: "rmsnorm",
    nnx.GroupNorm: "groupnorm",
}


def _layer(site: Site, own: dict, rest: dict) -> Layer:
    module = site.module
    lead = site.stacked  # iteration axes of an nnx.scan around the module
    described = f"nnx.{type(module).__name__}"
    at = ("params", *site.path.split("/")) if site.path else ("params",)
    rest_at = ("rest", *at[1:])

    def identity(names: dict) -> dict:
        return {name: (path, lambda value: value) for name, path in names.items()}

    if isinstance(module, nnx.Linear | nnx.LinearGeneral) and "kernel" in own:
        general = isinstance(module, nnx.LinearGeneral)
        inputs = len(module.in_features) if general else 1
        outputs = len(module.out_features) if general else 1
        weights = {
            "kernel": dense_kernel(own["kernel"], inputs, lead),
            "bias": flattened(own.get("bias"), lead),
        }
        return Layer(
            site.name,
            site.path,
            "dense",
            described,
            weights,
            to_common=flatten_trailing(outputs),
            locations=identity({"kernel": (*at, "kernel"), "bias": (*at, "bias")}),
        )
    if isinstance(module, nnx.Conv):
        return Layer(
            site.name,
            site.path,
            "conv",
            described,
            {"kernel": own["kernel"], "bias": own.get("bias")},
            locations=identity({"kernel": (*at, "kernel"), "bias": (*at, "bias")}),
        )
    if isinstance(module, nnx.LayerNorm | nnx.RMSNorm | nnx.GroupNorm):
        kind = next(k for cls, k in _NORM_KINDS.items() if isinstance(module, cls))
        names = ("scale",) if kind == "rmsnorm" else ("scale", "bias")
        return Layer(
            site.name,
            site.path,
            kind,
            described,
            {name: flattened(own.get(name), lead) for name in names},
            locations=identity({name: (*at, name) for name in names}),
        )
    if isinstance(module, nnx.BatchNorm):
        weights = {
            "scale": flattened(own.get("scale"), lead),
            "bias": flattened(own.get("bias"), lead),
            "mean": flattened(rest.get("mean"), lead),
            "var": flattened(rest.get("var"), lead),
        }
        locations = {
            "scale": (*at, "scale"),
            "bias": (*at, "bias"),
            "mean": (*rest_at, "mean"),
            "var": (*rest_at, "var"),
        }
        return Layer(
            site.name,
            site.path,
            "batchnorm",
            described,
            weights,
            locations=identity(locations),
        )
    if isinstance(module, nnx.Embed):
        return Layer(
            site.name,
            site.path,
            "embed",
            described,
            {"embedding": own["embedding"]},
            locations=identity({"embedding": (*at, "embedding")}),
        )
    cls = type(module)  # a reporting subclass keeps the module and name
    return Layer(
        site.name,
        site.path,
        f"module:{cls.__module__}.{cls.__qualname__}",
        described,
        dict(own),
        locations=identity({name: (*at, name) for name in own}),
    )


def with_weights(probe: Any, updates: list[tuple[Layer, dict]]) -> Any:
    """A new probe with the given canonical weights, in new state objects."""
    replacements: dict[str, dict] = {"params": {}, "rest": {}}
    for layer, weights in updates:
        for name, (path, convert) in layer.locations.items():
            if weights.get(name) is not None:
                replacements[path[0]][path[1:]] = convert(weights[name])
    params = replace_leaves(probe.params, replacements["params"], _leaf_path)
    rest = replace_leaves(probe.rest, replacements["rest"], _leaf_path)
    return type(probe)(probe.graphdef, params, rest, probe.vmap)
