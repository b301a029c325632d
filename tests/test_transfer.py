"""`bridge.transfer`: weights move between Linen, NNX, Haiku and Equinox.

The references are the libraries themselves: after a transfer, the
destination model's own forward pass (its library's `apply`, no bridge code)
gives the source model's outputs; and for two pairs the moved arrays are
checked against a conversion written out by hand.
"""

from __future__ import annotations

import functools
import itertools

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_tree_equal, numpy_snapshot
from porting_models import IMAGES, LIBRARIES, TOKENS, build, filled, outputs

import bridge

#: Each library into and out of every other, on the attention model.
ATTENTION_RING = [("linen", "nnx"), ("nnx", "equinox"), ("equinox", "haiku")]
ATTENTION_RING += [("haiku", "linen")]


@functools.cache
def _forward(library: str, model: str):
    """The library's own forward pass, jitted once per model (the probes of one
    model share their static structure, so ported probes hit the cache)."""
    del library, model  # cache keys only
    return jax.jit(outputs)


def _output(probe, library: str, model: str):
    x = IMAGES if model == "cnn" else TOKENS
    return np.asarray(_forward(library, model)(probe, x))


@pytest.mark.parametrize(
    "model, src, dst",
    [("cnn", a, b) for a, b in itertools.permutations(LIBRARIES, 2)]
    + [("attention", a, b) for a, b in ATTENTION_RING],
)
def test_transferred_model_computes_the_source_outputs(model, src, dst):
    """Conv + BatchNorm (running statistics) + Dense + LayerNorm for every
    ordered pair; Embed + attention projections into and out of each library."""
    x = IMAGES if model == "cnn" else TOKENS
    source, destination = build(src, model), build(dst, model, seed=1)
    before = _output(destination, dst, model)
    ported = bridge.transfer(source, destination, x)
    expected = _output(source, src, model)
    assert type(ported) is type(destination)
    assert ported.vmap == destination.vmap
    np.testing.assert_allclose(
        _output(ported, dst, model), expected, rtol=1e-5, atol=1e-5
    )
    # The test can fail: before the transfer the models disagree.
    assert np.abs(before - expected).max() > 1e-2


def test_linen_to_equinox_equals_a_port_written_by_hand():
    source, destination = build("linen"), build("equinox", seed=1)
    ported = bridge.transfer(source, destination, IMAGES)
    params = source.variables["params"]
    stats = source.variables["batch_stats"]["BatchNorm_0"]
    model = ported.model
    # Equinox convolutions are OIHW with a (C, 1, 1) bias; Linear is (out, in).
    np.testing.assert_array_equal(
        model.conv.weight, np.transpose(params["Conv_0"]["kernel"], (3, 2, 0, 1))
    )
    np.testing.assert_array_equal(
        model.conv.bias, params["Conv_0"]["bias"][:, None, None]
    )
    np.testing.assert_array_equal(model.norm.weight, params["BatchNorm_0"]["scale"])
    np.testing.assert_array_equal(model.norm.bias, params["BatchNorm_0"]["bias"])
    mean, var = ported.state.get(model.norm.ema_state_index)
    np.testing.assert_array_equal(mean, stats["mean"])
    np.testing.assert_array_equal(var, stats["var"])
    np.testing.assert_array_equal(model.hidden.weight, params["Dense_0"]["kernel"].T)
    np.testing.assert_array_equal(model.hidden.bias, params["Dense_0"]["bias"])
    np.testing.assert_array_equal(
        model.layer_norm.weight, params["LayerNorm_0"]["scale"]
    )
    np.testing.assert_array_equal(model.out.weight, params["Dense_1"]["kernel"].T)


def test_linen_attention_to_haiku_equals_a_port_written_by_hand():
    source, destination = build("linen", "attention"), build("haiku", "attention")
    ported = bridge.transfer(source, destination, TOKENS)
    attention = source.variables["params"]["MultiHeadDotProductAttention_0"]
    params = ported.params
    for linen_name, haiku_name in [("query", "query"), ("value", "value")]:
        kernel = attention[linen_name]["kernel"]  # (in, heads, head_dim)
        np.testing.assert_array_equal(
            params[f"multi_head_attention/{haiku_name}"]["w"],
            kernel.reshape(kernel.shape[0], -1),
        )
        np.testing.assert_array_equal(
            params[f"multi_head_attention/{haiku_name}"]["b"],
            attention[linen_name]["bias"].reshape(-1),
        )
    out = attention["out"]["kernel"]  # (heads, head_dim, out)
    np.testing.assert_array_equal(
        params["multi_head_attention/linear"]["w"], out.reshape(-1, out.shape[-1])
    )
    np.testing.assert_array_equal(
        params["embed"]["embeddings"],
        source.variables["params"]["Embed_0"]["embedding"],
    )


def test_haiku_moving_averages_are_used_as_given_and_continue():
    """Haiku's zero-debiased EMA: the moved statistic is `average`, and one
    training step continues it as a plain moving average (decay 0.9)."""
    source, destination = build("linen"), build("haiku", seed=1)
    ported = bridge.transfer(source, destination, IMAGES)
    mean = np.asarray(source.variables["batch_stats"]["BatchNorm_0"]["mean"])
    ema = ported.state["batch_norm/~/mean_ema"]
    np.testing.assert_array_equal(ema["average"].reshape(-1), mean)
    _, state = jax.jit(functools.partial(ported.transformed.apply, is_training=True))(
        ported.params, ported.state, IMAGES
    )
    features = hk.without_apply_rng(
        hk.transform(lambda x: hk.Conv2D(4, 3, padding="SAME")(x))
    ).apply({"conv2_d": ported.params["conv2_d"]}, IMAGES)
    batch_mean = np.asarray(features).mean(axis=(0, 1, 2))
    np.testing.assert_allclose(
        np.asarray(state["batch_norm/~/mean_ema"]["average"]).reshape(-1),
        0.9 * mean + 0.1 * batch_mean,
        rtol=1e-5,
        atol=1e-6,
    )


def test_neither_probe_nor_the_nnx_module_is_changed():
    graphdef, state = nnx.split(
        nnx.eval_shape(lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
    )
    module = nnx.merge(graphdef, filled(state, 0))
    kernel = np.array(module.kernel.get_value())
    destination = bridge.probe(module)
    source = _linen(nn.Dense(2), jnp.ones((1, 3)))
    snapshots = numpy_snapshot((source, destination))
    ported = bridge.transfer(source, destination, jnp.ones((1, 3)))
    assert_tree_equal((source, destination), snapshots)
    np.testing.assert_array_equal(module.kernel.get_value(), kernel)
    np.testing.assert_array_equal(
        ported.params["kernel"].get_value(), source.variables["params"]["kernel"]
    )


def test_a_shared_module_moves_once():
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            dense = nn.Dense(3)
            return nn.Dense(2)(dense(dense(x)))

    class TwiceEqx(eqx.Module):
        dense: eqx.nn.Linear
        out: eqx.nn.Linear

        def __call__(self, x):
            return self.out(self.dense(self.dense(x)))

    x = jnp.ones((2, 3))
    source = _linen(Twice(), x)
    model = filled(
        eqx.filter_eval_shape(
            lambda key: TwiceEqx(
                eqx.nn.Linear(3, 3, key=key), eqx.nn.Linear(3, 2, key=key)
            ),
            jax.random.key(1),
        ),
        seed=1,
    )
    ported = bridge.transfer(source, bridge.probe(model, vmap=True), x)
    expected = jax.jit(source.module.apply)(source.variables, x)
    np.testing.assert_allclose(
        eqx.filter_jit(lambda model, x: jax.vmap(model)(x))(ported.model, x),
        expected,
        rtol=1e-5,
    )


# -- errors ---------------------------------------------------------------------


def _linen(module, x):
    return bridge.probe(
        module, filled(jax.eval_shape(module.init, jax.random.key(0), x), 0)
    )


def test_kinds_that_differ_are_named():
    x = jnp.ones((1, 4, 4, 2))
    dense = _linen(nn.Sequential([nn.Dense(3)]), x)
    conv = _linen(nn.Sequential([nn.Conv(3, (3, 3))]), x)
    with pytest.raises(
        ValueError,
        match=r"site 'layers_0' \(nn.Dense\) of the source and site 'layers_0' "
        r"\(nn.Conv\) of the destination: their kinds differ \(dense vs conv\)",
    ):
        bridge.transfer(dense, conv, x)


def test_different_numbers_of_modules_are_named():
    x = jnp.ones((1, 4))
    one = _linen(nn.Sequential([nn.Dense(4)]), x)
    two = _linen(nn.Sequential([nn.Dense(4), nn.Dense(4)]), x)
    with pytest.raises(
        ValueError,
        match=r"same number of parameterised modules.*first without a partner is "
        r"site 'layers_1' \(nn.Dense\) of the destination",
    ):
        bridge.transfer(one, two, x)


def test_shapes_that_do_not_fit_are_named():
    x = jnp.ones((1, 4))
    narrow = _linen(nn.Sequential([nn.Dense(4)]), x)
    model = eqx.nn.Sequential([eqx.nn.Linear(4, 5, key=jax.random.key(0))])
    with pytest.raises(
        ValueError,
        match=r"site 'layers_0' \(nn.Dense\).*site 'layers/0' "
        r"\(eqx.nn.Linear\).*'kernel' shapes do not fit, \(4, 4\) vs \(4, 5\)",
    ):
        bridge.transfer(narrow, bridge.probe(model, vmap=True), x)


def test_a_missing_bias_is_named():
    x = jnp.ones((1, 4))
    with_bias = _linen(nn.Sequential([nn.Dense(4)]), x)
    without = _linen(nn.Sequential([nn.Dense(4, use_bias=False)]), x)
    with pytest.raises(ValueError, match=r"the destination has no 'bias'"):
        bridge.transfer(with_bias, without, x)


def test_an_unknown_library_is_refused():
    class ThirdParty(bridge.adapter_api.ProbeBase):
        pass

    x = jnp.ones((1, 4))
    known = _linen(nn.Dense(4), x)
    with pytest.raises(TypeError, match=r"`dst_probe` is a ThirdParty.*Flax Linen"):
        bridge.transfer(known, ThirdParty(), x)


class _LinenConvNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(2, (3, 3), padding="SAME")(x)
        return nn.BatchNorm(use_running_average=True)(x).reshape(x.shape[0], -1)


class _EqxConvNorm(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm

    def __call__(self, x, state):
        x, state = self.norm(self.conv(jnp.transpose(x, (2, 0, 1))), state)
        return jnp.transpose(x, (1, 2, 0)).reshape(-1), state


def test_equinox_batch_mode_statistics_move_both_ways():
    """`mode="batch"` keeps zero-debiased statistics, like Haiku: read as
    hidden / (1 - momentum ** count), written with a settled count."""
    x = IMAGES[..., :1]
    linen = _linen(_LinenConvNorm(), x)

    def make(key):
        conv = eqx.nn.Conv2d(1, 2, 3, padding="SAME", key=key)
        return _EqxConvNorm(
            conv, eqx.nn.BatchNorm(2, "batch", inference=True, mode="batch")
        )

    model, state = eqx.nn.make_with_state(make)(jax.random.key(0))
    # A trained state: three steps of a zero-debiased average.
    state = state.set(model.norm.batch_counter, jnp.array(3))
    state = state.set(
        model.norm.batch_state_index,
        (jnp.full(2, 0.2, jnp.float32), jnp.full(2, 0.5, jnp.float32)),
    )
    equinox = bridge.probe(model, state, vmap=True)
    into_linen = bridge.transfer(equinox, linen, x)
    debias = 1 - 0.99**3
    np.testing.assert_allclose(
        into_linen.variables["batch_stats"]["BatchNorm_0"]["var"],
        0.5 / debias,
        rtol=1e-5,
    )
    back = bridge.transfer(into_linen, equinox, x)
    linen_outputs = jax.jit(outputs)(into_linen, x)
    np.testing.assert_allclose(
        jax.jit(outputs)(back, x), linen_outputs, rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        jax.jit(outputs)(equinox, x), linen_outputs, rtol=1e-5, atol=1e-5
    )


class _ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(4)(x)), None


class _LinenStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            _ScanBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
        )
        return stack()(x, None)[0]


class _EqxStack(eqx.Module):
    layers: eqx.nn.Linear  # three stacked Linears, scanned over

    def __call__(self, x):
        arrays, static = eqx.partition(self.layers, eqx.is_array)

        def step(x, layer):
            return jnp.tanh(eqx.combine(layer, static)(x)), None

        return jax.lax.scan(step, x, arrays)[0]


def test_scanned_layers_keep_their_iteration_axis():
    x = IMAGES[:, 0, :4, 0]
    linen = _linen(_LinenStack(), x)
    stacked = filled(
        eqx.filter_eval_shape(
            lambda keys: _EqxStack(
                eqx.filter_vmap(lambda key: eqx.nn.Linear(4, 4, key=key))(keys)
            ),
            jax.random.split(jax.random.key(0), 3),
        ),
        seed=3,
    )
    ported = bridge.transfer(linen, bridge.probe(stacked, vmap=True), x)
    kernel = linen.variables["params"]["Scan_ScanBlock_0"]["Dense_0"]["kernel"]
    np.testing.assert_array_equal(
        ported.model.layers.weight, jnp.swapaxes(kernel, 1, 2)
    )
    expected = jax.jit(linen.module.apply)(linen.variables, x)
    got = eqx.filter_jit(lambda model, x: jax.vmap(model)(x))(ported.model, x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
