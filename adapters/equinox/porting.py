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
    Layer,
    Site,
    as_float,
    conv_hyperparameters,
    flattened,
    key_name,
    norm_hyperparameters,
    replace_leaves,
)

from .probe import _clone, _is_function
from .transforms import Mapped

#: The step count written with a moved `mode="batch"` statistic (see above).
SETTLED_COUNTER = 2**30


def _modules(model: Any) -> dict[str, Any]:
    """`{path: module}` of every submodule, named as the adapter names sites."""
    found: dict[str, Any] = {}

    def walk(module: Any, prefix: tuple[str, ...]) -> None:
        def is_child(x: Any) -> bool:
            return x is not module and (isinstance(x, eqx.Module) or _is_function(x))

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


def layers(probe: Any, sites: list[Site]) -> list[Layer]:
    """Each call of a module with array fields of its own, in call order."""
    modules = _modules(probe.model)
    # The root module is no site, but may own parameters (a bare Linear).
    modules[""] = probe.model
    sites = [Site("", "", None, 0, probe.model, None), *sites]
    found = []
    spatial = 0  # of the latest convolution: the layout of a norm after it
    for site in sites:
        module = modules.get(site.path)
        if module is None:
            continue
        own = _own_arrays(module)
        if not own and not isinstance(module, eqx.nn.BatchNorm):
            continue
        if isinstance(module, eqx.nn.Conv):
            spatial = module.num_spatial_dims
        layer = _layer(probe, site, module, own, spatial)
        if isinstance(site.origin, Mapped):
            outer = site.stacked + int(bool(probe.vmap))
            layer = dataclasses.replace(
                layer, to_common=_around_the_layer(site.origin, outer, spatial, layer)
            )
        found.append(
            dataclasses.replace(layer, hyperparameters=_hyperparameters(module))
        )
    return found


def _around_the_layer(origin: Mapped, outer: int, spatial: int, layer: Layer):
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


def _hyperparameters(module: Any) -> dict[str, Any]:
    """What `transfer` does not move, in canonical names and conventions
    (`bridge._hyperparameters`); `momentum` is Equinox's own, the weight of the
    running average kept."""
    if isinstance(module, eqx.nn.Linear):
        return {"use_bias": bool(module.use_bias)}
    if isinstance(module, eqx.nn.Conv) and not isinstance(module, eqx.nn.ConvTranspose):
        return conv_hyperparameters(
            window=module.kernel_size,
            strides=module.stride,
            padding=module.padding,
            padding_mode=module.padding_mode,
            dilation=module.dilation,
            groups=module.groups,
            use_bias=module.use_bias,
        )
    if isinstance(module, eqx.nn.LayerNorm | eqx.nn.RMSNorm):
        return norm_hyperparameters(module.eps, module.use_weight, module.use_bias)
    if isinstance(module, eqx.nn.GroupNorm):
        affine = module.channelwise_affine
        return norm_hyperparameters(
            module.eps, affine, affine, num_groups=module.groups
        )
    if isinstance(module, eqx.nn.BatchNorm):
        affine = module.channelwise_affine
        return norm_hyperparameters(
            module.eps, affine, affine, momentum=as_float(module.momentum)
        )
    return {}


def _channel_last(spatial: int):
    """Activation layout: the channel axis, before `spatial` axes, moved last."""
    if spatial == 0:
        return lambda value: value
    return lambda value: jnp.moveaxis(value, -(spatial + 1), -1)


def _first(value: Any) -> list:
    """A stateful layer returns `(output, state)`: compare the output."""
    return jax.tree.leaves(value[0] if isinstance(value, tuple) else value)


def _layer(probe: Any, site: Site, module: Any, own: dict, spatial: int) -> Layer:
    described = f"eqx.nn.{type(module).__name__}"
    lead = site.stacked  # iteration axes of a scan over stacked layers
    at = tuple(site.path.split("/")) if site.path else ()

    def location(name, convert=lambda value: value):
        return (("model", *at, name), convert)

    if isinstance(module, eqx.nn.Linear):
        weight, bias = own["weight"], own.get("bias")
        return Layer(
            site.name,
            site.path,
            "dense",
            described,
            {"kernel": jnp.swapaxes(weight, -1, -2), "bias": bias},
            locations={
                "kernel": location("weight", lambda k: jnp.swapaxes(k, -1, -2)),
                "bias": location("bias"),
            },
        )
    if isinstance(module, eqx.nn.Conv) and not isinstance(module, eqx.nn.ConvTranspose):
        n = module.num_spatial_dims
        stack = tuple(range(lead))
        window = tuple(range(lead + 2, lead + n + 2))
        to_hwio = (*stack, *window, lead + 1, lead)
        to_oihw = (*stack, lead + n + 1, lead + n, *range(lead, lead + n))
        return Layer(
            site.name,
            site.path,
            "conv",
            described,
            {
                "kernel": jnp.transpose(own["weight"], to_hwio),
                "bias": flattened(own.get("bias"), lead),
            },
            to_common=_channel_last(n),
            locations={
                "kernel": location("weight", lambda k: jnp.transpose(k, to_oihw)),
                "bias": location("bias"),
            },
        )
    if isinstance(module, eqx.nn.LayerNorm | eqx.nn.RMSNorm):
        kind = "layernorm" if isinstance(module, eqx.nn.LayerNorm) else "rmsnorm"
        weights = {"scale": flattened(own.get("weight"), lead)}
        locations = {"scale": location("weight")}
        if kind == "layernorm" or own.get("bias") is not None:
            weights["bias"] = flattened(own.get("bias"), lead)
            locations["bias"] = location("bias")
        return Layer(
            site.name, site.path, kind, described, weights, locations=locations
        )
    if isinstance(module, eqx.nn.GroupNorm):
        weights = {
            "scale": flattened(own.get("weight"), lead),
            "bias": flattened(own.get("bias"), lead),
        }
        locations = {"scale": location("weight"), "bias": location("bias")}
        # Channel-first like the convolutions; at most the value's own axes.
        outer = lead + int(bool(probe.vmap))
        return Layer(
            site.name,
            site.path,
            "groupnorm",
            described,
            weights,
            to_common=lambda value: _channel_last(
                min(spatial, max(jnp.ndim(value) - outer - 1, 0))
            )(value),
            locations=locations,
        )
    if isinstance(module, eqx.nn.BatchNorm):
        mean, var = _running_statistics(probe.state, module)
        weights = {
            "scale": flattened(own.get("weight"), lead),
            "bias": flattened(own.get("bias"), lead),
            "mean": mean,
            "var": var,
        }
        locations = {
            "scale": location("weight"),
            "bias": location("bias"),
            "mean": (("state", site.path, "mean"), None),
            "var": (("state", site.path, "var"), None),
        }
        return Layer(
            site.name,
            site.path,
            "batchnorm",
            described,
            weights,
            to_common=_channel_last(spatial),
            select=_first,
            locations=(locations, module),
        )
    if isinstance(module, eqx.nn.Embedding):
        return Layer(
            site.name,
            site.path,
            "embed",
            described,
            {"embedding": own["weight"]},
            locations={"embedding": location("weight")},
        )
    cls = type(module)
    return Layer(
        site.name,
        site.path,
        f"module:{cls.__module__}.{cls.__qualname__}",
        described,
        dict(own),
        select=_first if isinstance(module, eqx.nn.StatefulLayer) else _all,
        locations={name: location(name) for name in own},
    )


def _all(value: Any) -> list:
    return jax.tree.leaves(value)


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
    replacements = {}
    state = _clone(probe.state) if probe.state is not None else None
    for layer, weights in updates:
        locations = layer.locations
        if isinstance(locations, tuple):  # a BatchNorm: (locations, module)
            locations, module = locations
            state = _set_statistics(state, module, weights, layer)
        for name, (path, convert) in locations.items():
            if path[0] == "model" and weights.get(name) is not None:
                replacements[path[1:]] = convert(weights[name])
    model = replace_leaves(
        probe.model,
        replacements,
        lambda key_path: tuple(key_name(key) for key in key_path),
    )
    return type(probe)(model, state, probe.vmap)


def _set_statistics(state: Any, module: Any, weights: dict, layer: Layer) -> Any:
    mean, var = weights.get("mean"), weights.get("var")
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
