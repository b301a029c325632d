"""`nn.MultiheadAttention` as the four `dense` layers the JAX libraries have.

It is one module calling its projections inside a fused function, so no
converter of one call (`converters`) fits it: it becomes query, key and value
(split from the packed `in_proj_weight` `(3E, E)`, or `q_proj_weight`, ...
when the key and value sizes differ) and the output projection (`out_proj`,
never called as a module). Head `h` owns rows `h * head_dim:(h + 1) *
head_dim` of a projection, which is the JAX libraries' `(in, heads,
head_dim)` kernel flattened row-major. The query, key and value layers have
no site of their own (`site=""`: their weights move, nothing is compared);
the output layer has the attention's site, whose first output (batch-first)
is compared.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from torch import nn

from bridge.adapter_api import Layer, ParameterisedCall

from . import internals
from .layouts import as_is, host_array, kernel, transposed, unchanged, weight_array


def fused_attention(module: nn.Module) -> bool:
    """An `nn.MultiheadAttention` without options lacking a counterpart in
    the JAX attention modules (which make it a `module:` layer)."""
    return (
        isinstance(module, nn.MultiheadAttention)
        and module.bias_k is None
        and module.bias_v is None
        and not module.add_zero_attn
    )


def attention_layers(call: ParameterisedCall, described: str) -> list[Layer]:
    """Query, key, value (no site of their own) and the output projection;
    `described` is the attention module as the layer kinds' table names it."""
    module, site = call.module, call.site
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
                    "kernel": kernel(weight),
                    "bias": None if bias is None else weight_array(bias[rows]),
                },
                to_common=as_is,
                locations={
                    "kernel": (kernel_at, transposed),
                    "bias": ((path, "in_proj_bias", rows), unchanged),
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
        value = host_array(value)
        return (
            np.swapaxes(value, 0, 1) if value.ndim == 3 and not batch_first else value
        )

    found.append(
        Layer(
            site.name,
            out_path,
            "dense",
            f"{described}, its output projection",
            {"kernel": kernel(out.weight), "bias": weight_array(out.bias)},
            to_common=batch_major,
            select=first_output,
            locations={
                "kernel": ((out_path, "weight"), transposed),
                "bias": ((out_path, "bias"), unchanged),
            },
            hyperparameters={"use_bias": out.bias is not None},
        )
    )
    return found
