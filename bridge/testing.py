"""Assertions for tests of models and adapters: `import bridge.testing`.

- `assert_results_close`: two results (of two models, two libraries, eager and
  jitted) agree site by site.
- `check_activation_grads`: a probe's activation gradients agree with an
  independent reference, `jax.jvp` of the loss with a perturbation added at
  the site through `patch=`.

Needs only `jax`: no model library is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._errors import BridgeAssertionError, BridgeTypeError, BridgeValueError
from ._probe.result import ForwardResult, ProbeResult
from ._session.sites import (
    differentiable_part,
    merge_differentiable,
    split_arrays,
    strip_call_index,
)

__all__ = ["assert_results_close", "check_activation_grads"]


def assert_results_close(
    result_a: ProbeResult | ForwardResult,
    result_b: ProbeResult | ForwardResult,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    sites: Iterable[str] | None = None,
) -> None:
    """Assert that two results agree: loss (or outputs), then site by site.

    Compares, in order: the loss (`ProbeResult`) or the outputs
    (`ForwardResult`); the activations and the activation gradients of each
    site, in `result_a`'s order (call order, unless it left `jax.jit`, which
    sorts a dict's keys); and the parameter gradients when both have the same
    structure (results of two libraries do not). An element agrees when
    `|a - b| <= atol + rtol * |b|`.

    Args:
      result_a, result_b: two `ProbeResult`s or two `ForwardResult`s.
      rtol: the relative tolerance.
      atol: the absolute tolerance.
      sites: the sites to compare; by default every site, and both results
        must have the same sites (in any order).

    Raises:
      AssertionError: naming the first quantity and site that differs, with
        the largest absolute difference there.

    Examples:
      >>> bridge.testing.assert_results_close(eager, jitted, rtol=1e-4, atol=1e-5)
    """
    if type(result_a) is not type(result_b) or not isinstance(
        result_a, ProbeResult | ForwardResult
    ):
        raise BridgeTypeError(
            "assert_results_close compares two ProbeResults or two ForwardResults; "
            f"got {type(result_a).__name__} and {type(result_b).__name__}."
        )
    tolerance = {"rtol": rtol, "atol": atol}
    if isinstance(result_a, ProbeResult):
        _assert_close("the loss", result_a.loss, result_b.loss, **tolerance)
    else:
        _assert_close("the outputs", result_a.outputs, result_b.outputs, **tolerance)
    names = _site_names(result_a, result_b, sites)
    fields = ["activations"]
    if isinstance(result_a, ProbeResult):
        fields.append("activation_grads")
    for name in names:
        for field in fields:
            _assert_close(
                f"{field}[{name!r}]",
                getattr(result_a, field)[name],
                getattr(result_b, field)[name],
                **tolerance,
            )
    if isinstance(result_a, ProbeResult) and jax.tree.structure(
        result_a.grads
    ) == jax.tree.structure(result_b.grads):
        _assert_close(
            "the parameter gradients", result_a.grads, result_b.grads, **tolerance
        )


def _site_names(result_a: Any, result_b: Any, sites: Iterable[str] | None) -> list:
    names_a, names_b = list(result_a.activations), list(result_b.activations)
    if sites is None:
        # Matched by name: a result that left `jax.jit` has its sites in
        # sorted order (JAX sorts a dict's keys), not in call order.
        if set(names_a) != set(names_b):
            only_a = [n for n in names_a if n not in names_b]
            only_b = [n for n in names_b if n not in names_a]
            raise BridgeAssertionError(
                "The results have different sites: only in result_a "
                f"{only_a[:5]}, only in result_b {only_b[:5]}. Pass sites=[...] "
                "to compare the shared ones."
            )
        return names_a
    names = list(sites)
    for name in names:
        for label, present in (("result_a", names_a), ("result_b", names_b)):
            if name not in present:
                raise BridgeAssertionError(
                    f"Site {name!r} is not in {label}; its sites are {present[:8]}."
                )
    return names


def _assert_close(what: str, a: Any, b: Any, *, rtol: float, atol: float) -> None:
    structure_a, structure_b = jax.tree.structure(a), jax.tree.structure(b)
    if structure_a != structure_b:
        raise BridgeAssertionError(
            f"{what} differ in structure: {structure_a} vs {structure_b}."
        )
    paths_and_leaves = jax.tree_util.tree_leaves_with_path(a)
    for (path, leaf_a), leaf_b in zip(
        paths_and_leaves, jax.tree.leaves(b), strict=True
    ):
        leaf_a, leaf_b = np.asarray(leaf_a), np.asarray(leaf_b)
        where = what + jax.tree_util.keystr(path)
        if leaf_a.shape != leaf_b.shape:
            raise BridgeAssertionError(
                f"{where} differ in shape: {leaf_a.shape} vs {leaf_b.shape}."
            )
        difference = np.abs(leaf_a.astype(np.float64) - leaf_b.astype(np.float64))
        bound = atol + rtol * np.abs(leaf_b.astype(np.float64))
        if difference.size and not np.all(difference <= bound):
            worst = np.unravel_index(np.argmax(difference - bound), difference.shape)
            raise BridgeAssertionError(
                f"{where} differ: largest absolute difference "
                f"{float(difference.max()):.3g}; at index {tuple(map(int, worst))} "
                f"a={leaf_a[worst]!r}, b={leaf_b[worst]!r} "
                f"(rtol={rtol:g}, atol={atol:g})."
            )


def check_activation_grads(
    probe: Any,
    loss_fn: Callable[[Any], Any],
    *args: Any,
    at: Any = None,
    max_sites: int = 8,
    rtol: float = 1e-3,
    atol: float = 1e-5,
    seed: int = 0,
    **kwargs: Any,
) -> None:
    """Check a probe's activation gradients against `jax.jvp` of the loss.

    For each checked site, with a random direction `delta` of the site's
    shape: `vdot(activation_grad, delta)` must equal the derivative at 0 of
    `t -> loss` with `t * delta` added to the site's value. That reference
    adds the perturbation through `patch=` with the function `v -> v + t *
    delta` in `probe.apply`, and differentiates it forward with `jax.jvp` —
    a separate code path from the zero epsilon `value_and_grad` differentiates
    backward. Both run under `jax.jit`.

    Args:
      probe: the probe to check.
      loss_fn: `outputs -> scalar`.
      *args, **kwargs: the model's call arguments.
      at: the sites to check (a selection, as for `value_and_grad`); of those,
        at most `max_sites`, spread evenly over call order.
      rtol, atol: tolerance of each directional derivative, relative to the
        larger of the two values.
      seed: seeds the random directions.

    Raises:
      AssertionError: naming the first site whose gradient disagrees.

    Examples:
      >>> bridge.testing.check_activation_grads(probe, loss_fn, x, max_sites=4)
    """
    if max_sites < 1:
        raise BridgeValueError(f"`max_sites` must be at least 1; got {max_sites}.")
    dynamic, rebuild = split_arrays((args, kwargs))

    @jax.jit
    def value_and_grad(probe, dynamic):
        args, kwargs = rebuild(dynamic)
        return probe.value_and_grad(loss_fn, *args, at=at, **kwargs)

    result = value_and_grad(probe, dynamic)
    names = list(result.activations)
    if len(names) > max_sites:
        chosen = np.linspace(0, len(names) - 1, max_sites).round().astype(int)
        names = [names[i] for i in sorted(set(chosen))]
    every_site = list(probe.sites(*args, **kwargs))
    rng = np.random.default_rng(seed)
    deltas = {
        name: jax.tree.map(
            lambda leaf: jnp.asarray(
                rng.standard_normal(np.shape(leaf)), dtype=jnp.result_type(leaf)
            ),
            result.activations[name],
        )
        for name in names
    }
    expected = {
        name: sum(
            float(jnp.vdot(g, d))
            for g, d in zip(
                jax.tree.leaves(result.activation_grads[name]),
                jax.tree.leaves(deltas[name]),
                strict=True,
            )
        )
        for name in names
    }

    @jax.jit
    def directional(probe, dynamic, deltas):
        args, kwargs = rebuild(dynamic)
        derivatives = {}
        for name in names:

            def loss_at(t, name=name):
                shift = _shift(t, deltas[name])
                patch = _only(name, every_site, shift)
                outputs = probe.apply(*args, patch=patch, **kwargs).outputs
                return loss_fn(outputs)

            zero = jnp.zeros((), jnp.float32)
            _, derivatives[name] = jax.jvp(loss_at, (zero,), (jnp.ones_like(zero),))
        return derivatives

    got = directional(probe, dynamic, deltas)
    for name in names:
        want, have = expected[name], float(got[name])
        if not abs(want - have) <= atol + rtol * max(abs(want), abs(have)):
            raise BridgeAssertionError(
                f"Activation gradient at site {name!r} disagrees with jax.jvp of the "
                f"loss with a perturbation patched in there: vdot(activation_grad, "
                f"delta) = {want:.6g}, jvp = {have:.6g} (difference "
                f"{abs(want - have):.3g}; rtol={rtol:g}, atol={atol:g})."
            )


def _shift(t: Any, delta: Any) -> Callable[[Any], Any]:
    """`v -> v + t * delta` on the floating leaves of a site's value."""

    def shifted(value: Any) -> Any:
        floats = differentiable_part(value)
        moved = jax.tree.map(
            lambda v, d: v + (t * d).astype(jnp.result_type(v)), floats, delta
        )
        return merge_differentiable(value, moved)

    return shifted


def _only(name: str, every_site: list[str], function: Callable) -> Mapping:
    """A patch of exactly site `name`. A key without `#k` also matches the
    module's later calls and later keys win: such a key goes first, and every
    other call of the module gets the identity."""
    base = strip_call_index(name)
    calls = [other for other in every_site if strip_call_index(other) == base]
    calls.sort(key=lambda other: other != base)  # the bare name first
    return {other: function if other == name else _identity for other in calls}


def _identity(value: Any) -> Any:
    return value
