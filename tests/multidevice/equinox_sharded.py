"""Run in a subprocess with 8 simulated CPU devices (see tests/test_sharding.py).

An Equinox model with a scanned stack of layers, probed with and without
`vmap=True`: a batch-sharded jitted step gives the single-device numbers, and
the activation gradients stay sharded along the batch axis (axis 1 of a
scanned site without vmap, `(iterations, batch, ...)`; axis 0 otherwise).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from checks import (
    check_batch_sharded,
    check_explicit_axes,
    check_shard_map,
    stacked_spec,
)
from jax.sharding import AxisType

import bridge


class Dense(eqx.Module):
    weight: jax.Array
    bias: jax.Array

    def __init__(self, size, key):
        self.weight = jax.random.normal(key, (size, size)) / size**0.5
        self.bias = jnp.full((size,), 0.1)

    def __call__(self, x):
        h = x @ self.weight
        return jnp.tanh(h + jnp.broadcast_to(self.bias, h.shape))


class Stack(eqx.Module):
    embed: Dense
    layers: Dense
    head: Dense

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.embed = Dense(16, keys[0])
        self.layers = eqx.filter_vmap(lambda k: Dense(16, k))(
            jax.random.split(keys[1], 4)
        )
        self.head = Dense(16, keys[2])

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def step(h, arrays):
            return eqx.combine(arrays, static)(h) + h, None

        h, _ = jax.lax.scan(step, self.embed(x), dynamic)
        return self.head(h)


def loss(y):
    return jnp.mean(jnp.square(y - 1.0))


x = jax.random.normal(jax.random.key(0), (32, 16))
model = Stack(jax.random.key(1))
step = jax.jit(lambda probe, x: probe.value_and_grad(loss, x))
# (iterations, batch, ...) with or without vmap=True.
spec_of = stacked_spec(lambda name: name == "layers")
# Auto axes (GSPMD propagation); Explicit axes at the end.
auto = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

for vmap in (False, True):
    probe = bridge.probe(model, vmap=vmap)
    single = step(probe, x)
    assert single.activation_grads["layers"].shape == (4, 32, 16)
    check_batch_sharded(step, probe, x, single, spec_of, mesh=auto)
    check_shard_map(
        probe,
        x,
        single,
        spec_of,
        lambda y: jnp.sum(jnp.square(y - 1.0)) / (32 * 16),
        mesh=auto,
    )

# Explicit axes: the per-example model under the probe's vmap, its epsilons'
# batch axis sharded like the inputs'.
probe = bridge.probe(model, vmap=True)
result = check_explicit_axes(step, probe, x, step(probe, x))
assert result.activation_grads["layers"].sharding.spec[:2] == (None, "data")
print("ok")
