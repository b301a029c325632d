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

The new probe holds a deep copy of the module: the user's is never changed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd, _ConvTransposeNd

from bridge.adapter_api import (
    AsGiven,
    BridgeAssertionError,
    Layer,
    Site,
    conv_hyperparameters,
    norm_hyperparameters,
)

#: Where a canonical weight goes: the module's path, the tensor's name on it,
#: the part of the tensor (`None`: all of it), and the conversion from the
#: canonical layout to the tensor's.
Location = tuple[str, str, Any, Callable[[np.ndarray], np.ndarray]]


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
    order; an `nn.MultiheadAttention` call gives four layers."""
    found = []
    # The root module is no site, but may own parameters (a bare nn.Linear).
    root = Site("", "", None, 0, probe.module, None)
    for site in [root, *sites]:
        module = site.module
        if not isinstance(module, nn.Module):
            continue
        own = dict(module.named_parameters(recurse=False))
        if not own and not isinstance(module, _BatchNorm):
            continue
        found.extend(_layers(site, module, own))
    return found


def _identity(value: np.ndarray) -> np.ndarray:
    return value


def _transposed(value: np.ndarray) -> np.ndarray:
    return np.swapaxes(value, -1, -2)


def _channel_last(value: Any) -> np.ndarray:
    """`(N, C, *spatial)` as `(N, *spatial, C)`; a `(N, C)` value as it is."""
    value = _host(value)
    return np.moveaxis(value, 1, -1) if value.ndim > 2 else value


def _as_is(value: Any) -> np.ndarray:
    return _host(value)


def _layers(site: Site, module: nn.Module, own: dict) -> list[Layer]:
    described = f"nn.{type(module).__name__}"
    path = site.path

    def here(name: str, convert=_identity, part=None) -> Location:
        return (path, name, part, convert)

    def layer(kind, weights, locations, to_common=_as_is, **extra) -> Layer:
        return Layer(
            site.name,
            path,
            kind,
            described,
            weights,
            to_common=to_common,
            locations=locations,
            hyperparameters=_hyperparameters(module),
            **extra,
        )

    if isinstance(module, nn.MultiheadAttention):
        if _fused_attention_supported(module):
            return _attention_layers(site, module, described)
    elif isinstance(module, nn.Linear):
        return [
            layer(
                "dense",
                {
                    "kernel": _transposed(_array(module.weight)),
                    "bias": _array(module.bias),
                },
                {"kernel": here("weight", _transposed), "bias": here("bias")},
            )
        ]
    elif isinstance(module, _ConvNd) and not isinstance(module, _ConvTransposeNd):
        n = module.weight.ndim - 2
        to_hwio = (*range(2, n + 2), 1, 0)
        to_oihw = (n + 1, n, *range(n))
        return [
            layer(
                "conv",
                {
                    "kernel": np.transpose(_array(module.weight), to_hwio),
                    "bias": _array(module.bias),
                },
                {
                    "kernel": here("weight", lambda k: np.transpose(k, to_oihw)),
                    "bias": here("bias"),
                },
                to_common=_channel_last,
            )
        ]
    elif isinstance(module, _BatchNorm):
        names = {"scale": "weight", "bias": "bias"}
        names |= {"mean": "running_mean", "var": "running_var"}
        return [
            layer(
                "batchnorm",
                {
                    ours: _flat(getattr(module, theirs))
                    for ours, theirs in names.items()
                },
                {ours: here(theirs) for ours, theirs in names.items()},
                to_common=_channel_last,
            )
        ]
    elif isinstance(module, nn.GroupNorm):
        return [
            layer(
                "groupnorm",
                {"scale": _flat(module.weight), "bias": _flat(module.bias)},
                {"scale": here("weight"), "bias": here("bias")},
                to_common=_channel_last,
            )
        ]
    elif isinstance(module, nn.LayerNorm):
        return [
            layer(
                "layernorm",
                {"scale": _flat(module.weight), "bias": _flat(module.bias)},
                {"scale": here("weight"), "bias": here("bias")},
            )
        ]
    elif isinstance(module, getattr(nn, "RMSNorm", ())):
        return [
            layer(
                "rmsnorm",
                {"scale": _flat(module.weight)},
                {"scale": here("weight")},
            )
        ]
    elif isinstance(module, nn.Embedding):
        return [
            layer(
                "embed",
                {"embedding": _array(module.weight)},
                {"embedding": here("weight")},
            )
        ]
    # Anything else moves only into a module of the same class, tensor by
    # tensor: its own parameters and persistent floating-point buffers (and an
    # unsupported attention's output projection, which it never calls).
    tensors = dict(own)
    non_persistent = getattr(module, "_non_persistent_buffers_set", set())
    for name, buffer in module.named_buffers(recurse=False):
        if name not in non_persistent and buffer.is_floating_point():
            tensors[name] = buffer
    if isinstance(module, nn.MultiheadAttention):
        for name, tensor in module.out_proj.named_parameters():
            tensors[f"out_proj.{name}"] = tensor
    cls = type(module)
    return [
        layer(
            f"module:{cls.__module__}.{cls.__qualname__}",
            {name: _array(tensor) for name, tensor in tensors.items()},
            {name: here(name) for name in tensors},
            select=jax.tree.leaves,
        )
    ]


def _hyperparameters(module: nn.Module) -> dict[str, Any]:
    """What `transfer` does not move, in canonical names and conventions
    (`bridge._hyperparameters`): a BatchNorm's `momentum` is the weight of the running
    average kept, `1 - momentum` in PyTorch's terms (which weighs the batch)."""
    if isinstance(module, nn.Linear):
        return {"use_bias": module.bias is not None}
    if isinstance(module, _ConvNd) and not isinstance(module, _ConvTransposeNd):
        return conv_hyperparameters(
            window=module.kernel_size,
            strides=module.stride,
            padding=module.padding,
            padding_mode=module.padding_mode,
            dilation=module.dilation,
            groups=module.groups,
            use_bias=module.bias is not None,
        )
    affine = {
        "use_scale": getattr(module, "weight", None) is not None,
        "use_bias": getattr(module, "bias", None) is not None,
    }
    if isinstance(module, _BatchNorm):
        momentum = (
            AsGiven(None, "a cumulative average, momentum=None")
            if module.momentum is None
            else 1.0 - float(module.momentum)
        )
        return norm_hyperparameters(module.eps, **affine, momentum=momentum)
    if isinstance(module, nn.GroupNorm):
        return norm_hyperparameters(
            module.eps, **affine, num_groups=int(module.num_groups)
        )
    if isinstance(module, nn.LayerNorm):
        return norm_hyperparameters(module.eps, **affine)
    if isinstance(module, getattr(nn, "RMSNorm", ())):
        epsilon = module.eps
        if epsilon is None:  # the machine epsilon of the input's dtype
            epsilon = (
                torch.finfo(module.weight.dtype).eps
                if module.weight is not None
                else AsGiven(None, "the machine epsilon of the input's dtype")
            )
        return norm_hyperparameters(epsilon, affine["use_scale"])
    return {}


def _attention_hyperparameters(module: nn.MultiheadAttention, role: str) -> dict:
    if role == "out":
        return {"use_bias": module.out_proj.bias is not None}
    return {"use_bias": module.in_proj_bias is not None}


def _flat(tensor: torch.Tensor | None) -> np.ndarray | None:
    return None if tensor is None else np.reshape(_array(tensor), (-1,))


def _fused_attention_supported(module: nn.MultiheadAttention) -> bool:
    """Options of `nn.MultiheadAttention` without a counterpart in the JAX
    attention modules make it a `module:` layer."""
    return module.bias_k is None and module.bias_v is None and not module.add_zero_attn


def _attention_layers(
    site: Site, module: nn.MultiheadAttention, described: str
) -> list[Layer]:
    """Query, key, value (no site of their own) and the output projection."""
    path, size = site.path, module.embed_dim
    prefix = f"{path}." if path else ""
    bias = module.in_proj_bias
    found = []
    for number, role in enumerate(("query", "key", "value")):
        rows = slice(number * size, (number + 1) * size)
        if module._qkv_same_embed_dim:
            weight = module.in_proj_weight[rows]
            kernel_at = (path, "in_proj_weight", rows, _transposed)
        else:
            name = f"{role[0]}_proj_weight"
            weight = getattr(module, name)
            kernel_at = (path, name, None, _transposed)
        found.append(
            Layer(
                "",
                f"{prefix}{role}",
                "dense",
                f"{described}, its {role} projection",
                {
                    "kernel": _transposed(_array(weight)),
                    "bias": None if bias is None else _array(bias[rows]),
                },
                to_common=_as_is,
                locations={
                    "kernel": kernel_at,
                    "bias": (path, "in_proj_bias", rows, _identity),
                },
                hyperparameters=_attention_hyperparameters(module, role),
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
            {"kernel": _transposed(_array(out.weight)), "bias": _array(out.bias)},
            to_common=batch_major,
            select=first_output,
            locations={
                "kernel": (out_path, "weight", None, _transposed),
                "bias": (out_path, "bias", None, _identity),
            },
            hyperparameters=_attention_hyperparameters(module, "out"),
        )
    )
    return found


def with_weights(probe: Any, updates: list[tuple[Layer, dict]]) -> Any:
    """A new probe of a deep copy of the module, with the given canonical
    weights written in (cast to each tensor's dtype, on its device)."""
    module = copy.deepcopy(probe.module)
    with torch.no_grad():
        for layer, weights in updates:
            for name, (path, attribute, part, convert) in layer.locations.items():
                value = weights.get(name)
                if value is None:
                    continue
                owner = module.get_submodule(path) if path else module
                tensor = _named_tensor(owner, attribute)
                target = tensor if part is None else tensor[part]
                new = _to_torch(convert(_as_numpy(value)))
                target.copy_(new.reshape(target.shape).to(target.dtype))
    return type(probe)(module)


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
