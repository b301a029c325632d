"""With `vmap=True` each example draws its own randomness, as in a batched
model: every random key among the keywords `rng`, `rngs` and `key` is split
into one key per example, `jax.random.split(key, batch)`. Checked against the
library's own call on each example with its key, eager and jitted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bridge

BATCH = 4
#: The same example four times: only the randomness can tell them apart.
X = jnp.tile(jnp.linspace(-1.0, 1.0, 8), (BATCH, 1))


def _check(probe, plain, keywords, key, mode):
    """`plain(example, example_key)` is the library's own call of one example."""

    def run(probe, x, key):
        return probe.apply(x, **keywords(key)).outputs

    outputs = (jax.jit(run) if mode == "jit" else run)(probe, X, key)
    example_keys = jax.random.split(key, BATCH)
    expected = jnp.stack([plain(X[i], example_keys[i]) for i in range(BATCH)])
    np.testing.assert_allclose(outputs, expected, rtol=1e-5)
    # The masks differ between examples, and a fixed key reproduces them.
    assert not np.allclose(outputs[0], outputs[1])
    np.testing.assert_array_equal(outputs, run(probe, X, key))
    # value_and_grad maps them the same way.
    res = probe.value_and_grad(jnp.sum, X, **keywords(key))
    np.testing.assert_allclose(res.loss, expected.sum(), rtol=1e-5)


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("typed", [True, False], ids=["typed_key", "raw_key"])
def test_haiku_rng_is_split_per_example(mode, typed):
    hk = pytest.importorskip("haiku")

    def forward(x):
        return hk.dropout(hk.next_rng_key(), 0.5, hk.Linear(8)(x))

    transformed = hk.transform(forward)
    params = transformed.init(jax.random.key(0), X[0])
    key = jax.random.key(1) if typed else jax.random.PRNGKey(1)
    _check(
        bridge.probe(transformed, params, vmap=True),
        lambda x, k: transformed.apply(params, k, x),
        lambda k: {"rng": k},
        key,
        mode,
    )


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_linen_rngs_are_split_per_example(mode):
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(nn.Dense(8)(x))

    net = Net()
    variables = net.init(jax.random.key(0), X[0])
    _check(
        bridge.probe(net, variables, vmap=True),
        lambda x, k: net.apply(variables, x, rngs={"dropout": k}),
        lambda k: {"rngs": {"dropout": k}},
        jax.random.key(2),
        mode,
    )


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_equinox_key_is_split_per_example(mode):
    eqx = pytest.importorskip("equinox")

    class Net(eqx.Module):
        linear: eqx.nn.Linear
        dropout: eqx.nn.Dropout

        def __call__(self, x, *, key):
            return self.dropout(self.linear(x), key=key)

    net = Net(eqx.nn.Linear(8, 8, key=jax.random.key(0)), eqx.nn.Dropout(0.5))
    _check(
        bridge.probe(net, vmap=True),
        lambda x, k: net(x, key=k),
        lambda k: {"key": k},
        jax.random.key(3),
        mode,
    )


def test_without_vmap_the_key_passes_whole():
    """The model handles the batch: its one key draws the batch's masks."""
    hk = pytest.importorskip("haiku")
    transformed = hk.transform(lambda x: hk.dropout(hk.next_rng_key(), 0.5, x))
    key = jax.random.key(4)
    outputs = bridge.probe(transformed, {}).apply(X, rng=key).outputs
    np.testing.assert_array_equal(outputs, transformed.apply({}, key, X))
