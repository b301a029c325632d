"""The behaviours every adapter must have, checked against independent references.

Parametrized over every case of every installed library (see `cases/`), in
the manner of Optax's shared optimizer suite. Each behaviour runs eagerly and
under `jax.jit`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import case_params
from helpers import (
    add_at_float_leaves,
    assert_tree_allclose,
    assert_tree_equal,
    random_like,
    tree_vdot,
)

import bridge
from bridge._session.sites import strip_call_index

CASES = list(case_params())
MODES = ["eager", "jit"]
#: Where the reference itself is costly, the eager run is in the slow tier.
MODES_EAGER_SLOW = [pytest.param("eager", marks=pytest.mark.slow), "jit"]


def full_result(case, mode=None):
    """The every-site result of a case, computed once per mode: eager calls
    compile each operation, jitted ones the whole program, and a probe never
    changes its inputs. By default jitted, where the model is a JAX one."""
    mode = mode or case.modes[-1]
    cache = case.__dict__.setdefault("_full_results", {})
    if mode not in cache:
        cache[mode] = value_and_grad(case, mode)
    return cache[mode]


def value_and_grad(case, mode, **options):
    if mode not in case.modes:
        pytest.skip(f"{mode} does not apply to this model (a PyTorch one)")

    def run(probe, args):
        return probe.value_and_grad(case.loss_fn, *args, **options, **case.kwargs)

    if mode == "jit":
        run = jax.jit(run)
    return case.to_host(run(case.probe, case.args))


def _jax_only(case, why):
    if "jit" not in case.modes:
        pytest.skip(f"a PyTorch model: {why}")


pytestmark = pytest.mark.parametrize("case", CASES, indirect=True)


def test_sites_are_named_in_call_order(case):
    assert list(case.probe.sites(*case.args, **case.kwargs)) == case.expected_sites


def test_sites_describe_the_recorded_values(case):
    sites = case.probe.sites(*case.args, **case.kwargs)
    res = full_result(case, "eager")
    assert list(res.activations) == list(sites)
    assert list(res.activation_grads) == list(sites)
    for name, struct in sites.items():
        for values in (res.activations[name], res.activation_grads[name]):
            assert jax.tree.structure(values) == jax.tree.structure(struct), name
            for value, leaf in zip(
                jax.tree.leaves(values), jax.tree.leaves(struct), strict=True
            ):
                assert (value.shape, value.dtype) == (leaf.shape, leaf.dtype), name


@pytest.mark.parametrize("mode", MODES)
def test_loss_and_parameter_gradients_equal_the_unprobed_model(case, mode):
    res = full_result(case, mode)
    loss, grads = case.reference_value_and_grad()
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    assert_tree_allclose(res.grads, grads)
    assert res.aux is None and res.inputs is None


@pytest.mark.parametrize("mode", MODES_EAGER_SLOW)
def test_activation_gradients_equal_jvp_of_a_hand_inserted_perturbation(case, mode):
    res = full_result(case, mode)
    for seed, (site, grad) in enumerate(res.activation_grads.items()):
        if site not in _spread(list(res.activation_grads)):
            continue
        delta = random_like(_struct(grad), seed)
        directional = _directional_derivative(case, site, delta, seed)
        grad = case.to_host(grad)
        np.testing.assert_allclose(
            tree_vdot(grad, delta), directional, rtol=2e-4, atol=1e-6, err_msg=site
        )


def _spread(names, most=3):
    """At most `most` sites, first and last included, evenly spread."""
    if len(names) <= most:
        return set(names)
    step = (len(names) - 1) / (most - 1)
    return {names[round(i * step)] for i in range(most)}


def _directional_derivative(case, site, delta, seed):
    """`jax.jvp` of the loss along a hand-inserted perturbation, computed once."""
    cache = case.__dict__.setdefault("_jvp_references", {})
    if (site, seed) not in cache:
        cache[site, seed] = case.directional_derivative(site, delta)
    return cache[site, seed]


def _struct(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


@pytest.mark.parametrize("mode", MODES_EAGER_SLOW)
def test_activations_equal_the_library_own_recording(case, mode):
    if case.reference_activations is None:
        pytest.skip("this library has no recording of its own")
    res = full_result(case, mode)
    reference = case.reference_activations()
    compared = [name for name in res.activations if name in reference]
    assert compared, "the reference records none of the sites"
    for name in compared:
        expected = jax.tree.map(
            lambda x: x if jnp.issubdtype(x.dtype, jnp.inexact) else None,
            reference[name],
        )
        assert_tree_allclose(res.activations[name], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES_EAGER_SLOW)
def test_norms_are_those_of_the_recorded_values(case, mode):
    """`res.norms()`: one row per site, in the order of `res.activations`, the
    norms of its activation and gradient (every floating leaf together),
    against numpy's in float64; taken under `jax.jit` too."""
    res = full_result(case, mode)
    norms = res.norms() if mode == "eager" else jax.jit(lambda r: r.norms())(res)
    assert norms.names == tuple(res.activations)
    assert np.asarray(norms.values).dtype == np.float32

    def norm(value):
        leaves = [
            np.asarray(leaf, np.float64)
            for leaf in jax.tree.leaves(value)
            if jnp.issubdtype(leaf.dtype, jnp.inexact)
        ]
        return np.sqrt(sum(np.sum(np.square(leaf)) for leaf in leaves))

    expected = [
        [norm(res.activations[name]), norm(res.activation_grads[name])]
        for name in norms.names
    ]
    np.testing.assert_allclose(norms.values, expected, rtol=1e-5, atol=1e-6)


def test_bias_gradient_is_the_output_gradient_summed_over_broadcast_axes(case):
    if not case.bias_sites:
        pytest.skip("no biased layer called once")
    res = full_result(case)
    for site, bias_of in case.bias_sites.items():
        bias_grad = bias_of(res.grads)
        output_grad = res.activation_grads[site]
        summed = output_grad.reshape(-1, *bias_grad.shape).sum(axis=0)
        np.testing.assert_allclose(summed, bias_grad, rtol=1e-5, atol=1e-6)


def test_state_equals_the_unprobed_model(case):
    if case.reference_state is None:
        pytest.skip("no state")
    res = full_result(case)
    expected = case.reference_state()
    if expected is None:
        assert res.state is None
    else:
        assert_tree_allclose(res.state, expected)


@pytest.mark.parametrize("mode", MODES_EAGER_SLOW)
def test_a_selection_records_the_same_numbers(case, mode):
    full = full_result(case, mode)
    names = list(full.activation_grads)
    chosen = [names[0], names[-1]]
    # A glob also matches later calls (`#k`) of a site; a predicate sees full names.
    res = value_and_grad(
        case, mode, at=[lambda path, module: path == names[0], names[-1]]
    )
    # Dicts leave `jax.jit` with sorted keys (pytree flattening); eagerly they
    # keep call order.
    order = list if mode == "eager" else sorted
    assert order(res.activation_grads) == order(dict.fromkeys(chosen))
    for name in chosen:
        assert_tree_allclose(res.activation_grads[name], full.activation_grads[name])
        assert_tree_allclose(res.activations[name], full.activations[name])
    assert_tree_allclose(res.grads, full.grads)


def _singly_named_sites(case):
    """Sites a patch key can name alone: no other call shares their base name."""
    names = list(case.probe.sites(*case.args, **case.kwargs))
    bases = [strip_call_index(name) for name in names]
    return [
        name
        for name, base in zip(names, bases, strict=True)
        if bases.count(base) == 1 or "#" in name
    ]


@pytest.mark.parametrize("mode", MODES_EAGER_SLOW)
def test_a_patch_equals_the_model_edited_by_hand(case, mode):
    sites = case.probe.sites(*case.args, **case.kwargs)
    eligible = _singly_named_sites(case)
    # Eagerly the first site, jitted the last: both ends of the model, once each.
    site = eligible[0] if mode == "eager" else eligible[-1]
    delta = random_like(sites[site], 10)
    res = value_and_grad(case, mode, patch={site: case.adding(delta)})
    np.testing.assert_allclose(
        res.loss, case.perturbed_loss(site, delta), rtol=1e-5, atol=1e-7
    )
    assert_tree_allclose(
        res.activations[site],
        add_at_float_leaves(full_result(case).activations[site], delta),
        rtol=1e-5,
        atol=1e-6,
    )


def test_apply_records_the_forward_values(case):
    full = full_result(case)
    fwd = case.probe.apply(*case.args, **case.kwargs)
    assert isinstance(fwd, bridge.ForwardResult)
    assert sorted(fwd.activations) == sorted(full.activations)
    assert_tree_allclose(case.to_host(fwd.activations), full.activations)


def test_nothing_the_user_passed_is_mutated(case):
    before = case.snapshot()
    value_and_grad(case, "eager")
    value_and_grad(case, case.modes[-1], at=case.expected_sites[-1])
    case.probe.sites(*case.args, **case.kwargs)
    assert_tree_equal(case.snapshot(), before)


def test_the_probe_is_a_pytree_so_jit_does_not_bake_in_parameters(case):
    _jax_only(case, "jax.jit does not apply")
    leaves = [x for x in jax.tree.leaves(case.probe) if np.size(x) > 1]
    closed = jax.make_jaxpr(
        lambda probe, args: probe.value_and_grad(case.loss_fn, *args, **case.kwargs)
    )(case.probe, case.args)
    for const in closed.consts:
        for leaf in leaves:
            assert not (
                np.shape(const) == np.shape(leaf) and np.array_equal(const, leaf)
            ), "a parameter was baked into the program as a constant"


def _flops(fn, *args):
    analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return analysis["flops"]


def test_unselected_sites_cost_nothing(case):
    """One selected site costs at most a few FLOPs per element of its own value.

    Whatever the other sites are, they add nothing to the compiled program: the
    bound depends on the selected site only.
    """
    _jax_only(case, "no compiled program (tests/test_torch.py counts its FLOPs)")
    reference = _flops(
        jax.value_and_grad(case.reference_loss), case.trainable, case.args
    )
    last = case.expected_sites[-1]
    one = _flops(
        lambda probe, args: probe.value_and_grad(
            case.loss_fn, *args, at=last, **case.kwargs
        ),
        case.probe,
        case.args,
    )
    size = sum(
        math.prod(s.shape)
        for s in jax.tree.leaves(case.probe.sites(*case.args, **case.kwargs)[last])
    )
    assert one - reference <= 8 * size + 64
