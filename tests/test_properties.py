"""Property-based tests: random architectures, random selections, every library.

Hypothesis draws depths, widths, activations, how often a shared layer is
called, whether the model has a pytree site and a pytree output, and which
sites are selected. Every number is checked against references computed with
plain JAX from perturbations inserted by hand in the model's own code
(`reliability.hand`): parameter gradients against `jax.grad` of the unprobed
model, activation gradients against `jax.grad` with respect to a zero offset
and against `jax.jvp` along a random offset, activations against the values the
hooks recorded.
"""

from __future__ import annotations

import fnmatch

import jax
import numpy as np
import pytest
from helpers import assert_tree_allclose, tree_vdot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability import (
    ACTIVATIONS,
    LIBRARIES,
    Spec,
    build,
    loss_fn,
    random_values,
    reference_fn,
    site_structs,
)

for _library in ("flax.linen", "flax.nnx", "equinox", "haiku"):
    # Imported now, not inside a test: an import that raises the recursion
    # limit during a Hypothesis example makes Hypothesis warn.
    pytest.importorskip(_library)

WIDTHS = st.integers(1, 4)

specs = st.builds(
    Spec,
    in_dim=WIDTHS,
    batch=st.integers(1, 3),
    layers=st.lists(
        st.tuples(WIDTHS, st.sampled_from(sorted(ACTIVATIONS))), min_size=1, max_size=3
    ).map(tuple),
    repeats=st.integers(0, 3),
    shared_activation=st.sampled_from(sorted(ACTIVATIONS)),
    pair=st.booleans(),
    out=WIDTHS,
)


def _selections(names):
    """`None`, or a list of site names and base names (a base name selects
    every call of a shared module), as `at=` takes them."""
    bases = sorted({name.split("#")[0] for name in names})
    return st.one_of(
        st.none(),
        st.lists(st.sampled_from(sorted(set(names) | set(bases))), min_size=1).map(
            lambda chosen: list(dict.fromkeys(chosen))
        ),
    )


def _selected(at, names):
    """The contract's selection rule, written out: a pattern matches a name
    with or without its `#k` suffix."""
    if at is None:
        return names
    return [
        name
        for name in names
        if any(
            fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name.split("#")[0], p)
            for p in at
        )
    ]


def check(library, spec, data, mode):
    built = build(library, spec)
    assert list(built.probe.sites(built.x)) == built.names
    at = data.draw(_selections(built.names), label="at")
    selected = _selected(at, built.names)
    structs = site_structs(built)
    deltas = {
        name: random_values(structs[name], seed) for seed, name in enumerate(selected)
    }
    expected_fn = reference_fn(built)

    def run(probe, params, x, deltas):
        res = probe.value_and_grad(loss_fn, x, at=at)
        return res, expected_fn(params, x, deltas)

    if mode == "jit":
        # One program for both: one compilation per example.
        res, expected = jax.jit(run)(built.probe, built.params, built.x, deltas)
    else:
        res = built.probe.value_and_grad(loss_fn, built.x, at=at)
        expected = jax.jit(expected_fn)(built.params, built.x, deltas)

    assert sorted(res.activation_grads) == sorted(selected)
    assert sorted(res.activations) == sorted(selected)
    np.testing.assert_allclose(res.loss, expected["loss"], rtol=1e-5)
    assert_tree_allclose(res.grads, expected["grads"], rtol=1e-4, atol=1e-6)
    for name in selected:
        assert_tree_allclose(
            res.activations[name], expected["activations"][name], rtol=1e-5, atol=1e-6
        )
        assert_tree_allclose(
            res.activation_grads[name],
            expected["activation_grads"][name],
            rtol=1e-4,
            atol=1e-6,
        )
    np.testing.assert_allclose(
        tree_vdot(res.activation_grads, deltas),
        expected["directional"],
        rtol=1e-4,
        atol=1e-6,
    )


def _struct(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


PROPERTY = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("library", LIBRARIES)
@settings(PROPERTY, max_examples=3)
@given(spec=specs, data=st.data())
def test_jitted_gradients_equal_hand_inserted_references(library, spec, data):
    check(library, spec, data, "jit")


@pytest.mark.slow
@pytest.mark.parametrize("library", LIBRARIES)
@settings(PROPERTY, max_examples=60)
@given(spec=specs, data=st.data())
def test_many_jitted_architectures(library, spec, data):
    check(library, spec, data, "jit")


@pytest.mark.parametrize("library", LIBRARIES)
@settings(PROPERTY, max_examples=1)
@given(data=st.data())
def test_eager_gradients_equal_hand_inserted_references(library, data):
    spec = Spec(in_dim=3, batch=2, layers=((4, "gelu"),), repeats=2, pair=True)
    check(library, spec, data, "eager")


@pytest.mark.slow
@pytest.mark.parametrize("library", LIBRARIES)
@settings(PROPERTY, max_examples=10)
@given(spec=specs, data=st.data())
def test_many_eager_architectures(library, spec, data):
    check(library, spec, data, "eager")
