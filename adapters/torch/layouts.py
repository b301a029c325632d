"""Torch tensors as NumPy, between PyTorch's layout and the canonical one.

Porting reads every weight and activation on the host, as NumPy: a weight in
its own dtype where NumPy (with ml_dtypes) has it, and the canonical layout's
axes from PyTorch's (`nn.Linear.weight` is `(out, in)`; convolutions and the
norms after them are channel-first). The converters (`converters`), the
attention's layers (`attention`) and the writing back (`porting`) share these
few functions, which import nothing of porting.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import torch

_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def host_array(value: Any) -> np.ndarray:
    """A torch tensor (or any array) as NumPy; bfloat16 and other dtypes NumPy
    lacks as float32."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.is_floating_point() and value.dtype not in _NUMPY_FLOATS:
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def weight_array(tensor: torch.Tensor | None) -> np.ndarray | None:
    """A weight as a NumPy array, in its own dtype where NumPy (with ml_dtypes)
    has it."""
    if tensor is None:
        return None
    if tensor.dtype == torch.bfloat16:
        return host_array(tensor).astype(jnp.bfloat16)
    return host_array(tensor)


def transposed(value: np.ndarray) -> np.ndarray:
    return np.swapaxes(value, -1, -2)


def kernel(tensor: torch.Tensor) -> np.ndarray:
    return transposed(weight_array(tensor))


def flat(tensor: torch.Tensor | None) -> np.ndarray | None:
    return None if tensor is None else np.reshape(weight_array(tensor), (-1,))


def channel_last(value: Any) -> np.ndarray:
    """`(N, C, *spatial)` as `(N, *spatial, C)`; a `(N, C)` value as it is."""
    value = host_array(value)
    return np.moveaxis(value, 1, -1) if value.ndim > 2 else value


def as_is(value: Any) -> np.ndarray:
    return host_array(value)


def unchanged(value: Any) -> Any:
    return value
