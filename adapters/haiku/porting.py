"""dm-haiku's side of `bridge.transfer` and `bridge.compare`.

A parameterised module is one whose name keys an entry of `params` (Haiku
keys parameters by module name); `hk.BatchNorm` counts even without scale
and offset, for its moving averages. Haiku is channel-last with `(in, out)`
kernels, the canonical layout already; `hk.MultiHeadAttention` projects with
plain `hk.Linear`s, flat kernels. An `hk.GroupNorm` with
`data_format="channels_first"` keeps `(C, 1, ..., 1)` parameters (flattened
here) and channel-first activations, brought channel-last to compare.

`hk.BatchNorm` keeps its running statistics in the state of two
`ExponentialMovingAverage` submodules (`<name>/~/mean_ema`,
`<name>/~/var_ema`), each with `average`, `hidden` and `counter`. Inference
reads `average`. Training updates `hidden <- decay * hidden + (1 - decay) *
value` and, zero-debiased, `average = hidden / (1 - decay ** counter)`. A
statistic moved in sets `average` and `hidden` to it and `counter` to
`2**30`, where the debiasing factor is 1: the statistic is used as given, and
further training continues it as the plain moving average the other libraries
keep.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import haiku as hk
import jax.numpy as jnp

from bridge.adapter_api import (
    Layer,
    Site,
    as_float,
    conv_hyperparameters,
    flattened,
    key_name,
    norm_hyperparameters,
    replace_leaves,
)

#: The EMA step count written with a moved statistic: `decay ** counter`
#: underflows to 0 for any decay below 1, and the int32 counter has room to go on.
SETTLED_COUNTER = 2**30


def layers(probe: Any, sites: list[Site]) -> list[Layer]:
    """Each call of a module that owns `params` (or is an `hk.BatchNorm`)."""
    found = []
    for site in sites:
        module = site.module
        if module is None:
            continue
        own = dict(probe.params.get(site.path, {}))
        if not own and not isinstance(module, hk.BatchNorm):
            continue
        layer = _layer(probe, site, own)
        found.append(
            dataclasses.replace(layer, hyperparameters=_hyperparameters(module))
        )
    return found


def _hyperparameters(module: Any) -> dict[str, Any]:
    """What `transfer` does not move, in canonical names and conventions
    (`bridge._hyperparameters`): `hk.BatchNorm`'s `decay_rate` is the `momentum`, the
    weight of the running average kept."""
    if isinstance(module, hk.Linear):
        return {"use_bias": bool(module.with_bias)}
    if isinstance(module, hk.ConvND):
        return conv_hyperparameters(
            window=module.kernel_shape,
            strides=module.stride,
            padding=module.padding,
            dilation=module.kernel_dilation,
            groups=module.feature_group_count,
            use_bias=module.with_bias,
        )
    if isinstance(module, hk.LayerNorm | hk.GroupNorm):
        extra = (
            {"num_groups": module.groups} if isinstance(module, hk.GroupNorm) else {}
        )
        return norm_hyperparameters(
            module.eps, module.create_scale, module.create_offset, **extra
        )
    if isinstance(module, hk.RMSNorm):
        return norm_hyperparameters(module.eps, module.create_scale)
    if isinstance(module, hk.BatchNorm):
        return norm_hyperparameters(
            module.eps,
            module.create_scale,
            module.create_offset,
            momentum=as_float(module.mean_ema.decay),
        )
    return {}


def _identity(names: dict) -> dict:
    return {name: (path, lambda value: value) for name, path in names.items()}


def _layer(probe: Any, site: Site, own: dict) -> Layer:
    module, path = site.module, site.path
    described = f"hk.{type(module).__name__}"
    lead = site.stacked
    at = ("params", path)
    if isinstance(module, hk.Linear):
        weights = {"kernel": own["w"], "bias": own.get("b")}
        locations = {"kernel": (*at, "w"), "bias": (*at, "b")}
        kind = "dense"
    elif isinstance(module, hk.ConvND):
        weights = {"kernel": own["w"], "bias": flattened(own.get("b"), lead)}
        locations = {"kernel": (*at, "w"), "bias": (*at, "b")}
        kind = "conv"
    elif isinstance(module, hk.LayerNorm):
        weights = {
            "scale": flattened(own.get("scale"), lead),
            "bias": flattened(own.get("offset"), lead),
        }
        locations = {"scale": (*at, "scale"), "bias": (*at, "offset")}
        kind = "layernorm"
    elif isinstance(module, hk.RMSNorm):
        weights = {"scale": flattened(own.get("scale"), lead)}
        locations = {"scale": (*at, "scale")}
        kind = "rmsnorm"
    elif isinstance(module, hk.GroupNorm):
        weights = {
            "scale": flattened(own.get("scale"), lead),
            "bias": flattened(own.get("offset"), lead),
        }
        locations = _identity({"scale": (*at, "scale"), "bias": (*at, "offset")})
        return Layer(
            site.name,
            path,
            "groupnorm",
            described,
            weights,
            to_common=_channel_layout(probe, site, module),
            locations=locations,
        )
    elif isinstance(module, hk.BatchNorm):
        state = probe.state or {}
        mean = state.get(f"{path}/~/mean_ema", {}).get("average")
        var = state.get(f"{path}/~/var_ema", {}).get("average")
        weights = {
            "scale": flattened(own.get("scale"), lead),
            "bias": flattened(own.get("offset"), lead),
            "mean": flattened(mean, lead),
            "var": flattened(var, lead),
        }
        locations = _identity({"scale": (*at, "scale"), "bias": (*at, "offset")})
        for name, ema in (("mean", "mean_ema"), ("var", "var_ema")):
            locations[name] = (("state", f"{path}/~/{ema}"), _ema_entries)
        return Layer(
            site.name,
            path,
            "batchnorm",
            described,
            weights,
            to_common=_channel_layout(probe, site, module),
            locations=locations,
        )
    elif isinstance(module, hk.Embed):
        weights = {"embedding": own["embeddings"]}
        locations = {"embedding": (*at, "embeddings")}
        kind = "embed"
    else:
        cls = type(module)
        weights = own
        locations = {name: (*at, name) for name in own}
        kind = f"module:{cls.__module__}.{cls.__qualname__}"
    return Layer(
        site.name,
        path,
        kind,
        described,
        weights,
        to_common=_channel_layout(probe, site, module),
        locations=_identity(locations),
    )


def _channel_layout(probe: Any, site: Site, module: Any):
    """Activation layout of a module with a `data_format` (`hk.ConvND`,
    `hk.BatchNorm`, `hk.GroupNorm`): channels first (`NCHW`,
    `"channels_first"`) has its channel axis (1, after the scan and vmap axes)
    moved last."""
    if getattr(module, "channel_index", -1) == -1:
        return lambda value: value
    channel = site.stacked + int(bool(probe.vmap)) + 1
    return lambda value: (
        jnp.moveaxis(value, channel, -1) if jnp.ndim(value) > channel + 1 else value
    )


def _ema_entries(statistic: Any) -> dict[str, Any]:
    return {
        "average": statistic,
        "hidden": statistic,
        "counter": jnp.asarray(SETTLED_COUNTER, jnp.int32),
    }


def with_weights(probe: Any, updates: list[tuple[Layer, dict]]) -> Any:
    """A new probe of the same transformed function with the given weights."""
    replacements: dict[str, dict] = {"params": {}, "state": {}}
    for layer, weights in updates:
        for name, (path, convert) in layer.locations.items():
            if weights.get(name) is None:
                continue
            converted = convert(weights[name])
            if isinstance(converted, Mapping):  # an EMA's entries
                for entry, value in converted.items():
                    replacements[path[0]][(*path[1:], entry)] = value
            else:
                replacements[path[0]][path[1:]] = converted

    def named(key_path):
        return tuple(key_name(key) for key in key_path)

    params = replace_leaves(probe.params, replacements["params"], named)
    state = probe.state
    if replacements["state"]:
        state = replace_leaves(state, replacements["state"], named)
    return type(probe)(probe.transformed, params, state, probe.takes_rng, probe.vmap)
