"""Flax Linen's side of `bridge.transfer` and `bridge.compare`.

A parameterised module is one whose scope holds arrays in `params` itself;
its weights are read from `variables` by its scope path (BatchNorm's running
statistics from `batch_stats`). Linen is channel-last with `(in, out)`
kernels, the canonical layout already; `DenseGeneral` kernels with head axes
(attention projections) are flattened row-major.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn

from bridge.adapter_api import (
    Layer,
    Site,
    as_float,
    conv_hyperparameters,
    conv_padding_mode,
    dense_kernel,
    flatten_trailing,
    flattened,
    key_name,
    norm_hyperparameters,
    replace_leaves,
)


def _count(axes: Any) -> int:
    return len(axes) if isinstance(axes, tuple | list) else 1


def _node(tree: Mapping, path: tuple[str, ...]) -> Mapping | None:
    for part in path:
        if not isinstance(tree, Mapping) or part not in tree:
            return None
        tree = tree[part]
    return tree if isinstance(tree, Mapping) else None


def layers(probe: Any, sites: list[Site]) -> list[Layer]:
    """Each call of a module owning `params` arrays itself, in call order."""
    variables = probe.variables
    found = []
    # The root module is no site, but may own parameters (a bare nn.Dense).
    root = Site("", "", None, 0, probe.module, None, _Root())
    for site in [root, *sites]:
        if site.module is None or site.origin is None:
            continue
        scope = tuple(site.origin.scope)
        params = _node(variables.get("params", {}), scope) or {}
        own = {k: v for k, v in params.items() if not isinstance(v, Mapping)}
        if not own:
            continue
        layer = _layer(site, scope, own, variables)
        found.append(
            dataclasses.replace(layer, hyperparameters=hyperparameters(layer, site))
        )
    return found


def hyperparameters(layer: Layer, site: Site) -> dict[str, Any]:
    """What `transfer` does not move, in canonical names and conventions
    (`bridge._hyperparameters`): read from the module object."""
    module = site.module
    if layer.kind == "dense":
        return {"use_bias": bool(module.use_bias)}
    if layer.kind == "conv":
        window = module.kernel_size
        window = (window,) if isinstance(window, int) else tuple(window)
        return conv_hyperparameters(
            window=window,
            strides=module.strides,
            padding=module.padding,
            padding_mode=conv_padding_mode(module.padding),
            dilation=module.kernel_dilation,
            groups=module.feature_group_count,
            use_bias=module.use_bias,
        )
    if layer.kind in ("layernorm", "rmsnorm"):
        return norm_hyperparameters(
            module.epsilon,
            module.use_scale,
            getattr(module, "use_bias", None),
        )
    if layer.kind == "groupnorm":
        groups = module.num_groups
        if groups is None:  # given as group_size: the channels over it
            channels = site.struct.shape[-1] if hasattr(site.struct, "shape") else None
            groups = channels // module.group_size if channels else None
        return norm_hyperparameters(
            module.epsilon, module.use_scale, module.use_bias, num_groups=groups
        )
    if layer.kind == "batchnorm":
        return norm_hyperparameters(
            module.epsilon,
            module.use_scale,
            module.use_bias,
            momentum=as_float(module.momentum),
        )
    return {}


class _Root:
    scope = ()


_NORM_KINDS = {
    nn.LayerNorm: "layernorm",
    nn.RMSNorm: "rmsnorm",
    nn.GroupNorm: "groupnorm",
}


def _layer(site: Site, scope: tuple, own: dict, variables: Mapping) -> Layer:
    module = site.module
    lead = site.stacked  # iteration axes of an nn.scan around the module
    described = f"nn.{type(module).__name__}"
    at = ("params", *scope)
    if isinstance(module, nn.DenseGeneral | nn.Dense) and "kernel" in own:
        inputs = _count(module.axis) if isinstance(module, nn.DenseGeneral) else 1
        outputs = _count(module.features) if isinstance(module, nn.DenseGeneral) else 1
        weights = {
            "kernel": dense_kernel(own["kernel"], inputs, lead),
            "bias": flattened(own.get("bias"), lead),
        }
        locations = {"kernel": (*at, "kernel"), "bias": (*at, "bias")}
        return Layer(
            site.name,
            site.path,
            "dense",
            described,
            weights,
            to_common=flatten_trailing(outputs),
            locations=_identity(locations),
        )
    if isinstance(module, nn.Conv) and not isinstance(module, nn.ConvLocal):
        weights = {"kernel": own["kernel"], "bias": own.get("bias")}
        locations = {"kernel": (*at, "kernel"), "bias": (*at, "bias")}
        return Layer(
            site.name, site.path, "conv", described, weights,
            locations=_identity(locations),
        )  # fmt: skip
    if isinstance(module, nn.LayerNorm | nn.RMSNorm | nn.GroupNorm):
        kind = next(k for cls, k in _NORM_KINDS.items() if isinstance(module, cls))
        names = ("scale",) if kind == "rmsnorm" else ("scale", "bias")
        weights = {name: flattened(own.get(name), lead) for name in names}
        locations = {name: (*at, name) for name in names}
        return Layer(
            site.name, site.path, kind, described, weights,
            locations=_identity(locations),
        )  # fmt: skip
    if isinstance(module, nn.BatchNorm):
        stats = _node(variables.get("batch_stats", {}), scope) or {}
        weights = {
            "scale": flattened(own.get("scale"), lead),
            "bias": flattened(own.get("bias"), lead),
            "mean": flattened(stats.get("mean"), lead),
            "var": flattened(stats.get("var"), lead),
        }
        stats_at = ("batch_stats", *scope)
        locations = {
            "scale": (*at, "scale"),
            "bias": (*at, "bias"),
            "mean": (*stats_at, "mean"),
            "var": (*stats_at, "var"),
        }
        return Layer(
            site.name, site.path, "batchnorm", described, weights,
            locations=_identity(locations),
        )  # fmt: skip
    if isinstance(module, nn.Embed):
        return Layer(
            site.name,
            site.path,
            "embed",
            described,
            {"embedding": own["embedding"]},
            locations=_identity({"embedding": (*at, "embedding")}),
        )
    kind = f"module:{type(module).__module__}.{type(module).__qualname__}"
    return Layer(
        site.name,
        site.path,
        kind,
        described,
        dict(own),
        locations=_identity({name: (*at, name) for name in own}),
    )


def _identity(locations: dict) -> dict:
    return {name: (path, lambda value: value) for name, path in locations.items()}


def with_weights(probe: Any, updates: list[tuple[Layer, dict]]) -> Any:
    """A new probe of the same module with the given canonical weights."""
    replacements = {}
    for layer, weights in updates:
        for name, (path, convert) in layer.locations.items():
            if weights.get(name) is not None:
                replacements[path] = convert(weights[name])
    variables = replace_leaves(
        dict(probe.variables),
        replacements,
        lambda key_path: tuple(key_name(key) for key in key_path),
    )
    return type(probe)(probe.module, variables, probe.vmap)
