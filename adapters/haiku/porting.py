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

from collections.abc import Mapping
from typing import Any

import haiku as hk
import jax.numpy as jnp

from bridge.adapter_api import (
    Converted,
    Layer,
    LayerKinds,
    ParameterisedCall,
    Site,
    Weight,
    as_float,
    conv_hyperparameters,
    flattened,
    key_name,
    norm_hyperparameters,
    placed,
    replace_leaves,
)

#: The EMA step count written with a moved statistic: `decay ** counter`
#: underflows to 0 for any decay below 1, and the int32 counter has room to go on.
SETTLED_COUNTER = 2**30


def layers(probe: Any, sites: list[Site]) -> list[Layer]:
    """Each call of a module that owns `params` (or is an `hk.BatchNorm`)."""
    return KINDS.layers(
        ParameterisedCall(
            site,
            site.module,
            dict(probe.params.get(site.path, {})),
            ("params", site.path),
            probe=probe,
        )
        for site in sites
        if site.module is not None
    )


# -- the converters: hyperparameters in canonical names and conventions
# (`bridge._porting.hyperparameters`); `hk.BatchNorm`'s `decay_rate` is the `momentum`,
# the weight of the running average kept.


def _linear(call: ParameterisedCall) -> Converted:
    weights = {"kernel": call.weight("w"), "bias": call.weight("b")}
    return Converted("dense", weights, {"use_bias": bool(call.module.with_bias)})


def _conv(call: ParameterisedCall) -> Converted:
    module = call.module
    hyperparameters = conv_hyperparameters(
        window=module.kernel_shape,
        strides=module.stride,
        padding=module.padding,
        dilation=module.kernel_dilation,
        groups=module.feature_group_count,
        use_bias=module.with_bias,
    )
    weights = {"kernel": call.weight("w"), "bias": call.flat("b")}
    return Converted("conv", weights, hyperparameters)


def _affine(call: ParameterisedCall, kind: str, **more) -> Converted:
    """A norm with a `scale` and an `offset` (the canonical `bias`); a
    BatchNorm's running statistics too."""
    module = call.module
    weights = {"scale": call.flat("scale"), "bias": call.flat("offset")}
    if kind == "batchnorm":
        weights |= {
            "mean": _running(call, "mean_ema"),
            "var": _running(call, "var_ema"),
        }
    hyperparameters = norm_hyperparameters(
        module.eps, module.create_scale, module.create_offset, **more
    )
    return Converted(kind, weights, hyperparameters)


def _running(call: ParameterisedCall, ema: str) -> Weight:
    """A running statistic: the average of an EMA submodule's state."""
    where = ("state", f"{call.site.path}/~/{ema}")
    state = call.probe.state or {}
    average = state.get(where[1], {}).get("average")
    return Weight(flattened(average, call.site.stacked), where, _ema_entries)


def _layer_norm(call: ParameterisedCall) -> Converted:
    return _affine(call, "layernorm")


def _group_norm(call: ParameterisedCall) -> Converted:
    return _affine(call, "groupnorm", num_groups=call.module.groups)


def _batch_norm(call: ParameterisedCall) -> Converted:
    momentum = as_float(call.module.mean_ema.decay)
    return _affine(call, "batchnorm", momentum=momentum)


def _rms_norm(call: ParameterisedCall) -> Converted:
    module = call.module
    hyperparameters = norm_hyperparameters(module.eps, module.create_scale)
    return Converted("rmsnorm", {"scale": call.flat("scale")}, hyperparameters)


def _embed(call: ParameterisedCall) -> Converted:
    return Converted("embed", {"embedding": call.weight("embeddings")})


def _channel_layout(call: ParameterisedCall):
    """Activation layout of a module with a `data_format` (`hk.ConvND`,
    `hk.BatchNorm`, `hk.GroupNorm`): channels first (`NCHW`,
    `"channels_first"`) has its channel axis (1, after the scan and vmap axes)
    moved last."""
    if getattr(call.module, "channel_index", -1) == -1:
        return lambda value: value
    channel = call.site.stacked + int(bool(call.probe.vmap)) + 1
    return lambda value: (
        jnp.moveaxis(value, channel, -1) if jnp.ndim(value) > channel + 1 else value
    )


KINDS = LayerKinds(
    {
        hk.Linear: _linear,
        hk.ConvND: _conv,
        hk.LayerNorm: _layer_norm,
        hk.RMSNorm: _rms_norm,
        hk.GroupNorm: _group_norm,
        hk.BatchNorm: _batch_norm,
        hk.Embed: _embed,
    },
    named="hk.",
    home="haiku.",
    to_common=_channel_layout,
    kept_without_weights=(hk.BatchNorm,),
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
    for _, (collection, *path), value in placed(updates):
        if isinstance(value, Mapping):  # an EMA's entries
            for entry, entry_value in value.items():
                replacements[collection][(*path, entry)] = entry_value
        else:
            replacements[collection][tuple(path)] = value

    def named(key_path):
        return tuple(key_name(key) for key in key_path)

    params = replace_leaves(probe.params, replacements["params"], named)
    state = probe.state
    if replacements["state"]:
        state = replace_leaves(state, replacements["state"], named)
    new = type(probe)(probe.transformed, params, state, probe.takes_rng, probe.vmap)
    return new._looking_inside(probe._inside)
