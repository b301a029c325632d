"""Flax Linen's side of `bridge.transfer` and `bridge.compare`.

A parameterised module is one whose scope holds arrays in `params` itself;
its weights are read from `variables` by its scope path (BatchNorm's running
statistics from `batch_stats`). Linen is channel-last with `(in, out)`
kernels, the canonical layout already; `DenseGeneral` kernels with head axes
(attention projections) are flattened row-major. The converters serve Flax
NNX too: its modules hold the same weights and hyperparameters under the same
names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bridge.adapter_api import (
    Converted,
    Layer,
    LayerKinds,
    ParameterisedCall,
    Site,
    as_float,
    conv_hyperparameters,
    conv_padding_mode,
    dense_kernel,
    flatten_trailing,
    flattened,
    key_name,
    norm_hyperparameters,
    placed,
    replace_leaves,
    weight_rmsnorm,
)


def _count(axes: Any) -> int:
    return len(axes) if isinstance(axes, tuple | list) else 1


def _node(tree: Mapping, path: tuple[str, ...]) -> Mapping | None:
    for part in path:
        if not isinstance(tree, Mapping) or part not in tree:
            return None
        tree = tree[part]
    return tree if isinstance(tree, Mapping) else None


class _Root:
    scope = ()
    given = False


def layers(probe: Any, sites: list[Site]) -> list[Layer]:
    """Each call of a module owning `params` arrays itself, in call order."""
    # The root module is no site, but may own parameters (a bare nn.Dense).
    root = Site("", "", None, 0, probe.module, None, _Root())
    return KINDS.layers(_calls(probe.variables, [root, *sites]))


def _calls(variables: Mapping, sites: list[Site]):
    for site in sites:
        # A call inside an `apply` the model makes (a tied head) holds the
        # model's arguments, none of the probe's variables.
        if site.module is None or site.origin is None or site.origin.given:
            continue
        scope = tuple(site.origin.scope)
        params = _node(variables.get("params", {}), scope) or {}
        yield ParameterisedCall(
            site,
            site.module,
            {k: v for k, v in params.items() if not isinstance(v, Mapping)},
            ("params", *scope),
            _node(variables.get("batch_stats", {}), scope) or {},
            ("batch_stats", *scope),
        )


# -- the converters, Linen's and NNX's ------------------------------------------


def dense(call: ParameterisedCall, inputs: int = 1, outputs: int = 1):
    """A kernel with `inputs` input and `outputs` output axes, and a bias."""
    if "kernel" not in call.own:
        return None
    lead = call.site.stacked  # iteration axes of a scan around the module
    return Converted(
        "dense",
        {
            "kernel": call.weight("kernel", lambda k: dense_kernel(k, inputs, lead)),
            "bias": call.flat("bias"),
        },
        {"use_bias": bool(call.module.use_bias)},
        to_common=flatten_trailing(outputs),
    )


def _conv1d(call: ParameterisedCall):
    """transformers' `FlaxConv1D` (GPT-2): a Dense whose kernel is `(out, in)`."""
    if "kernel" not in call.own:
        return None
    kernel = call.weight("kernel", _transposed, _transposed)
    return Converted(
        "dense",
        {"kernel": kernel, "bias": call.flat("bias")},
        {"use_bias": bool(call.module.use_bias)},
    )


def _transposed(kernel: Any) -> Any:
    return jnp.swapaxes(kernel, -1, -2)


def _dense_general(call: ParameterisedCall):
    return dense(call, _count(call.module.axis), _count(call.module.features))


def conv(call: ParameterisedCall) -> Converted:
    module = call.module
    window = module.kernel_size
    window = (window,) if isinstance(window, int) else tuple(window)
    hyperparameters = conv_hyperparameters(
        window=window,
        strides=module.strides,
        padding=module.padding,
        padding_mode=conv_padding_mode(module.padding),
        dilation=module.kernel_dilation,
        groups=module.feature_group_count,
        use_bias=module.use_bias,
    )
    weights = {"kernel": call.weight("kernel"), "bias": call.weight("bias")}
    return Converted("conv", weights, hyperparameters)


def _norm(call: ParameterisedCall, kind: str, names=("scale", "bias"), **more):
    """Flattened weights of `names`, BatchNorm's running statistics too."""
    module = call.module
    weights = {name: call.flat(name) for name in names}
    if kind == "batchnorm":
        weights |= {name: call.flat(name, statistic=True) for name in ("mean", "var")}
    return Converted(
        kind,
        weights,
        norm_hyperparameters(
            module.epsilon, module.use_scale, getattr(module, "use_bias", None), **more
        ),
    )


def layer_norm(call: ParameterisedCall) -> Converted:
    return _norm(call, "layernorm")


def rms_norm(call: ParameterisedCall) -> Converted:
    return _norm(call, "rmsnorm", ("scale",))


def group_norm(call: ParameterisedCall) -> Converted:
    module, groups = call.module, call.module.num_groups
    if groups is None:  # given as group_size: the channels over it
        struct = call.site.struct
        channels = struct.shape[-1] if hasattr(struct, "shape") else None
        groups = channels // module.group_size if channels else None
    return _norm(call, "groupnorm", num_groups=groups)


def _hf_rms_norm(call: ParameterisedCall, offset: float = 0.0) -> Converted:
    """transformers' Flax RMSNorms: `weight` the scale (Gemma's scale is
    `1 + weight`), the config's `rms_norm_eps` (T5's `eps`) the epsilon."""
    module = call.module
    config = getattr(module, "config", None)
    epsilon = getattr(config, "rms_norm_eps", getattr(module, "eps", None))
    return weight_rmsnorm(
        call, epsilon, lambda weight: flattened(weight, call.site.stacked), offset
    )


def _hf_gemma_rms_norm(call: ParameterisedCall) -> Converted:
    return _hf_rms_norm(call, offset=1.0)


def batch_norm(call: ParameterisedCall) -> Converted:
    return _norm(call, "batchnorm", momentum=as_float(call.module.momentum))


def embed(call: ParameterisedCall) -> Converted:
    return Converted("embed", {"embedding": call.weight("embedding")})


KINDS = LayerKinds(
    {
        nn.Dense: dense,
        nn.DenseGeneral: _dense_general,
        nn.Conv: conv,
        nn.ConvLocal: None,  # a kernel per position: no convolution's layout
        nn.LayerNorm: layer_norm,
        nn.RMSNorm: rms_norm,
        nn.GroupNorm: group_norm,
        nn.BatchNorm: batch_norm,
        nn.Embed: embed,
        # By name: the adapter must not import transformers.
        "transformers.models.gpt2.modeling_flax_gpt2.FlaxConv1D": _conv1d,
        **{
            f"transformers.models.{family}.modeling_flax_{family}.{name}": converter
            for family, name, converter in [
                ("llama", "FlaxLlamaRMSNorm", _hf_rms_norm),
                ("mistral", "FlaxMistralRMSNorm", _hf_rms_norm),
                ("t5", "FlaxT5LayerNorm", _hf_rms_norm),
                ("gemma", "FlaxGemmaRMSNorm", _hf_gemma_rms_norm),
            ]
        },
    },
    named="nn.",
    home="flax.linen",
)


def with_weights(probe: Any, updates: list[tuple[Layer, dict]]) -> Any:
    """A new probe of the same module with the given canonical weights."""
    variables = replace_leaves(
        dict(probe.variables),
        {where: value for _, where, value in placed(updates)},
        lambda key_path: tuple(key_name(key) for key in key_path),
    )
    new = type(probe)(probe.module, variables, probe.vmap)
    return new._looking_inside(probe._inside)


# -- for compare ----------------------------------------------------------------


def as_float64(tree: Any) -> Any:
    """`tree` with its floating arrays in float64 (under x64: `compare`'s
    `dtype="float64"`); other leaves unchanged."""

    def cast(leaf: Any) -> Any:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            return leaf
        return jnp.asarray(leaf, jnp.float64)

    return jax.tree.map(cast, tree)


#: A module's attributes that set the dtype it computes or creates weights in.
_DTYPE_FIELDS = ("dtype", "param_dtype")


def is_floating_dtype(value: Any) -> bool:
    try:
        return value is not None and jnp.issubdtype(value, jnp.floating)
    except TypeError:
        return False


def module_in_float64(module: nn.Module) -> nn.Module:
    """A clone of `module` whose `dtype` and `param_dtype` fields that name a
    floating dtype are float64, those of the modules it holds as fields too
    (Hugging Face's Flax models pass their `dtype` down): the computation
    follows float64 weights where the module does not cast itself."""
    changes = {}
    for field in dataclasses.fields(module):
        if field.name in ("parent", "name") or not hasattr(module, field.name):
            continue
        value = getattr(module, field.name)
        if field.name in _DTYPE_FIELDS and is_floating_dtype(value):
            changes[field.name] = jnp.float64
        elif isinstance(value, nn.Module):
            changes[field.name] = module_in_float64(value)
        elif isinstance(value, list | tuple) and any(
            isinstance(item, nn.Module) for item in value
        ):
            changes[field.name] = type(value)(
                module_in_float64(item) if isinstance(item, nn.Module) else item
                for item in value
            )
    return module.clone(**changes) if changes else module


def in_float64(probe: Any) -> Any:
    """A probe of the module in float64 (`module_in_float64`) with float64
    variables; the probe given is unchanged."""
    new = type(probe)(
        module_in_float64(probe.module), as_float64(probe.variables), probe.vmap
    )
    return new._looking_inside(probe._inside)
