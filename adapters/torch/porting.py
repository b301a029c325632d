"""PyTorch's side of `bridge.transfer` and `bridge.compare`.

A parameterised module is one owning parameters itself
(`named_parameters(recurse=False)`), or a BatchNorm (its running statistics
are buffers); its weights are read from the module's parameters and buffers.
PyTorch differs from the canonical layout: `nn.Linear.weight` is `(out, in)`;
convolutions are channel-first, weights `(out, in / groups, *window)` (OIHW),
and so are the activations of convolutions and of the norms after them,
`(N, C, *spatial)`, brought channel-last to compare.

This module is the `PortingSide` the probe names: the walk over a model's
calls (`layers`), the `LayerKinds` table, and the weights written back
(`with_weights`, `in_float64`), and how porting reads a tensor, a dtype
and a float64 input (`to_host`, `numpy_dtype`, `to_float64`). What it builds
on lives apart: the converter of each layer kind and the weight norms
(`converters`), the layers of an `nn.MultiheadAttention` (`attention`), and
tensors as NumPy in either layout (`layouts`).

A weight-normed module's parameters belong to the module normed
(`converters`). A module holding floating buffers but no parameter (a
language model's `final_logits_bias`) is an `optional` layer: it pairs with a
layer of the other model holding the same names as parameters, and is left
out where there is none.

The new probe holds a deep copy of the module: the user's is never changed.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from torch import nn

from bridge.adapter_api import (
    BridgeAssertionError,
    Layer,
    LayerKinds,
    ParameterisedCall,
    Site,
    placed,
)

from . import converters, internals
from .attention import attention_layers, fused_attention
from .layouts import as_is, host_array, weight_array


def layers(probe: Any, sites: list[Site]) -> list[Layer]:
    """Each call of a module owning parameters itself (or a BatchNorm), in call
    order; an `nn.MultiheadAttention` call gives four layers. A module holding
    only tensors of a module called before it is `tied` to that module. A
    module holding floating buffers and no parameter is an `optional` layer;
    the parameters of a weight norm belong to the module normed."""
    found, owners = [], {}
    for call in _calls(probe, sites):
        if converters.weight_norm_of(call.module) is not None:
            continue  # its `original0/1` are its module's `weight_g/v`
        if not KINDS.keeps(call) and converters.weight_normed(call) is None:
            if call.statistics:
                found.append(dataclasses.replace(KINDS.layer(call), optional=True))
            continue
        if fused_attention(call.module):
            found.extend(attention_layers(call, KINDS.described(call.module)))
            continue
        layer = KINDS.layer(call)
        tied = _tied_to(call, owners)
        found.append(dataclasses.replace(layer, tied=tied) if tied else layer)
    return found


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


KINDS = LayerKinds(
    {
        nn.Linear: converters.linear,
        internals.ConvBase: converters.conv,
        # kernel (in, out, *window)
        internals.ConvTransposeBase: converters.tensor_by_tensor,
        internals.BatchNormBase: converters.batch_norm,
        nn.GroupNorm: converters.group_norm,
        nn.LayerNorm: converters.layer_norm,
        **({nn.RMSNorm: converters.rms_norm} if hasattr(nn, "RMSNorm") else {}),
        nn.Embedding: converters.embedding,
        # By name: the adapter must work, and import fast, without transformers.
        "transformers.pytorch_utils.Conv1D": converters.conv1d,
        **converters.HF_RMS_NORMS,
        nn.Module: converters.tensor_by_tensor,
    },
    named="nn.",
    home="torch.",
    to_common=lambda call: as_is,
    kept_without_weights=(internals.BatchNormBase,),
)


# -- the weights written back ---------------------------------------------------


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
    return type(probe)(module)._looking_inside(probe._inside)


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
    value = host_array(value)
    if value.dtype.kind not in "biufc":  # ml_dtypes' bfloat16, float8, ...
        value = value.astype(np.float32)
    return value


def _to_torch(value: np.ndarray) -> torch.Tensor:
    return torch.tensor(value)  # a copy: JAX's arrays are read-only


# -- for compare ----------------------------------------------------------------


def in_float64(probe: Any) -> Any:
    """A probe of a float64 deep copy of the module (`.double()`): the
    user's module is unchanged."""
    new = type(probe)(deep_copy(probe.module).double())
    return new._looking_inside(probe._inside)


# -- reading PyTorch's values, for transfer and compare --------------------------


def to_host(value: Any) -> np.ndarray | None:
    """A tensor as a NumPy array on the host, in its own dtype (bfloat16 as
    `jnp.bfloat16`); `None` for a value that is no tensor."""
    return weight_array(value) if isinstance(value, torch.Tensor) else None


def numpy_dtype(dtype: Any) -> np.dtype | None:
    """A PyTorch dtype (or its name, `"torch.float64"`) as NumPy's; `None` for
    anything else."""
    if isinstance(dtype, str) and dtype.startswith("torch."):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        return None
    try:
        return jnp.dtype(str(dtype).removeprefix("torch."))
    except (TypeError, ValueError):  # a dtype NumPy and JAX lack
        return None


def to_float64(value: Any) -> Any:
    """A floating tensor as float64 (other tensors as they are); `None` for a
    value that is no tensor."""
    if not isinstance(value, torch.Tensor):
        return None
    return value.double() if value.is_floating_point() else value
