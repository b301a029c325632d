"""`vmap=True`: the probe maps a one-example model over the batch.

With `vmap=True` a probe calls the model under its own `jax.vmap` over axis 0
of every positional input. These are the pieces that mapping needs: the batch
size (with the checks that make one), one random key per example, and the
batch axis on a site's abstract value and on its recorded values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import BridgeValueError
from .._session.context import PROBE_AXIS
from .._session.sites import Site, explicit_sharding, is_array, struct_update

#: The axis name of the probe's own `jax.vmap` with `vmap=True`, for models
#: whose layers reduce over the batch (BatchNorm).
BATCH_AXIS = PROBE_AXIS


#: The keywords through which the libraries take random keys: Haiku's `rng`,
#: Linen's `rngs`, a `key` of Equinox (and most JAX) code.
_KEY_KEYWORDS = ("rng", "rngs", "key")


def per_example_keys(kwargs: dict, batch: int) -> tuple[list, Callable[[list], dict]]:
    """With `vmap=True`, the random keys among the keyword arguments, each split
    into one key per example (`jax.random.split(key, batch)`), and a function
    that rebuilds the keyword arguments from one example's keys.

    A batched model draws a different dropout mask for each example; a model
    mapped over examples with one key would draw the same mask for all. Keys
    are the leaves, in plain dicts, lists or tuples, of the keywords
    `rng`, `rngs` and `key`: typed keys (`jax.random.key`) and raw ones
    (`jax.random.PRNGKey`, `uint32[2]`).
    """
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(kwargs)
    plain = (jax.tree_util.DictKey, jax.tree_util.SequenceKey)
    positions = [
        i
        for i, (path, leaf) in enumerate(leaves_with_paths)
        if getattr(path[0], "key", None) in _KEY_KEYWORDS
        and all(isinstance(part, plain) for part in path)
        and _is_key(leaf)
    ]
    leaves = [leaf for _, leaf in leaves_with_paths]
    keys = [jax.random.split(leaves[i], batch) for i in positions]

    def rebuild(example_keys: list) -> dict:
        rebuilt = list(leaves)
        for i, key in zip(positions, example_keys, strict=True):
            rebuilt[i] = key
        return jax.tree.unflatten(treedef, rebuilt)

    return keys, rebuild


def mapped_call(args: tuple, kwargs: dict) -> tuple[dict, list[bool]]:
    """The call as the probe's `jax.vmap` maps it: the keyword arguments with
    each random key split into one per example (`per_example_keys`), and, for
    each array leaf of `(args, kwargs)` in `split_arrays`' order, whether the
    vmap maps it over axis 0: every positional input and the split keys (the
    other keywords are the same for every example)."""
    keys, rebuild = per_example_keys(kwargs, batch_size(args))
    marked = jax.tree.leaves(rebuild([_MAPPED] * len(keys)))
    mapped = [True for leaf in jax.tree.leaves(args) if is_array(leaf)]
    mapped += [
        mark is _MAPPED
        for leaf, mark in zip(jax.tree.leaves(kwargs), marked, strict=True)
        if is_array(leaf)
    ]
    return rebuild(keys), mapped


#: Where `mapped_call` finds a split key.
_MAPPED = object()


def _is_key(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return jnp.ndim(leaf) == 0
    return dtype == jnp.uint32 and jnp.shape(leaf) == (2,)


def batch_size(args: tuple) -> int:
    sizes = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(args):
        if is_array(leaf):
            if jnp.ndim(leaf) == 0:
                raise BridgeValueError(
                    f"vmap=True maps every positional input over axis 0, but input "
                    f"args{jax.tree_util.keystr(path)} is a scalar. Give it a leading "
                    "batch axis, or pass it as a keyword argument (not mapped)."
                )
            sizes[f"args{jax.tree_util.keystr(path)}"] = jnp.shape(leaf)[0]
    if not sizes:
        raise BridgeValueError(
            "vmap=True maps the positional inputs over axis 0, but no positional "
            "input is an array. Pass the batch positionally: "
            "probe.value_and_grad(loss_fn, x)."
        )
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{name}: {size}" for name, size in sizes.items())
        raise BridgeValueError(
            "vmap=True maps every positional input over axis 0, so their leading "
            f"axes must agree; got {listed}. Pass inputs that are not per-example "
            "as keyword arguments."
        )
    return next(iter(sizes.values()))


def batch_sharding(args: tuple) -> tuple[Any, Any] | None:
    """`(mesh, spec of axis 0)` of the first positional input sharded over a
    mesh's `Explicit` axes, else `None`."""
    for leaf in jax.tree.leaves(args):
        sharding = explicit_sharding(leaf) if is_array(leaf) else None
        if sharding is not None:
            return sharding.mesh, sharding.spec[0] if sharding.spec else None
    return None


def with_batch_axis(site: Site, batch: int, mesh_and_spec: Any) -> Site:
    """`site` with the batch axis in its abstract value; `mesh_and_spec` is
    `batch_sharding` of the inputs."""
    # The batch axis goes after a stacked site's iteration axes. `update` keeps
    # the rest of the type: inside `shard_map`, a value varying across devices
    # needs an epsilon varying too (see `_sites.abstract`); over `Explicit` mesh
    # axes, an epsilon sharded like the batch.
    k = site.stacked

    def add_axis(s):
        shape = (*s.shape[:k], batch, *s.shape[k:])
        if mesh_and_spec is None:
            return struct_update(s, shape=shape)
        mesh, batch_spec = mesh_and_spec
        inner = getattr(s, "sharding", None)
        spec = list(inner.spec) if inner is not None else []
        spec += [None] * (len(s.shape) - len(spec))
        spec.insert(k, batch_spec)
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        return struct_update(s, shape=shape, sharding=sharding)

    return dataclasses.replace(site, struct=jax.tree.map(add_axis, site.struct))


def with_leading_axis(leaf: Any, batch: int) -> Any:
    """One example's abstract output as the probe's `jax.vmap` returns it,
    the batch axis first (other leaves as they are)."""
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if getattr(leaf, "sharding", None) is not None:  # one example's, not the batch's
        leaf = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=leaf.weak_type)
    return struct_update(leaf, shape=(batch, *leaf.shape))


def batch_axis_to(values: dict[str, Any], stacked: dict[str, int]) -> dict:
    """`jax.vmap` put the batch axis first: move it after a stacked site's
    iteration axes, where its epsilon and patch value have it."""
    return {
        name: jax.tree.map(
            lambda v, k=stacked[name]: jnp.moveaxis(v, 0, k) if k else v, value
        )
        for name, value in values.items()
    }
