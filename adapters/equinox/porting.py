"""Equinox's side of `bridge.transfer` and `bridge.compare`.

A parameterised module is one with array fields of its own; it is found in
the probe's model by its site path (the pytree path). Equinox differs from
the canonical layout: `eqx.nn.Linear.weight` is `(out, in)`; convolutions are
channel-first, weights `(out, in / groups, *window)` (OIHW) with a bias
`(out, 1, ..., 1)`, and so are their activations, `(C, H, W)` per example.
An `eqx.nn.GroupNorm` normalises channel-first values, `(C, *spatial)`; its
activations are brought channel-last like those of the latest convolution.
`eqx.nn.BatchNorm` keeps its running statistics in the `eqx.nn.State`:
`mode="ema"` as `(mean, var)` with a first-time flag, which a moved statistic
clears; `mode="batch"` zero-debiased like Haiku's, so a moved statistic gets
a step count of `2**30`, where the debiasing factor is 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from bridge.adapter_api import (
    BridgeValueError,
    Converted,
    Layer,
    LayerKinds,
    ParameterisedCall,
    Site,
    Weight,
    as_float,
    channel_first_kernel_axes,
    key_name,
    norm_hyperparameters,
    placed,
    replace_leaves,
    torch_named_conv_hyperparameters,
    weight_by_weight,
)

from .probe import clone_state
from .run import VmappedInput
from .surgery import is_function

#: The step count written with a moved `mode="batch"` statistic (see above).
SETTLED_COUNTER = 2**30


def _modules(model: Any) -> dict[str, Any]:
    """`{path: module}` of every submodule, named as the adapter names sites."""
    found: dict[str, Any] = {}

    def walk(module: Any, prefix: tuple[str, ...]) -> None:
        def is_child(x: Any) -> bool:
            return x is not module and (isinstance(x, eqx.Module) or is_function(x))

        children = jax.tree_util.tree_flatten_with_path(module, is_leaf=is_child)[0]
        for key_path, child in children:
            if isinstance(child, eqx.Module):
                path = (*prefix, *(key_name(key) for key in key_path))
                found.setdefault("/".join(path), child)
                walk(child, path)

    walk(model, ())
    return found


def _own_arrays(module: Any) -> dict[str, Any]:
    return {
        field.name: getattr(module, field.name)
        for field in dataclasses.fields(module)
        if eqx.is_array(getattr(module, field.name, None))
    }


@dataclasses.dataclass(frozen=True)
class _Call(ParameterisedCall):
    spatial: int = 0  # of the latest convolution: the layout of a norm after it


def _calls(probe: Any, sites: list[Site]):
    modules = _modules(probe.model)
    # The root module is no site, but may own parameters (a bare Linear).
    modules[""] = probe.model
    spatial = 0
    for site in [Site("", "", None, 0, probe.model, None), *sites]:
        module = modules.get(site.path)
        if module is None:
            continue
        own = _own_arrays(module)
        if own and isinstance(module, eqx.nn.Conv):
            spatial = module.num_spatial_dims
        at = ("model", *site.path.split("/")) if site.path else ("model",)
        yield _Call(site, module, own, at, probe=probe, spatial=spatial)


def layers(probe: Any, sites: list[Site]) -> list[Layer]:
    """Each call of a module with array fields of its own, in call order."""
    found = []
    for call in filter(KINDS.keeps, _calls(probe, sites)):
        layer = KINDS.layer(call)
        if isinstance(call.site.origin, VmappedInput):
            outer = call.site.stacked + int(bool(probe.vmap))
            to_common = _around_the_layer(call.site.origin, outer, call.spatial, layer)
            layer = dataclasses.replace(layer, to_common=to_common)
        found.append(layer)
    return found


def _around_the_layer(origin: VmappedInput, outer: int, spatial: int, layer: Layer):
    """The common layout of a site inside the model's own vmaps: its mapped
    axes, held first (after `outer` iteration and batch axes), go back where
    the vmaps took them from in the layer's input, and the value then converts
    as an unmapped one would. A norm mapped over the spatial axes of a
    channel-first image (a LayerNorm per pixel, `(W, H, C)` per example) comes
    back `(C, H, W)` and goes channel-last like the convolution before it.
    Where the layer changes its input's rank, the mapped axes stay first."""
    depth = len(origin.input_axes)
    behind_channels = any(axis not in (0, None) for axis in origin.input_axes)
    norm = layer.kind in ("layernorm", "rmsnorm")

    def convert(value: Any) -> Any:
        own = jnp.ndim(value) - outer - depth
        if None in origin.input_axes or own != origin.input_ndim:
            return layer.to_common(value)
        order = list(range(outer + depth, jnp.ndim(value)))
        for level, axis in enumerate(origin.input_axes):  # innermost first
            order.insert(axis, outer + depth - 1 - level)
        value = jnp.transpose(value, (*range(outer), *order))
        if norm and behind_channels and own + depth == spatial + 1:
            return _channel_last(spatial)(value)
        return layer.to_common(value)

    return convert


def _channel_last(spatial: int):
    """Activation layout: the channel axis, before `spatial` axes, moved last."""
    if spatial == 0:
        return lambda value: value
    return lambda value: jnp.moveaxis(value, -(spatial + 1), -1)


def _first(value: Any) -> list:
    """A stateful layer returns `(output, state)`: compare the output."""
    return jax.tree.leaves(value[0] if isinstance(value, tuple) else value)


# -- the converters: hyperparameters in canonical names and conventions
# (`bridge._porting.hyperparameters`); `momentum` is Equinox's own, the weight of the
# running average kept.


def _swapped(kernel: Any) -> Any:  # `(out, in)` and `(in, out)`, either way
    return jnp.swapaxes(kernel, -1, -2)


def _linear(call: _Call) -> Converted:
    weights = {
        "kernel": call.weight("weight", _swapped, _swapped),
        "bias": call.weight("bias"),
    }
    return Converted("dense", weights, {"use_bias": bool(call.module.use_bias)})


def _conv(call: _Call) -> Converted:
    module = call.module
    n = module.num_spatial_dims
    to_hwio, to_oihw = channel_first_kernel_axes(n, call.site.stacked)
    kernel = call.weight(
        "weight",
        lambda k: jnp.transpose(k, to_hwio),
        lambda k: jnp.transpose(k, to_oihw),
    )
    return Converted(
        "conv",
        {"kernel": kernel, "bias": call.flat("bias")},
        torch_named_conv_hyperparameters(module, module.use_bias),
        to_common=_channel_last(n),
    )


def _layer_norm(call: _Call, kind: str = "layernorm") -> Converted:
    module = call.module
    weights = {"scale": call.flat("weight")}
    if kind == "layernorm" or call.own.get("bias") is not None:
        weights["bias"] = call.flat("bias")
    hyperparameters = norm_hyperparameters(
        module.eps, module.use_weight, module.use_bias
    )
    return Converted(kind, weights, hyperparameters)


def _rms_norm(call: _Call) -> Converted:
    return _layer_norm(call, "rmsnorm")


def _group_norm(call: _Call) -> Converted:
    module = call.module
    affine = module.channelwise_affine
    # Channel-first like the convolutions; at most the value's own axes.
    outer = call.site.stacked + int(bool(call.probe.vmap))
    return Converted(
        "groupnorm",
        {"scale": call.flat("weight"), "bias": call.flat("bias")},
        norm_hyperparameters(module.eps, affine, affine, num_groups=module.groups),
        to_common=lambda value: _channel_last(
            min(call.spatial, max(jnp.ndim(value) - outer - 1, 0))
        )(value),
    )


def _batch_norm(call: _Call) -> Converted:
    """Scale and bias, and the running statistics of the `eqx.nn.State`."""
    module = call.module
    affine = module.channelwise_affine
    mean, var = _running_statistics(call.probe.state, module)
    weights = {
        "scale": call.flat("weight"),
        "bias": call.flat("bias"),
        "mean": Weight(mean, ("state", module, "mean")),
        "var": Weight(var, ("state", module, "var")),
    }
    return Converted(
        "batchnorm",
        weights,
        norm_hyperparameters(
            module.eps, affine, affine, momentum=as_float(module.momentum)
        ),
        to_common=_channel_last(call.spatial),
        select=_first,
    )


def _embedding(call: _Call) -> Converted:
    return Converted("embed", {"embedding": call.weight("weight")})


def _stateful(call: _Call) -> Converted:
    return dataclasses.replace(weight_by_weight(call), select=_first)


KINDS = LayerKinds(
    {
        eqx.nn.Linear: _linear,
        eqx.nn.Conv: _conv,
        eqx.nn.ConvTranspose: None,  # its kernel is (in, out, *window)
        eqx.nn.LayerNorm: _layer_norm,
        eqx.nn.RMSNorm: _rms_norm,
        eqx.nn.GroupNorm: _group_norm,
        eqx.nn.BatchNorm: _batch_norm,
        eqx.nn.Embedding: _embedding,
        eqx.nn.StatefulLayer: _stateful,
    },
    named="eqx.nn.",
    home="equinox.",
    kept_without_weights=(eqx.nn.BatchNorm,),
)


def _running_statistics(state: Any, module: Any) -> tuple[Any, Any]:
    if state is None:
        return None, None
    if module.mode == "ema":
        return state.get(module.ema_state_index)
    counter = state.get(module.batch_counter)
    hidden_mean, hidden_var = state.get(module.batch_state_index)
    scale = jnp.where(counter == 0, 1, 1 - module.momentum**counter)
    return hidden_mean / scale, hidden_var / scale


def with_weights(probe: Any, updates: list[tuple[Layer, dict]]) -> Any:
    """A new probe with the given canonical weights; model and state are copies."""
    replacements, running = {}, {}
    for layer, (store, *where), value in placed(updates):
        if store == "model":
            replacements[tuple(where)] = value
        else:  # a BatchNorm's statistic: both are set together
            module, name = where
            running.setdefault(id(module), (layer, module, {}))[2][name] = value
    state = clone_state(probe.state) if probe.state is not None else None
    for layer, module, statistics in running.values():
        state = _set_statistics(state, module, statistics, layer)
    model = replace_leaves(
        probe.model,
        replacements,
        lambda key_path: tuple(key_name(key) for key in key_path),
    )
    return type(probe)(model, state, probe.vmap)._looking_inside(probe._inside)


def _set_statistics(state: Any, module: Any, statistics: dict, layer: Layer) -> Any:
    mean, var = statistics.get("mean"), statistics.get("var")
    if mean is None or var is None:
        return state
    if state is None:
        raise BridgeValueError(
            f"Cannot move running statistics into site {layer.site!r} "
            f"({layer.described}): the destination probe has no eqx.nn.State. "
            "Build the model with eqx.nn.make_with_state and probe it with "
            "bridge.probe(model, state)."
        )

    def as_running(value: Any, like: Any) -> Any:
        return jnp.reshape(jnp.asarray(value, like.dtype), like.shape)

    if module.mode == "ema":
        old_mean, old_var = state.get(module.ema_state_index)
        state = state.set(
            module.ema_state_index,
            (as_running(mean, old_mean), as_running(var, old_var)),
        )
        return state.set(module.ema_first_time_index, jnp.array(False))
    old_mean, old_var = state.get(module.batch_state_index)
    state = state.set(
        module.batch_state_index,
        (as_running(mean, old_mean), as_running(var, old_var)),
    )
    counter = state.get(module.batch_counter)
    # `counter - counter` keeps the count's dtype and weak type, which
    # `State.set` checks.
    return state.set(module.batch_counter, counter - counter + SETTLED_COUNTER)
