"""The converters of PyTorch's layers: each a layer kind's weights and
hyperparameters in canonical names and conventions.

`porting`'s `LayerKinds` table maps each layer class to one of these; they
are apart from it because they are the bulk of porting and change one layer
kind at a time, while the table and the walk over a model's calls
(`porting`) do not. Hyperparameters are in canonical names
(`bridge._porting.hyperparameters`); a BatchNorm's `momentum` is the weight of
the running average kept, `1 - momentum` in PyTorch's terms (which weighs the
batch).

A weight-normed module (`torch.nn.utils.parametrizations.weight_norm`:
`parametrizations.weight.original0`/`original1`; the older
`torch.nn.utils.weight_norm`: `weight_g`/`weight_v`) is a layer of kind
`weights:bias,weight_g,weight_v`: as Hugging Face's converter moves them, by
name and unchanged, to a JAX module holding `weight_g`, `weight_v` and
`bias` (Flax Wav2Vec2's positional convolution).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

from bridge.adapter_api import (
    AsGiven,
    Converted,
    ParameterisedCall,
    Weight,
    channel_first_kernel_axes,
    norm_hyperparameters,
    torch_named_conv_hyperparameters,
    weight_by_weight,
    weight_rmsnorm,
)

from . import internals
from .layouts import channel_last, flat, kernel, transposed, weight_array

# -- weight norms ------------------------------------------------------------------


def weight_norm_of(module: nn.Module) -> ParametrizationList | None:
    """A weight norm's `ParametrizationList` (the module `.parametrizations.
    weight` that computes the weight), else `None`."""
    if isinstance(module, ParametrizationList) and len(module) == 1:
        return module if internals.is_weight_norm(module[0]) else None
    return None


def weight_normed(call: ParameterisedCall) -> Converted | None:
    """A weight-normed module as `weight_g`, `weight_v` and `bias`, moved by
    name as Hugging Face's converter moves them; `None` for any other."""
    module = call.module
    parametrizations = getattr(module, "parametrizations", None)
    weight_norm = (
        weight_norm_of(parametrizations["weight"])
        if isinstance(parametrizations, nn.ModuleDict) and "weight" in parametrizations
        else None
    )
    if weight_norm is not None:  # torch.nn.utils.parametrizations.weight_norm
        at = "parametrizations.weight."
        found = {
            "weight_g": Weight(
                weight_array(weight_norm.original0), (*call.at, f"{at}original0")
            ),
            "weight_v": Weight(
                weight_array(weight_norm.original1), (*call.at, f"{at}original1")
            ),
        }
    elif "weight_g" in call.own and "weight_v" in call.own:  # nn.utils.weight_norm
        found = {
            name: call.weight(name, weight_array) for name in ("weight_g", "weight_v")
        }
    else:
        return None
    weights = {name: call.weight(name, weight_array) for name in call.own}
    weights.update(found)
    converted = weight_by_weight(call, weights)
    if isinstance(
        module, internals.ConvBase
    ):  # channel-first, as the convolution's own
        converted = dataclasses.replace(converted, to_common=channel_last)
    return converted


# -- dense layers and convolutions -------------------------------------------------


def linear(call: ParameterisedCall) -> Converted:
    normed = weight_normed(call)
    if normed is not None:
        return normed
    weights = {
        "kernel": call.weight("weight", kernel, transposed),
        "bias": call.weight("bias", weight_array),
    }
    return Converted("dense", weights, {"use_bias": call.module.bias is not None})


def conv1d(call: ParameterisedCall) -> Converted:
    """transformers' `Conv1D`: a Linear whose `weight` is `(in, out)` already."""
    weights = {
        "kernel": call.weight("weight", weight_array),
        "bias": call.weight("bias", weight_array),
    }
    return Converted("dense", weights, {"use_bias": call.module.bias is not None})


def conv(call: ParameterisedCall) -> Converted:
    normed = weight_normed(call)
    if normed is not None:
        return normed
    module = call.module
    to_hwio, to_oihw = channel_first_kernel_axes(module.weight.ndim - 2)
    kernel_weight = call.weight(
        "weight",
        lambda k: np.transpose(weight_array(k), to_hwio),
        lambda k: np.transpose(k, to_oihw),
    )
    return Converted(
        "conv",
        {"kernel": kernel_weight, "bias": call.weight("bias", weight_array)},
        torch_named_conv_hyperparameters(module, module.bias is not None),
        to_common=channel_last,
    )


# -- norms -------------------------------------------------------------------------


def _norm(call: ParameterisedCall, kind: str, epsilon: Any = None, **more):
    """A norm's flattened `weight` (the scale), `bias` (but an RMSNorm's) and
    a BatchNorm's running statistics; BatchNorm and GroupNorm normalise
    channel-first values."""
    module = call.module
    weights = {"scale": call.weight("weight", flat)}
    affine = {"use_scale": module.weight is not None}
    if kind != "rmsnorm":
        weights["bias"] = call.weight("bias", flat)
        affine["use_bias"] = module.bias is not None
    if kind == "batchnorm":
        weights["mean"] = call.weight("running_mean", flat, statistic=True)
        weights["var"] = call.weight("running_var", flat, statistic=True)
    epsilon = module.eps if epsilon is None else epsilon
    return Converted(
        kind,
        weights,
        norm_hyperparameters(epsilon, **affine, **more),
        channel_last if kind in ("batchnorm", "groupnorm") else None,
    )


def batch_norm(call: ParameterisedCall) -> Converted:
    momentum = call.module.momentum
    kept = (
        AsGiven(None, "a cumulative average, momentum=None")
        if momentum is None
        else 1.0 - float(momentum)
    )
    return _norm(call, "batchnorm", momentum=kept)


def group_norm(call: ParameterisedCall) -> Converted:
    return _norm(call, "groupnorm", num_groups=int(call.module.num_groups))


def layer_norm(call: ParameterisedCall) -> Converted:
    return _norm(call, "layernorm")


def rms_norm(call: ParameterisedCall) -> Converted:
    module = call.module
    epsilon = module.eps
    if epsilon is None:  # the machine epsilon of the input's dtype
        epsilon = (
            torch.finfo(module.weight.dtype).eps
            if module.weight is not None
            else AsGiven(None, "the machine epsilon of the input's dtype")
        )
    return _norm(call, "rmsnorm", epsilon)


def _hf_rms_norm(call: ParameterisedCall, offset: float = 0.0) -> Converted:
    """A transformers model's own RMSNorm: `weight` the scale (Gemma's scale
    is `1 + weight`), `variance_epsilon` (Gemma's `eps`) the epsilon."""
    module = call.module
    epsilon = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return weight_rmsnorm(call, epsilon, flat, offset)


def _hf_gemma_rms_norm(call: ParameterisedCall) -> Converted:
    return _hf_rms_norm(call, offset=1.0)


#: transformers' RMSNorm classes, by name (the adapter must not import
#: transformers): `x * rsqrt(mean(x**2) + eps) * weight`, Gemma's `* (1 + weight)`.
HF_RMS_NORMS = {
    f"transformers.models.{family}.modeling_{family}.{name}": converter
    for family, name, converter in [
        ("llama", "LlamaRMSNorm", _hf_rms_norm),
        ("mistral", "MistralRMSNorm", _hf_rms_norm),
        ("mixtral", "MixtralRMSNorm", _hf_rms_norm),
        ("qwen2", "Qwen2RMSNorm", _hf_rms_norm),
        ("qwen3", "Qwen3RMSNorm", _hf_rms_norm),
        ("phi3", "Phi3RMSNorm", _hf_rms_norm),
        ("t5", "T5LayerNorm", _hf_rms_norm),
        ("gemma", "GemmaRMSNorm", _hf_gemma_rms_norm),
        ("gemma2", "Gemma2RMSNorm", _hf_gemma_rms_norm),
    ]
}


# -- the rest ----------------------------------------------------------------------


def embedding(call: ParameterisedCall) -> Converted:
    return Converted("embed", {"embedding": call.weight("weight", weight_array)})


def tensor_by_tensor(call: ParameterisedCall) -> Converted:
    """Anything else moves tensor by tensor, by name: its own parameters and
    persistent floating-point buffers. A transposed convolution and an
    attention bridge cannot split (with its output projection, which it never
    calls) move only into a module of their own class."""
    weights = {name: call.weight(name, weight_array) for name in call.own}
    for name in call.statistics:
        weights[name] = call.weight(name, weight_array, statistic=True)
    if isinstance(call.module, nn.MultiheadAttention):
        for name, tensor in call.module.out_proj.named_parameters():
            name = f"out_proj.{name}"
            weights[name] = Weight(weight_array(tensor), (*call.at, name))
    layout = (internals.ConvTransposeBase, nn.MultiheadAttention)
    return weight_by_weight(call, weights, same_class=isinstance(call.module, layout))
