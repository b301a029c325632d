"""The checks of a probe call's arguments, before any work: the loss function,
the loss it returns, and the patches.

Framework-neutral: a framework's values are seen through its `Arrays` (JAX
arrays by default, torch tensors for PyTorch), and a loss through its
abstract value (`jax.ShapeDtypeStruct`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp

from .._errors import BridgeNotImplementedError, BridgeTypeError, BridgeValueError
from .._session.backward import CHECKPOINTED_WHILE
from .._session.sites import JAX_ARRAYS, Arrays, Site, patch_misfit, shapes_and_dtypes
from .selection import matches_pattern

#: What `ProbeBase._abstract_loss` returns where the loss cannot be evaluated
#: abstractly (a PyTorch loss that fake tensors cannot run): the adapter
#: checks the real loss instead (`check_loss`), before its backward pass.
UNCHECKED_LOSS = object()


def check_loss_fn(loss_fn: Any) -> None:
    if not callable(loss_fn):
        raise BridgeTypeError(
            "`loss_fn` must be a function `outputs -> scalar` (or `(scalar, "
            f"aux)` with has_aux=True); got {type(loss_fn).__name__}. The "
            "model's inputs come after it: probe.value_and_grad(loss_fn, x)."
        )


def check_loss(loss_struct: Any, has_aux: bool) -> None:
    """Refuse a loss that is not a real floating-point scalar, or not the pair
    `(loss, aux)` that `has_aux=True` asks for.

    Args:
      loss_struct: what `loss_fn` returned, abstractly (its arrays as
        `jax.ShapeDtypeStruct`s).
      has_aux: as given to `value_and_grad`.
    """
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
    """`{site name: value or function}` for every site a patch key matches.

    Args:
      patch: as given to `apply` or `value_and_grad`, its values already in
        the framework's arrays.
      sites: every site discovered.
      arrays: the framework's values, to check that a patch fits its site.

    Returns:
      The patch of each matched site, by site name.
    """
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
            if site.refused:
                raise BridgeValueError(
                    f"patch key {pattern!r} names {site.name!r}, a site bridge "
                    f"lists but cannot probe: {site.refused}"
                )
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


def check_batch_patches_in_checkpointed_loops(
    patches: Mapping[str, Any], sites: list[Site]
) -> None:
    """Refuse, before any work, a patch function at a site inside Equinox's
    checkpointed while loop where the probe differentiates under its own
    `jax.vmap`: a patch function sees the whole batch, gathered over the
    probe's vmap axis, and the loop's backward pass traces its body again
    where that axis is not bound (JAX's `NameError`)."""
    for site in sites:
        transforms = getattr(site.origin, "transforms", ())
        if (
            callable(patches.get(site.name))
            and isinstance(transforms, tuple)
            and CHECKPOINTED_WHILE in transforms
        ):
            raise BridgeNotImplementedError(
                f"patch for site {site.name!r}: a patch function sees the whole "
                "batch, and inside Equinox's checkpointed while loop under "
                "vmap=True its backward pass runs where the batch is not "
                "gathered. Give a patch value (an array of the site's shape, "
                "see probe.sites(...)), or probe the batched model with "
                "vmap=False, or use probe.apply (no backward pass)."
            )
