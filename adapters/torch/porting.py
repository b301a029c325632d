"""PyTorch's side of `bridge.transfer` and `bridge.compare`.

A parameterised module is one owning parameters itself
(`named_parameters(recurse=False)`), or a BatchNorm (its running statistics
are buffers); its weights are read from the module's parameters and buffers.
PyTorch differs from the canonical layout: `nn.Linear.weight` is `(out, in)`;
convolutions are channel-first, weights `(out, in / groups, *window)` (OIHW),
and so are the activations of convolutions and of the norms after them,
`(N, C, *spatial)`, brought channel-last to compare.

`nn.MultiheadAttention` is one module calling its projections inside a fused
function: it becomes four `dense` layers, query, key and value (split from
the packed `in_proj_weight` `(3E, E)`, or `q_proj_weight`, ... when the key
and value sizes differ) and the output projection (`out_proj`, never called as
a module). Head `h` owns rows `h * head_dim:(h + 1) * head_dim` of a
projection, which is the JAX libraries' `(in, heads, head_dim)` kernel
flattened row-major. The query, key and value layers have no site of their
own (`site=""`: their weights move, nothing is compared); the output layer
has the attention's site, whose first output (batch-first) is compared.

A weight-normed module (`torch.nn.utils.parametrizations.weight_norm`:
`parametrizations.weight.original0`/`original1`; the older
`torch.nn.utils.weight_norm`: `weight_g`/`weight_v`) is a layer of kind
`weights:bias,weight_g,weight_v`: as Hugging Face's converter moves them, by
name and unchanged, to a JAX module holding `weight_g`, `weight_v` and
`bias` (Flax Wav2Vec2's positional convolution). A module holding floating
buffers but no parameter (a language model's `final_logits_bias`) is an
`optional` layer: it pairs with a layer of the other model holding the same
names as parameters, and is left out where there is none.

The new probe holds a deep copy of the module: the user's is never changed.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

from bridge.adapter_api import (
    AsGiven,
    BridgeAssertionError,
    Converted,
    Layer,
    LayerKinds,
    ParameterisedCall,
    Site,
    Weight,
    channel_first_kernel_axes,
    norm_hyperparameters,
    placed,
    torch_named_conv_hyperparameters,
    weight_by_weight,
    weight_rmsnorm,
)

from . import internals

_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def _host(value: Any) -> np.ndarray:
    """A torch tensor (or any array) as NumPy; bfloat16 and other dtypes NumPy
    lacks as float32."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.is_floating_point() and value.dtype not in _NUMPY_FLOATS:
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def _array(tensor: torch.Tensor | None) -> np.ndarray | None:
    """A weight as a NumPy array, in its own dtype where NumPy (with ml_dtypes)
    has it."""
    if tensor is None:
        return None
    if tensor.dtype == torch.bfloat16:
        return _host(tensor).astype(jnp.bfloat16)
    return _host(tensor)


def layers(probe: Any, sites: list[Site]) -> list[Layer]:
    """Each call of a module owning parameters itself (or a BatchNorm), in call
    order; an `nn.MultiheadAttention` call gives four layers. A module holding
    only tensors of a module called before it is `tied` to that module. A
    module holding floating buffers and no parameter is an `optional` layer;
    the parameters of a weight norm belong to the module normed."""
    found, owners = [], {}
    for call in _calls(probe, sites):
        if _weight_norm_of(call.module) is not None:
            continue  # its `original0/1` are its module's `weight_g/v`
        if not KINDS.keeps(call) and _weight_normed(call) is None:
            if call.statistics:
                found.append(dataclasses.replace(KINDS.layer(call), optional=True))
            continue
        if _fused_attention(call.module):
            found.extend(_attention_layers(call))
            continue
        layer = KINDS.layer(call)
        tied = _tied_to(call, owners)
        found.append(dataclasses.replace(layer, tied=tied) if tied else layer)
    return found


def _weight_norm_of(module: nn.Module) -> ParametrizationList | None:
    """A weight norm's `ParametrizationList` (the module `.parametrizations.
    weight` that computes the weight), else `None`."""
    if isinstance(module, ParametrizationList) and len(module) == 1:
        return module if internals.is_weight_norm(module[0]) else None
    return None


def _weight_normed(call: ParameterisedCall) -> Converted | None:
    """A weight-normed module as `weight_g`, `weight_v` and `bias`, moved by
    name as Hugging Face's converter moves them; `None` for any other."""
    module = call.module
    parametrizations = getattr(module, "parametrizations", None)
    weight_norm = (
        _weight_norm_of(parametrizations["weight"])
        if isinstance(parametrizations, nn.ModuleDict) and "weight" in parametrizations
        else None
    )
    if weight_norm is not None:  # torch.nn.utils.parametrizations.weight_norm
        at = "parametrizations.weight."
        found = {
            "weight_g": Weight(
                _array(weight_norm.original0), (*call.at, f"{at}original0")
            ),
            "weight_v": Weight(
                _array(weight_norm.original1), (*call.at, f"{at}original1")
            ),
        }
    elif "weight_g" in call.own and "weight_v" in call.own:  # nn.utils.weight_norm
        found = {name: call.weight(name, _array) for name in ("weight_g", "weight_v")}
    else:
        return None
    weights = {name: call.weight(name, _array) for name in call.own}
    weights.update(found)
    converted = weight_by_weight(call, weights)
    if isinstance(
        module, internals.ConvBase
    ):  # channel-first, as the convolution's own
        converted = dataclasses.replace(converted, to_common=_channel_last)
    return converted


def _tied_to(call: ParameterisedCall, owners: dict[int, str]) -> str:
    """The path of the module first called with every tensor this one owns
    (a tied LM head holds the embedding's `weight` itself), else `""`; the
    tensors of an untied module are recorded as its own."""
    tensors = [id(tensor) for tensor in call.own.values()]
    path = call.site.path
    if tensors and all(owners.get(t, path) != path for t in tensors):
        return owners[tensors[0]]
    for tensor in tensors:
        owners.setdefault(tensor, path)
    return ""


def _calls(probe: Any, sites: list[Site]):
    """Each module's parameters, and its persistent floating-point buffers as
    its statistics; a weight `name` goes back to `(path, name)`."""
    # The root module is no site, but may own parameters (a bare nn.Linear).
    for site in [Site("", "", None, 0, probe.module, None), *sites]:
        module = site.module
        if not isinstance(module, nn.Module):
            continue
        non_persistent = internals.non_persistent_buffers(module)
        buffers = {
            name: buffer
            for name, buffer in module.named_buffers(recurse=False)
            if name not in non_persistent and buffer.is_floating_point()
        }
        own = dict(module.named_parameters(recurse=False))
        yield ParameterisedCall(site, module, own, (site.path,), buffers)


def _transposed(value: np.ndarray) -> np.ndarray:
    return np.swapaxes(value, -1, -2)


def _kernel(tensor: torch.Tensor) -> np.ndarray:
    return _transposed(_array(tensor))


def _flat(tensor: torch.Tensor | None) -> np.ndarray | None:
    return None if tensor is None else np.reshape(_array(tensor), (-1,))


def _channel_last(value: Any) -> np.ndarray:
    """`(N, C, *spatial)` as `(N, *spatial, C)`; a `(N, C)` value as it is."""
    value = _host(value)
    return np.moveaxis(value, 1, -1) if value.ndim > 2 else value


def _as_is(value: Any) -> np.ndarray:
    return _host(value)


# -- the converters: hyperparameters in canonical names and conventions
# (`bridge._porting.hyperparameters`); a BatchNorm's `momentum` is the weight of the
# running average kept, `1 - momentum` in PyTorch's terms (which weighs the
# batch).


def _linear(call: ParameterisedCall) -> Converted:
    normed = _weight_normed(call)
    if normed is not None:
        return normed
    weights = {
        "kernel": call.weight("weight", _kernel, _transposed),
        "bias": call.weight("bias", _array),
    }
    return Converted("dense", weights, {"use_bias": call.module.bias is not None})


def _conv1d(call: ParameterisedCall) -> Converted:
    """transformers' `Conv1D`: a Linear whose `weight` is `(in, out)` already."""
    weights = {
        "kernel": call.weight("weight", _array),
        "bias": call.weight("bias", _array),
    }
    return Converted("dense", weights, {"use_bias": call.module.bias is not None})


def _conv(call: ParameterisedCall) -> Converted:
    normed = _weight_normed(call)
    if normed is not None:
        return normed
    module = call.module
    to_hwio, to_oihw = channel_first_kernel_axes(module.weight.ndim - 2)
    kernel = call.weight(
        "weight",
        lambda k: np.transpose(_array(k), to_hwio),
        lambda k: np.transpose(k, to_oihw),
    )
    return Converted(
        "conv",
        {"kernel": kernel, "bias": call.weight("bias", _array)},
        torch_named_conv_hyperparameters(module, module.bias is not None),
        to_common=_channel_last,
    )


def _norm(call: ParameterisedCall, kind: str, epsilon: Any = None, **more):
    """A norm's flattened `weight` (the scale), `bias` (but an RMSNorm's) and
    a BatchNorm's running statistics; BatchNorm and GroupNorm normalise
    channel-first values."""
    module = call.module
    weights = {"scale": call.weight("weight", _flat)}
    affine = {"use_scale": module.weight is not None}
    if kind != "rmsnorm":
        weights["bias"] = call.weight("bias", _flat)
        affine["use_bias"] = module.bias is not None
    if kind == "batchnorm":
        weights["mean"] = call.weight("running_mean", _flat, statistic=True)
        weights["var"] = call.weight("running_var", _flat, statistic=True)
    epsilon = module.eps if epsilon is None else epsilon
    return Converted(
        kind,
        weights,
        norm_hyperparameters(epsilon, **affine, **more),
        _channel_last if kind in ("batchnorm", "groupnorm") else None,
    )


def _batch_norm(call: ParameterisedCall) -> Converted:
    momentum = call.module.momentum
    kept = (
        AsGiven(None, "a cumulative average, momentum=None")
        if momentum is None
        else 1.0 - float(momentum)
    )
    return _norm(call, "batchnorm", momentum=kept)


def _group_norm(call: ParameterisedCall) -> Converted:
    return _norm(call, "groupnorm", num_groups=int(call.module.num_groups))


def _layer_norm(call: ParameterisedCall) -> Converted:
    return _norm(call, "layernorm")


def _rms_norm(call: ParameterisedCall) -> Converted:
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
    return weight_rmsnorm(call, epsilon, _flat, offset)


def _hf_gemma_rms_norm(call: ParameterisedCall) -> Converted:
    return _hf_rms_norm(call, offset=1.0)


#: transformers' RMSNorm classes, by name (the adapter must not import
#: transformers): `x * rsqrt(mean(x**2) + eps) * weight`, Gemma's `* (1 + weight)`.
_HF_RMS_NORMS = {
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


def _embedding(call: ParameterisedCall) -> Converted:
    return Converted("embed", {"embedding": call.weight("weight", _array)})


def _tensor_by_tensor(call: ParameterisedCall) -> Converted:
    """Anything else moves tensor by tensor, by name: its own parameters and
    persistent floating-point buffers. A transposed convolution and an
    attention bridge cannot split (with its output projection, which it never
    calls) move only into a module of their own class."""
    weights = {name: call.weight(name, _array) for name in call.own}
    for name in call.statistics:
        weights[name] = call.weight(name, _array, statistic=True)
    if isinstance(call.module, nn.MultiheadAttention):
        for name, tensor in call.module.out_proj.named_parameters():
            name = f"out_proj.{name}"
            weights[name] = Weight(_array(tensor), (*call.at, name))
    layout = (internals.ConvTransposeBase, nn.MultiheadAttention)
    return weight_by_weight(call, weights, same_class=isinstance(call.module, layout))


KINDS = LayerKinds(
    {
        nn.Linear: _linear,
        internals.ConvBase: _conv,
        internals.ConvTransposeBase: _tensor_by_tensor,  # kernel (in, out, *window)
        internals.BatchNormBase: _batch_norm,
        nn.GroupNorm: _group_norm,
        nn.LayerNorm: _layer_norm,
        **({nn.RMSNorm: _rms_norm} if hasattr(nn, "RMSNorm") else {}),
        nn.Embedding: _embedding,
        # By name: the adapter must work, and import fast, without transformers.
        "transformers.pytorch_utils.Conv1D": _conv1d,
        **_HF_RMS_NORMS,
        nn.Module: _tensor_by_tensor,
    },
    named="nn.",
    home="torch.",
    to_common=lambda call: _as_is,
    kept_without_weights=(internals.BatchNormBase,),
)


# -- nn.MultiheadAttention ------------------------------------------------------


def _fused_attention(module: nn.Module) -> bool:
    """An `nn.MultiheadAttention` without options lacking a counterpart in
    the JAX attention modules (which make it a `module:` layer)."""
    return (
        isinstance(module, nn.MultiheadAttention)
        and module.bias_k is None
        and module.bias_v is None
        and not module.add_zero_attn
    )


def _attention_layers(call: ParameterisedCall) -> list[Layer]:
    """Query, key, value (no site of their own) and the output projection."""
    module, site = call.module, call.site
    described = KINDS.described(module)
    path, size = site.path, module.embed_dim
    prefix = f"{path}." if path else ""
    bias = module.in_proj_bias
    use_bias = {"use_bias": bias is not None}
    found = []
    for number, role in enumerate(("query", "key", "value")):
        rows = slice(number * size, (number + 1) * size)
        if internals.qkv_same_embed_dim(module):
            weight = module.in_proj_weight[rows]
            kernel_at = (path, "in_proj_weight", rows)
        else:
            name = f"{role[0]}_proj_weight"
            weight = getattr(module, name)
            kernel_at = (path, name)
        found.append(
            Layer(
                "",
                f"{prefix}{role}",
                "dense",
                f"{described}, its {role} projection",
                {
                    "kernel": _kernel(weight),
                    "bias": None if bias is None else _array(bias[rows]),
                },
                to_common=_as_is,
                locations={
                    "kernel": (kernel_at, _transposed),
                    "bias": ((path, "in_proj_bias", rows), _unchanged),
                },
                hyperparameters=use_bias,
            )
        )
    out = module.out_proj
    out_path = f"{prefix}out_proj"
    batch_first = module.batch_first

    def first_output(value: Any) -> list:
        return jax.tree.leaves(value[0] if isinstance(value, tuple) else value)

    def batch_major(value: Any) -> np.ndarray:
        value = _host(value)
        return (
            np.swapaxes(value, 0, 1) if value.ndim == 3 and not batch_first else value
        )

    found.append(
        Layer(
            site.name,
            out_path,
            "dense",
            f"{described}, its output projection",
            {"kernel": _kernel(out.weight), "bias": _array(out.bias)},
            to_common=batch_major,
            select=first_output,
            locations={
                "kernel": ((out_path, "weight"), _transposed),
                "bias": ((out_path, "bias"), _unchanged),
            },
            hyperparameters={"use_bias": out.bias is not None},
        )
    )
    return found


def _unchanged(value: Any) -> Any:
    return value


def with_weights(probe: Any, updates: list[tuple[Layer, dict]]) -> Any:
    """A new probe of a deep copy of the module, with the given canonical
    weights written in (cast to each tensor's dtype, on its device)."""
    module = deep_copy(probe.module)
    with torch.no_grad():
        for _, (path, attribute, *rows), value in placed(updates):
            owner = module.get_submodule(path) if path else module
            tensor = _named_tensor(owner, attribute)
            target = tensor[rows[0]] if rows else tensor
            new = _to_torch(_as_numpy(value))
            target.copy_(new.reshape(target.shape).to(target.dtype))
    return type(probe)(module)


def deep_copy(module: nn.Module) -> nn.Module:
    """`copy.deepcopy(module)`, also of a module weight-normed the old way
    (`torch.nn.utils.weight_norm`), whose `weight` is a tensor computed from
    `weight_g` and `weight_v` that `deepcopy` refuses: the copy's is
    computed afresh from its own, as the weight norm's forward pre-hook
    computes it at each call."""
    from torch.nn.utils.weight_norm import WeightNorm

    computed, memo = [], {}
    for path, owner in module.named_modules():
        for hook in internals.forward_pre_hooks(owner):
            if isinstance(hook, WeightNorm):
                tensor = getattr(owner, hook.name, None)
                if isinstance(tensor, torch.Tensor) and not tensor.is_leaf:
                    memo[id(tensor)] = None
                    computed.append((path, hook))
    copied = copy.deepcopy(module, memo)
    for path, hook in computed:
        owner = copied.get_submodule(path) if path else copied
        setattr(owner, hook.name, hook.compute_weight(owner))
    return copied


def _named_tensor(owner: nn.Module, name: str) -> torch.Tensor:
    *parents, leaf = name.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    tensor = getattr(owner, leaf)
    if not isinstance(tensor, torch.Tensor):
        raise BridgeAssertionError(f"bridge bug: no tensor {name!r} on {owner!r}")
    return tensor


def _as_numpy(value: Any) -> np.ndarray:
    """A canonical weight (JAX, NumPy or torch) as NumPy; dtypes torch cannot
    take from NumPy (bfloat16) as float32, cast again when written."""
    value = _host(value)
    if value.dtype.kind not in "biufc":  # ml_dtypes' bfloat16, float8, ...
        value = value.astype(np.float32)
    return value


def _to_torch(value: np.ndarray) -> torch.Tensor:
    return torch.tensor(value)  # a copy: JAX's arrays are read-only


# -- for compare ----------------------------------------------------------------


def in_float64(probe: Any) -> Any:
    """A probe of a float64 deep copy of the module (`.double()`): the
    user's module is unchanged."""
    return type(probe)(deep_copy(probe.module).double())
