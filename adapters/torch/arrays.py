"""PyTorch tensors as the arrays of bridge's core (`TORCH_ARRAYS`), and the
conversions between torch tensors and JAX values at the probe's boundary."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bridge.adapter_api import Arrays, BridgeAssertionError, BridgeTypeError

from . import internals

_DTYPES = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.uint8: jnp.uint8,
    torch.bool: jnp.bool_,
}


def jax_dtype(dtype: torch.dtype) -> Any:
    """The NumPy/JAX dtype of a torch dtype (sites are `jax.ShapeDtypeStruct`s)."""
    if dtype not in _DTYPES:
        raise BridgeTypeError(f"bridge has no JAX dtype for the torch dtype {dtype}.")
    return np.dtype(_DTYPES[dtype])


def inexact(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and (
        leaf.is_floating_point() or leaf.is_complex()
    )


def jax_tree(value: Any) -> Any:
    """`value` as a pytree JAX knows: mappings JAX does not (a Hugging Face
    `ModelOutput`, any dict subclass) become plain dicts, recursively."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        return {key: jax_tree(item) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(jax_tree(item) for item in value))
    if type(value) in (tuple, list):
        return type(value)(jax_tree(item) for item in value)
    return value


def tree_map(function: Callable[[Any], Any], tree: Any) -> Any:
    """`jax.tree.map` over a site's value as JAX sees it (`jax_tree`), a lone
    tensor (the common site) first."""
    if isinstance(tree, torch.Tensor):
        return function(tree)
    return jax.tree.map(function, jax_tree(tree))


class TorchArrays(Arrays):
    """The session's view of torch tensors: leaves of `jax.tree`. A value's
    containers are seen as `jax_tree` makes them: a `ModelOutput` returned
    by a submodule is recorded (and its gradient given) as a dict."""

    def is_array(self, leaf: Any) -> bool:
        return isinstance(leaf, torch.Tensor)

    def abstract(self, tree: Any) -> Any:
        return tree_map(
            lambda x: (
                jax.ShapeDtypeStruct(tuple(x.shape), jax_dtype(x.dtype))
                if isinstance(x, torch.Tensor)
                else None
            ),
            tree,
        )

    def shapes_and_dtypes(self, tree: Any) -> Any:
        return tree_map(
            lambda x: (
                (tuple(x.shape), jax_dtype(x.dtype))
                if isinstance(x, torch.Tensor)
                else (tuple(np.shape(x)), jnp.result_type(x))
            ),
            tree,
        )

    def add_epsilon(self, value: Any, epsilon: Any) -> Any:
        raise BridgeAssertionError(
            "bridge bug: torch sites are caught by views or `_Catch`"
        )

    def recorded(self, value: Any) -> Any:
        # An alias, not a copy: a model that modifies a site's value in place
        # later (`x += residual`, `nn.ReLU(inplace=True)`) is caught by the
        # tensors' version counters and the site copied from then on
        # (`TorchSession.stale`, `TorchProbe._fresh`).
        return tree_map(lambda x: x.detach() if inexact(x) else None, value)

    def positional(self, args: tuple) -> tuple:
        return tree_map(
            lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else None,
            tuple(args),
        )

    def fits(self, expected: Any, got: Any) -> bool:
        return super().fits(expected, jax_tree(got))

    def eval_shape(self, function: Any, struct: Any) -> Any:
        with internals.fake_mode() as mode:
            values = tree_map(lambda s: fake_like(mode, s), struct)
            return self.abstract(function(values))


TORCH_ARRAYS = TorchArrays()


def fake_like(mode: Any, struct: jax.ShapeDtypeStruct) -> torch.Tensor:
    dtype = next(t for t, d in _DTYPES.items() if np.dtype(d) == struct.dtype)
    with mode:
        return torch.empty(struct.shape, dtype=dtype)


NOT_JAX = (
    "A PyTorch model runs in PyTorch: jax.jit, jax.vmap and jax.grad cannot trace "
    "it. Call the probe outside JAX transformations; batch the inputs as the "
    "PyTorch model expects."
)


def to_torch(tree: Any) -> Any:
    """NumPy and JAX arrays in `tree` as torch tensors, without a copy where the
    memory can be shared (DLPack for JAX, `from_numpy` for writable NumPy)."""

    def convert(leaf):
        if isinstance(leaf, jax.core.Tracer):
            raise BridgeTypeError(NOT_JAX)
        if isinstance(leaf, jax.Array):
            return torch.from_dlpack(leaf)
        if isinstance(leaf, np.ndarray):
            if leaf.flags.writeable:
                return torch.from_numpy(leaf)
            return torch.tensor(leaf)
        return leaf

    return jax.tree.map(convert, tree)


def detached(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree
    )


class TensorLeaf(NamedTuple):
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, x: torch.Tensor) -> TensorLeaf:
        return cls(tuple(x.shape), x.dtype, x.device, x.requires_grad)


class Spec(NamedTuple):
    """The structure of a model's outputs, kept to rebuild them as fake
    tensors for the loss check (any container `torch.utils._pytree` knows,
    Hugging Face's `ModelOutput` included)."""

    treespec: Any
    leaves: list

    @classmethod
    def of(cls, outputs: Any) -> Spec:
        leaves, treespec = internals.pytree.tree_flatten(outputs)
        return cls(
            treespec,
            [TensorLeaf.of(x) if isinstance(x, torch.Tensor) else x for x in leaves],
        )

    def fake(self, mode: Any) -> Any:
        def make(leaf):
            if not isinstance(leaf, TensorLeaf):
                return leaf
            x = torch.empty(leaf.shape, dtype=leaf.dtype, device=leaf.device)
            return x.requires_grad_(leaf.requires_grad)

        with mode:
            leaves = [make(leaf) for leaf in self.leaves]
        return internals.pytree.tree_unflatten(leaves, self.treespec)
