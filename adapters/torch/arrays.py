"""PyTorch tensors as the arrays of bridge's core (`TORCH_ARRAYS`), their
norms (`tensor_norms`, what `ProbeResult.norms()` takes of a PyTorch
probe's result), and the conversions between torch tensors and JAX values at the
probe's boundary."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bridge.adapter_api import (
    Arrays,
    BridgeAssertionError,
    BridgeTypeError,
    register_norms,
)

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

    def describe(self, leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return (tuple(leaf.shape), jax_dtype(leaf.dtype))
        return super().describe(leaf)

    def shapes_and_dtypes(self, tree: Any) -> Any:
        return tree_map(self.describe, tree)

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


@torch.no_grad()
def tensor_norms(columns: list[list[Any]]) -> torch.Tensor:
    """`(sites, len(columns))` float32, on the values' device: the L2 norm of
    each site's value in each column, over all of its floating leaves
    together. Each leaf's norm is `torch.linalg.vector_norm`'s, upcast to
    float32 first (bfloat16 and float16 before squaring); a pytree site's is
    the norm of its leaves' norms, which is the norm of them all."""
    sites = len(columns[0]) if columns else 0
    norms = [_norm(column[i]) for i in range(sites) for column in columns]
    if not norms:
        return torch.zeros((0, len(columns)), dtype=torch.float32)
    device = next((n.device for n in norms if n.device.type != "cpu"), None)
    norms = [n if device is None else n.to(device) for n in norms]
    return torch.stack(norms).reshape(sites, len(columns))


def _norm(value: Any) -> torch.Tensor:
    leaves = [leaf for leaf in jax.tree.leaves(jax_tree(value)) if inexact(leaf)]
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    each = [
        torch.linalg.vector_norm(leaf)
        if leaf.is_complex()
        else torch.linalg.vector_norm(
            leaf, dtype=torch.promote_types(leaf.dtype, torch.float32)
        )
        for leaf in leaves
    ]
    device = each[0].device
    together = torch.stack([n.to(device, torch.float32) for n in each])
    return together[0] if len(each) == 1 else torch.linalg.vector_norm(together)


register_norms(torch.Tensor, tensor_norms)


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
    """`tree` with every torch tensor detached, in any container: dicts and
    dict subclasses (Hugging Face's `ModelOutput`), other mappings,
    dataclasses, named tuples (and torch's `return_types`), lists, tuples,
    JAX pytree nodes, and the attributes of other objects (a Hugging Face
    `Cache` in `past_key_values`), nested. `jax.tree.map` alone would see a
    `ModelOutput` or a dataclass as one leaf and leave its tensors attached,
    and with them the whole autograd graph of the call.

    Each container keeps its type. One holding no tensor is returned as it
    is; one that does is a shallow copy, never the object given (which may be
    the user's). A tensor or container met twice is detached once, so
    sharing is kept. Functions, classes and `nn.Module`s are left as they
    are.
    """
    return _detached(tree, {})


#: Values that hold no tensor.
_ATOMS = (str, bytes, int, float, complex, torch.dtype, torch.device)


def _detached(value: Any, memo: dict[int, Any]) -> Any:
    if isinstance(value, torch.Tensor):
        found = memo.get(id(value))
        if found is None:
            found = memo[id(value)] = value.detach()
        return found
    if value is None or isinstance(value, _ATOMS):
        return value
    if id(value) in memo:
        return memo[id(value)]
    memo[id(value)] = value  # a cycle back to it meets the value itself
    memo[id(value)] = rebuilt = _rebuilt(value, memo)
    return rebuilt


def _rebuilt(value: Any, memo: dict[int, Any]) -> Any:
    """`value` with its tensors detached: the value itself where it holds
    none."""
    if isinstance(value, Mapping):
        items = {key: _detached(item, memo) for key, item in value.items()}
        if all(items[key] is item for key, item in value.items()):
            return value
        return _rebuilt_mapping(value, items)
    if isinstance(value, list | tuple):
        items = [_detached(item, memo) for item in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        if type(value) in (list, tuple):
            return type(value)(items)
        if hasattr(type(value), "_make"):  # a named tuple
            return type(value)._make(items)
        return type(value)(items)  # torch's `return_types`, a list subclass
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [field.name for field in dataclasses.fields(value)]
        return _with_attributes(value, names, memo)
    children, treedef = jax.tree_util.tree_flatten(
        value, is_leaf=lambda node: node is not value
    )
    if treedef.num_nodes > 1:  # a node of JAX's pytrees: one level of it
        items = [_detached(child, memo) for child in children]
        if all(new is old for new, old in zip(items, children, strict=True)):
            return value
        return jax.tree_util.tree_unflatten(treedef, items)
    if (
        isinstance(value, type | torch.nn.Module)
        or callable(value)
        or not hasattr(value, "__dict__")
    ):
        return value
    return _with_attributes(value, list(vars(value)), memo)


def _with_attributes(value: Any, names: list[str], memo: dict[int, Any]) -> Any:
    """A shallow copy of `value` with the attributes `names` detached, set as
    a frozen dataclass's own `__init__` sets them (no `__init__` or
    `__post_init__` runs again); `value` itself where they hold no tensor."""
    missing = object()
    old = {name: getattr(value, name, missing) for name in names}
    new = {
        name: _detached(item, memo) for name, item in old.items() if item is not missing
    }
    if all(item is old[name] for name, item in new.items()):
        return value
    rebuilt = copy.copy(value)
    for name, item in new.items():
        if item is not old[name]:
            object.__setattr__(rebuilt, name, item)
    return rebuilt


def _rebuilt_mapping(mapping: Mapping, items: dict) -> Any:
    """A mapping of `mapping`'s type holding `items`. A dict subclass is
    copied and its entries set (a `ModelOutput` sets the attribute of each
    entry set, and its constructor takes no mapping); another mapping is
    built from `items`; a plain dict where neither works."""
    if type(mapping) is dict:
        return items
    if isinstance(mapping, dict):
        try:
            rebuilt = copy.copy(mapping)
            for key, item in items.items():
                if item is not mapping[key]:
                    rebuilt[key] = item
            return rebuilt
        except Exception:  # noqa: BLE001 - a subclass copy or setitem refuses
            pass
    try:
        return type(mapping)(items)
    except Exception:  # noqa: BLE001 - a constructor that takes no mapping
        return items


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
