"""To and from the canonical layout: the array helpers a library's porting
module converts weights and activations with, and writes converted weights
back into its own tree with (`replace_leaves`).

The layout itself is the table in `bridge._porting.transfer`. These are
plain array functions, exported by `bridge.adapter_api`; they are apart from
`Layer` and the pairing because an adapter's converters need none of how
models are paired.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import BridgeAssertionError


def flat_size(shape: Sequence[int]) -> int:
    return math.prod(shape)


def dense_kernel(kernel: Any, inputs: int, stacked: int = 0) -> Any:
    """A kernel `(*stack, *in_axes, *out_axes)` as `(*stack, in, out)`,
    flattened row-major; `stack` are the iteration axes of a scanned layer."""
    shape = np.shape(kernel)
    lead, rest = shape[:stacked], shape[stacked:]
    return jnp.reshape(
        kernel, (*lead, flat_size(rest[:inputs]), flat_size(rest[inputs:]))
    )


def channel_first_kernel_axes(
    spatial: int, stacked: int = 0
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(to_hwio, to_oihw)`: the axis orders taking a channel-first kernel
    `(*stack, out, in, *window)` (OIHW, PyTorch's and Equinox's) to the
    canonical `(*stack, *window, in, out)`, and back."""
    stack = tuple(range(stacked))
    window = tuple(range(stacked + 2, stacked + spatial + 2))
    to_hwio = (*stack, *window, stacked + 1, stacked)
    back = (stacked + spatial + 1, stacked + spatial)
    to_oihw = (*stack, *back, *range(stacked, stacked + spatial))
    return to_hwio, to_oihw


def flattened(value: Any, stacked: int = 0) -> Any:
    """A vector parameter (a bias, a scale) as `(*stack, size)`."""
    if value is None:
        return None
    return jnp.reshape(value, (*np.shape(value)[:stacked], -1))


def flatten_trailing(count: int) -> Callable[[Any], Any]:
    """Activation layout: the last `count` axes (attention heads) flattened."""
    if count <= 1:
        return lambda value: value
    return lambda value: jnp.reshape(
        value, (*np.shape(value)[:-count], flat_size(np.shape(value)[-count:]))
    )


def replace_leaves(
    tree: Any, updates: dict[tuple[str, ...], Any], named: Callable[[tuple], tuple]
) -> Any:
    """A copy of `tree` whose leaves at the named paths are replaced.

    `named(key_path)` gives a leaf's path as strings. Each replacement is
    cast to the leaf's dtype; its shape is the caller's to have checked.
    """
    used = set()

    def replace(key_path, leaf):
        path = named(key_path)
        if path not in updates:
            return leaf
        used.add(path)
        new = updates[path]
        return jnp.reshape(
            jnp.asarray(new, dtype=jnp.result_type(leaf)), jnp.shape(leaf)
        )

    new_tree = jax.tree_util.tree_map_with_path(replace, tree)
    missing = set(updates) - used
    if missing:
        raise BridgeAssertionError(f"bridge bug: no weight at {sorted(missing)}")
    return new_tree
