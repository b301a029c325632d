"""Run in a subprocess with 8 simulated CPU devices (see tests/test_sharding.py).

An Equinox model with a scanned stack of layers, probed with and without
`vmap=True`: a batch-sharded jitted step gives the single-device numbers, and
the activation gradients stay sharded along the batch axis (axis 1 of a
scanned site without vmap, `(iterations, batch, ...)`; axis 0 otherwise).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import bridge

assert jax.device_count() == 8, jax.devices()


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
# Auto axes (GSPMD propagation); Explicit axes at the end.
mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
batch_sharded = NamedSharding(mesh, P("data"))
replicated = NamedSharding(mesh, P())
step = jax.jit(lambda probe, x: probe.value_and_grad(loss, x))

for vmap in (False, True):
    probe = bridge.probe(model, vmap=vmap)
    single = step(probe, x)
    # (iterations, batch, ...) with or without vmap=True.
    assert single.activation_grads["layers"].shape == (4, 32, 16)
    sharded = step(jax.device_put(probe, replicated), jax.device_put(x, batch_sharded))
    np.testing.assert_allclose(sharded.loss, single.loss, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        (sharded.grads, sharded.activations, sharded.activation_grads),
        (single.grads, single.activations, single.activation_grads),
    )
    for name, grad in sharded.activation_grads.items():
        spec = P(None, "data") if name == "layers" else P("data")
        assert grad.sharding.is_equivalent_to(NamedSharding(mesh, spec), grad.ndim), (
            vmap,
            name,
            grad.sharding,
        )


# shard_map: each device probes its shard. Epsilons vary across devices like
# the activations they perturb, or their gradients would be summed over devices.
def local_step(probe, x):
    res = probe.value_and_grad(lambda y: jnp.sum(jnp.square(y - 1.0)) / (32 * 16), x)
    return res.grads, res.activation_grads


for vmap in (False, True):
    probe = bridge.probe(model, vmap=vmap)
    single = step(probe, x)
    specs = {name: P("data") for name in single.activation_grads}
    specs["layers"] = P(None, "data")  # (iterations, batch, ...)
    local = jax.jit(
        jax.shard_map(
            local_step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), specs)
        )
    )
    grads, activation_grads = local(
        jax.device_put(probe, replicated), jax.device_put(x, batch_sharded)
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        (grads, activation_grads),
        (single.grads, single.activation_grads),
    )

# Explicit axes: the per-example model under the probe's vmap, its epsilons'
# batch axis sharded like the inputs'.
explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
probe = bridge.probe(model, vmap=True)
single = step(probe, x)
with jax.set_mesh(explicit):
    result = step(
        jax.device_put(probe, NamedSharding(explicit, P())),
        jax.device_put(x, NamedSharding(explicit, P("data"))),
    )
jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    (result.loss, result.grads, result.activation_grads),
    (single.loss, single.grads, single.activation_grads),
)
assert result.activation_grads["layers"].sharding.spec[:2] == (None, "data")
print("ok")
