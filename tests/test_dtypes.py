"""Dtypes: low precision keeps its dtype, float64 works under x64, complex
activations follow `jax.grad`'s convention, NaN and inf propagate.

References are the model's own hand-inserted offsets (`reliability.hand`),
differentiated with plain JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose
from reliability import (
    LIBRARIES,
    Spec,
    build,
    inputs,
    loss_fn,
    probe_and_reference,
)

for _library in ("flax.linen", "flax.nnx", "equinox", "haiku"):
    pytest.importorskip(_library)

pytestmark = pytest.mark.parametrize("library", LIBRARIES)


def _dtypes(tree):
    return {leaf.dtype for leaf in jax.tree.leaves(tree)}


def _check_against_reference(res, expected, deltas, rtol, atol):
    """Activations and their gradients equal the hand-inserted references, and
    `jax.jvp` along `deltas` is `Re <grad, delta>` (no conjugate: the gradient
    of a real loss with respect to a complex value is `jax.grad`'s)."""
    np.testing.assert_allclose(res.loss, expected["loss"], rtol=rtol, atol=atol)
    for name in res.activation_grads:
        assert_tree_allclose(
            res.activations[name], expected["activations"][name], rtol=rtol, atol=atol
        )
        assert_tree_allclose(
            res.activation_grads[name],
            expected["activation_grads"][name],
            rtol=rtol,
            atol=atol,
        )
    assert_tree_allclose(res.grads, expected["grads"], rtol=rtol, atol=atol)
    pairs = zip(
        jax.tree.leaves(res.activation_grads), jax.tree.leaves(deltas), strict=True
    )
    along = sum(
        jnp.sum(g.astype(jnp.complex128 if g.dtype.itemsize > 8 else jnp.complex64) * d)
        for g, d in pairs
    )
    np.testing.assert_allclose(
        np.real(along), expected["directional"], rtol=max(rtol, 1e-5), atol=atol
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_low_precision_sites_keep_their_dtype(library, dtype):
    # Dtypes are decided at tracing: abstract evaluation shows them exactly, at
    # no compilation cost.
    built = build(library, Spec(layers=((3, "tanh"),), pair=True, dtype=dtype))
    res = jax.eval_shape(
        lambda probe, x: probe.value_and_grad(loss_fn, x), built.probe, built.x
    )
    sites = built.probe.sites(built.x)
    assert list(sites) == built.names
    for name, struct in sites.items():
        assert _dtypes(struct) == {jnp.dtype(dtype)}, name
        assert _dtypes(res.activations[name]) == {jnp.dtype(dtype)}, name
        assert _dtypes(res.activation_grads[name]) == {jnp.dtype(dtype)}, name
    assert _dtypes(res.grads) == {jnp.dtype(dtype)}


def test_bfloat16_numbers_equal_the_same_computation_by_hand(library):
    spec = Spec(layers=((3, "tanh"),), repeats=1, dtype=jnp.bfloat16)
    res, expected, deltas = probe_and_reference(build(library, spec))
    # The same operations in the same precision: equal up to rounding of the
    # directional derivative, which is summed in low precision.
    _check_against_reference(res, expected, deltas, rtol=3e-2, atol=3e-2)


def test_mixed_precision_sites_keep_the_computation_dtype(library):
    # bfloat16 computation on float32 parameters, as TPU training runs: the
    # activations and their gradients in bfloat16, the parameter gradients in
    # float32, the numbers those of the same computation by hand.
    if library == "equinox":
        pytest.skip(
            "an Equinox layer computes in its parameters' dtype; mixed precision "
            "there is the user's cast of the parameters, bfloat16 throughout"
        )
    spec = Spec(
        layers=((3, "tanh"),), repeats=1, dtype=jnp.bfloat16, param_dtype=jnp.float32
    )
    res, expected, deltas = probe_and_reference(build(library, spec))
    assert _dtypes(res.activations) == {jnp.dtype(jnp.bfloat16)}
    assert _dtypes(res.activation_grads) == {jnp.dtype(jnp.bfloat16)}
    assert _dtypes(res.grads) == {jnp.dtype(jnp.float32)}
    _check_against_reference(res, expected, deltas, rtol=3e-2, atol=3e-2)


def test_float64_under_x64(library):
    with jax.enable_x64(True):
        spec = Spec(layers=((3, "tanh"),), repeats=1, pair=True, dtype=jnp.float64)
        built = build(library, spec)
        res, expected, deltas = probe_and_reference(built)
        for name in built.names:
            assert _dtypes(res.activation_grads[name]) == {jnp.dtype(jnp.float64)}
        assert _dtypes(res.grads) == {jnp.dtype(jnp.float64)}
        _check_against_reference(res, expected, deltas, rtol=1e-12, atol=1e-12)
    assert not jax.config.jax_enable_x64, "x64 leaked out of the test"


def complex_loss(outputs):
    return sum(
        jnp.mean(jnp.square(jnp.abs(leaf - 0.3))) for leaf in jax.tree.leaves(outputs)
    )


def test_complex_activations_have_jax_grad_gradients(library):
    spec = Spec(layers=((3, "tanh"),), repeats=1, pair=True, dtype=jnp.complex64)
    built = build(library, spec)
    res, expected, deltas = probe_and_reference(built, complex_loss)
    for name in built.names:
        assert _dtypes(res.activation_grads[name]) == {jnp.dtype(jnp.complex64)}
    _check_against_reference(res, expected, deltas, rtol=1e-5, atol=1e-5)


def test_nan_and_inf_in_the_inputs_propagate_without_a_crash(library):
    spec = Spec(batch=3, layers=((3, "tanh"),), repeats=1)
    built = build(library, spec)
    poisoned = inputs(spec).at[0, 0].set(jnp.nan).at[1, 0].set(jnp.inf)
    built.x = poisoned
    res, expected, _ = probe_and_reference(built)
    assert np.isnan(res.loss)
    assert all(np.isnan(leaf).any() for leaf in jax.tree.leaves(res.grads))
    # The third example is clean: its activation gradients stay finite, the
    # poisoned ones do not; NaN where the reference has NaN.
    for name, grad in res.activation_grads.items():
        assert np.isfinite(grad[2]).all(), name
        assert not np.isfinite(grad[:2]).all(), name
        np.testing.assert_allclose(
            grad, expected["activation_grads"][name], rtol=1e-5, equal_nan=True
        )
