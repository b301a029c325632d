"""The shared implementation of `ActivationProbe`.

An adapter subclasses `ProbeBase` and supplies three things: the trainable
leaves (`_trainable`), a call of the model that reports each submodule call to
the active `Session` (`_run`), and the pytree plumbing. Everything else —
discovery by abstract evaluation, selection, epsilons, patches, the loss
checks, assembling the result — is here, once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from . import _discovery_cache as discovery_cache
from ._errors import BridgeTypeError, BridgeValueError
from ._result import ForwardResult, ProbeResult
from ._selection import check_selection, matches_pattern, select
from ._session import Session
from ._sites import (
    JAX_ARRAYS,
    Arrays,
    Site,
    explicit_sharding,
    is_array,
    patch_misfit,
    shapes_and_dtypes,
    split_arrays,
    struct_update,
    zeros_like_struct,
)

#: The axis name of the probe's own `jax.vmap` with `vmap=True`, for models
#: whose layers reduce over the batch (BatchNorm).
BATCH_AXIS = "batch"


class ProbeBase:
    """Implements `sites`, `value_and_grad` and `apply` for every adapter."""

    vmap: bool = False

    #: Whether a discovery may be reused for a later call of the same
    #: structure (`bridge._discovery_cache`): same probe type, pytree structure
    #: and leaf types, same abstract inputs. An adapter opts in when its pytree
    #: flattening holds everything its sites depend on (the model's static
    #: parts in the treedef, its arrays as leaves) and its sites' `origin` is
    #: plain data; off by default, so an adapter that keeps something outside
    #: its pytree is never handed another model's sites.
    reuses_discovery: bool = False

    # -- what an adapter supplies ------------------------------------------------

    def _trainable(self) -> Any:
        """The pytree differentiated for `grads`."""
        raise NotImplementedError

    def _run(
        self, trainable: Any, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        """Call the model on one batch (one example with `vmap=True`).

        Must report every submodule call to `session` (`enter`/`exit`) and
        return `(outputs, state)`, `state` being `None` where there is none.
        """
        raise NotImplementedError

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        """Adapter-specific validation of the call arguments, before any work."""

    def _format_grads(self, grads: Any) -> Any:
        """Parameter gradients in the library's own structure."""
        return grads

    def _check_paths(self, at: Any, patch: Mapping[str, Any] | None) -> None:
        """Adapter-specific refusal of paths in `at` or `patch` that can never
        be sites (say, inside a module of a library the adapter cannot see
        into), before any work, with the reason."""

    def _discovery_key(self, args: tuple, kwargs: dict) -> Hashable | None:
        """What this probe's sites on these inputs depend on, or `None`: discover
        afresh. An adapter overrides it to add what its sites depend on beyond
        its pytree, or to return `None` where a discovery must not be reused."""
        if not self.reuses_discovery:
            return None
        return discovery_cache.structure_key(self, args, kwargs)

    # -- the protocol ------------------------------------------------------------

    def sites(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self._check_inputs(args, kwargs)
        discovered, _ = self._discover(args, kwargs)
        return {s.name: s.value_struct for s in discovered if s.differentiable}

    def apply(
        self,
        *args: Any,
        at: Any = None,
        patch: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> ForwardResult:
        check_selection(at)
        check_patch_kind(patch)
        self._check_paths(at, patch)
        self._check_inputs(args, kwargs)
        discovered, _ = self._discover(args, kwargs)
        chosen = select(at, discovered)
        patches = resolve_patches(patch, discovered)
        outputs, state, activations, _ = self._call(
            self._trainable(),
            args,
            kwargs,
            chosen=chosen,
            patches=patches,
            discovered=discovered,
        )
        return ForwardResult(outputs, in_order(activations, chosen), state)

    def value_and_grad(
        self,
        loss_fn: Callable[[Any], Any],
        *args: Any,
        at: Any = None,
        has_aux: bool = False,
        patch: Mapping[str, Any] | None = None,
        with_inputs: bool = False,
        **kwargs: Any,
    ) -> ProbeResult:
        check_loss_fn(loss_fn)
        check_selection(at)
        check_patch_kind(patch)
        self._check_paths(at, patch)
        self._check_inputs(args, kwargs)
        discovered, loss_struct = self._discover(args, kwargs, loss_fn)
        check_loss(loss_struct, has_aux)
        chosen = select(at, discovered)
        patches = resolve_patches(patch, discovered)
        epsilons = {site.name: zeros_like_struct(site.value_struct) for site in chosen}

        def objective(trainable, epsilons):
            outputs, state, activations, inputs = self._call(
                trainable,
                args,
                kwargs,
                chosen=chosen,
                epsilons=epsilons,
                patches=patches,
                with_inputs=with_inputs,
                discovered=discovered,
            )
            loss_out = loss_fn(outputs)
            loss, aux = loss_out if has_aux else (loss_out, None)
            return loss, (aux, activations, inputs, state)

        (loss, (aux, activations, inputs, state)), (grads, activation_grads) = (
            jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(
                self._trainable(), epsilons
            )
        )
        return ProbeResult(
            loss=loss,
            aux=aux,
            grads=self._format_grads(grads),
            activations=in_order(activations, chosen),
            activation_grads=in_order(activation_grads, chosen),
            state=state,
            inputs=in_order(inputs, chosen) if with_inputs else None,
        )

    # -- the machinery -----------------------------------------------------------

    def _check_inputs(self, args: tuple, kwargs: dict) -> None:
        self._check_call(args, kwargs)
        if self.vmap:
            _batch_size(args)

    def _discover(
        self, args: tuple, kwargs: dict, loss_fn: Callable | None = None
    ) -> tuple[list[Site], Any]:
        """Every site of one forward pass, by abstract evaluation: no FLOPs.

        Also returns the abstract loss when `loss_fn` is given, so a bad loss
        fails here, before any work. A discovery of a call with the same
        structure is reused (`_discovery_key`); the loss is checked on the
        outputs' abstract structure, by a trace of `loss_fn` alone.
        """
        key = self._discovery_key(args, kwargs)
        found = discovery_cache.CACHE.get(key)
        loss_struct = None
        if found is None:
            found, loss_struct = self._discover_afresh(args, kwargs, loss_fn)
            discovery_cache.CACHE.put(key, found)
        if loss_fn is not None and found.outputs is not None:
            loss_struct = found.abstract_loss(loss_fn)
        return list(found.sites), loss_struct

    def _discover_afresh(
        self, args: tuple, kwargs: dict, loss_fn: Callable | None = None
    ) -> tuple[discovery_cache.Discovery, Any]:
        """One abstract trace of the instrumented model: the sites and the
        outputs' abstract structure.

        The inputs' array leaves are traced, never closed over, so no operation
        on them can run eagerly. Where an output cannot leave the trace as
        plain data, `loss_fn` is evaluated inside it and its abstract value
        returned too (else `None`).
        """
        dynamic, rebuild = split_arrays((args, kwargs))
        sessions: list[Session] = []
        outputs_found: list[Any] = []

        def trace(probe, dynamic):
            args, kwargs = rebuild(dynamic)
            outputs, _, _, _ = probe._call(
                probe._trainable(), args, kwargs, sessions=sessions
            )
            outputs_found.append(discovery_cache.abstract_outputs(outputs))
            if outputs_found[-1] is None and loss_fn is not None:
                return loss_fn(outputs)
            return None

        loss_struct = jax.eval_shape(trace, self, dynamic)
        (session,) = sessions
        discovered = session.discovered()
        if self.vmap:
            batch, spec = _batch_size(args), _batch_sharding(args)
            discovered = [_with_batch_axis(site, batch, spec) for site in discovered]
        found = discovery_cache.Discovery(tuple(discovered), outputs_found[-1])
        return found, loss_struct

    def _call(
        self,
        trainable: Any,
        args: tuple,
        kwargs: dict,
        *,
        chosen: list[Site] | None = None,
        epsilons: Mapping[str, Any] | None = None,
        patches: Mapping[str, Any] | None = None,
        with_inputs: bool = False,
        discovered: Sequence[Site] = (),
        sessions: list[Session] | None = None,
    ) -> tuple[Any, Any, dict, dict]:
        """Run the model under a session: `(outputs, state, activations, inputs)`.

        `chosen=None` discovers (and `sessions` collects the session). The
        session knows the `Site` of every patched site too (`Session.patched`):
        an adapter carrying a patch value into a lifted transform needs its
        stacking and origin. With `vmap=True` the model runs under the
        probe's own `jax.vmap`, and epsilons and patch values, which have the
        batch axis first (after a stacked site's iteration axes), are mapped
        with the inputs, and so are the random keys among the keywords, one
        per example (`_per_example_keys`).
        """
        selected = None if chosen is None else {site.name: site for site in chosen}
        epsilons = dict(epsilons or {})
        patches = patches or {}
        patch_values = {k: v for k, v in patches.items() if not callable(v)}
        patch_functions = {k: v for k, v in patches.items() if callable(v)}
        patched = {site.name: site for site in discovered if site.name in patches}

        def single(dynamic_args, keys, epsilons, patch_values):
            call_kwargs = rebuild_kwargs(keys)
            session = Session(
                selected,
                epsilons,
                {**patch_values, **patch_functions},
                with_inputs,
                BATCH_AXIS if self.vmap else None,
                patched=patched,
            )
            if sessions is not None:
                sessions.append(session)
            with session.active():
                outputs, state = self._run(
                    trainable, rebuild_args(dynamic_args), call_kwargs, session
                )
            return outputs, state, session.activations, session.inputs

        dynamic_args, rebuild_args = split_arrays(args)
        if not self.vmap:
            rebuild_kwargs = lambda keys: kwargs
            return single(dynamic_args, [], epsilons, patch_values)
        # Each example draws its own randomness, as in a batched model.
        keys, rebuild_kwargs = _per_example_keys(kwargs, _batch_size(args))
        stacked = {site.name: site.stacked for site in discovered}
        outputs, state, activations, inputs = jax.vmap(
            single,
            in_axes=(
                0,
                0,
                {name: stacked[name] for name in epsilons},
                {name: stacked[name] for name in patch_values},
            ),
            out_axes=(0, None, 0, 0),
            axis_name=BATCH_AXIS,
        )(dynamic_args, keys, epsilons, patch_values)
        return (
            outputs,
            state,
            _batch_axis_to(activations, stacked),
            _batch_axis_to(inputs, stacked),
        )


#: The keywords through which the libraries take random keys: Haiku's `rng`,
#: Linen's `rngs`, a `key` of Equinox (and most JAX) code.
_KEY_KEYWORDS = ("rng", "rngs", "key")


def _per_example_keys(kwargs: dict, batch: int) -> tuple[list, Callable[[list], dict]]:
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


def _is_key(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return jnp.ndim(leaf) == 0
    return dtype == jnp.uint32 and jnp.shape(leaf) == (2,)


def _batch_size(args: tuple) -> int:
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


def _batch_sharding(args: tuple) -> tuple[Any, Any] | None:
    """`(mesh, spec of axis 0)` of the first positional input sharded over a
    mesh's `Explicit` axes, else `None`."""
    for leaf in jax.tree.leaves(args):
        sharding = explicit_sharding(leaf) if is_array(leaf) else None
        if sharding is not None:
            return sharding.mesh, sharding.spec[0] if sharding.spec else None
    return None


def _with_batch_axis(site: Site, batch: int, batch_sharding: Any) -> Site:
    # The batch axis goes after a stacked site's iteration axes. `update` keeps
    # the rest of the type: inside `shard_map`, a value varying across devices
    # needs an epsilon varying too (see `_sites.abstract`); over `Explicit` mesh
    # axes, an epsilon sharded like the batch.
    k = site.stacked

    def add_axis(s):
        shape = (*s.shape[:k], batch, *s.shape[k:])
        if batch_sharding is None:
            return struct_update(s, shape=shape)
        mesh, batch_spec = batch_sharding
        inner = getattr(s, "sharding", None)
        spec = list(inner.spec) if inner is not None else []
        spec += [None] * (len(s.shape) - len(spec))
        spec.insert(k, batch_spec)
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        return struct_update(s, shape=shape, sharding=sharding)

    return dataclasses.replace(site, struct=jax.tree.map(add_axis, site.struct))


def _batch_axis_to(values: dict[str, Any], stacked: dict[str, int]) -> dict:
    """`jax.vmap` put the batch axis first: move it after a stacked site's
    iteration axes, where its epsilon and patch value have it."""
    return {
        name: jax.tree.map(
            lambda v, k=stacked[name]: jnp.moveaxis(v, 0, k) if k else v, value
        )
        for name, value in values.items()
    }


def check_loss_fn(loss_fn: Any) -> None:
    if not callable(loss_fn):
        raise BridgeTypeError(
            "`loss_fn` must be a function `outputs -> scalar` (or `(scalar, "
            f"aux)` with has_aux=True); got {type(loss_fn).__name__}. The "
            "model's inputs come after it: probe.value_and_grad(loss_fn, x)."
        )


def check_loss(loss_struct: Any, has_aux: bool) -> None:
    if has_aux:
        if not (isinstance(loss_struct, tuple | list) and len(loss_struct) == 2):
            raise BridgeValueError(
                "has_aux=True, but `loss_fn` did not return a pair `(loss, aux)`; "
                f"it returned {loss_struct}. Return `(loss, aux)` or pass "
                "has_aux=False."
            )
        loss_struct = loss_struct[0]
    elif isinstance(loss_struct, tuple | list):
        raise BridgeValueError(
            f"`loss_fn` returned a {type(loss_struct).__name__} of "
            f"{len(loss_struct)}, not a scalar. If it returns `(loss, aux)`, pass "
            "has_aux=True."
        )
    shape = getattr(loss_struct, "shape", None)
    dtype = getattr(loss_struct, "dtype", None)
    if shape == () and dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise BridgeValueError(
            f"`loss_fn` returned a scalar of dtype {dtype}, and gradients need a "
            "real floating-point loss. Compute it in floating point, e.g. "
            "`jnp.mean(logits_or_errors)` or `loss.astype(jnp.float32)` (an "
            "integer loss such as a count of errors has no gradient)."
        )
    if shape != () or not jnp.issubdtype(dtype, jnp.floating):
        raise BridgeValueError(
            "`loss_fn` must return a real floating-point scalar, but it returned "
            f"{loss_struct}. Reduce it to one number, e.g. with `.mean()` or "
            "`.sum()`."
        )


def check_patch_kind(patch: Any) -> None:
    if patch is not None and not isinstance(patch, Mapping):
        raise BridgeTypeError(
            "`patch` must map site paths or globs to a value or a function of the "
            f"original value, e.g. {{'Dense_0': jnp.zeros_like}}; got "
            f"{type(patch).__name__}."
        )


def resolve_patches(
    patch: Mapping[str, Any] | None, sites: list[Site], arrays: Arrays = JAX_ARRAYS
) -> dict:
    """`{site name: value or function}` for every site a patch key matches."""
    if not patch:
        return {}
    resolved = {}
    for pattern, replacement in patch.items():
        matched = [site for site in sites if matches_pattern(pattern, site.name)]
        if not matched:
            names = ", ".join(repr(site.name) for site in sites[:8])
            raise BridgeValueError(
                f"patch key {pattern!r} matches no site. Sites: {names}"
                f"{', ...' if len(sites) > 8 else ''}."
            )
        for site in matched:
            if callable(replacement):
                _check_patch_function(site, replacement, arrays)
            else:
                _check_patch_value(site, replacement, arrays)
            resolved[site.name] = replacement
    return resolved


def _check_patch_value(site: Site, value: Any, arrays: Arrays) -> None:
    if not arrays.fits(site.struct, value):
        raise patch_misfit(
            site.name,
            shapes_and_dtypes(site.struct),
            arrays.shapes_and_dtypes(value),
            function=False,
        )


def _check_patch_function(
    site: Site, function: Callable[[Any], Any], arrays: Arrays
) -> None:
    """A patch function that changes the site's shape fails here, by abstract
    evaluation, before any work. A stacked site's function sees one iteration
    at a time, and one that cannot be evaluated abstractly here is left to the
    check at the call itself."""
    if site.stacked:
        return
    try:
        new = arrays.eval_shape(function, site.struct)
    except Exception:  # noqa: BLE001 - checked again where the patch is applied
        return
    if not arrays.fits(site.struct, new):
        raise patch_misfit(
            site.name,
            shapes_and_dtypes(site.struct),
            shapes_and_dtypes(new),
            function=True,
        )


def in_order(values: dict[str, Any], chosen: list[Site]) -> dict[str, Any]:
    """Dicts come back from traced functions with sorted keys: restore call order."""
    return {site.name: values[site.name] for site in chosen if site.name in values}
