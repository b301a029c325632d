"""Run in a subprocess with 8 simulated CPU devices (see tests/test_sharding.py).

The model scans a stack of layers with `hk.experimental.layer_stack` and
rematerialises its head: their sites ride in Haiku state, sharded like the
activations they perturb.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import bridge

assert jax.device_count() == 8, jax.devices()


def block(x):
    return jax.nn.relu(hk.Linear(32)(x))


def model(x):
    x = hk.Linear(32)(x)
    x = hk.experimental.layer_stack(2)(block)(x)
    return hk.remat(hk.Linear(4))(x)


def loss(y):
    return jnp.mean(jnp.square(y - 1.0))


x = jax.random.normal(jax.random.key(0), (32, 16))
transformed = hk.without_apply_rng(hk.transform(model))
params = transformed.init(jax.random.key(1), x)
probe = bridge.probe(transformed, params)
assert probe.sites(x)["__layer_stack_no_per_layer/linear"].shape == (2, 32, 32)
step = jax.jit(lambda probe, x: probe.value_and_grad(loss, x))
single = step(probe, x)

mesh = jax.make_mesh((8,), ("data",))
batch_sharded = NamedSharding(mesh, P("data"))
replicated = NamedSharding(mesh, P())
sharded = step(jax.device_put(probe, replicated), jax.device_put(x, batch_sharded))

np.testing.assert_allclose(sharded.loss, single.loss, rtol=1e-6)
jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    (sharded.grads, sharded.activation_grads),
    (single.grads, single.activation_grads),
)
for name, grad in sharded.activation_grads.items():
    # A stacked site's batch axis is its second: (layers, batch, features).
    spec = P(None, "data") if name.startswith("__layer_stack") else P("data")
    expected = NamedSharding(mesh, spec)
    assert grad.sharding.is_equivalent_to(expected, grad.ndim), (name, grad.sharding)


# shard_map: each device probes its shard. The epsilons must vary across
# devices like the activations they perturb, or their gradients (the activation
# gradients) would be summed over devices.
def local_step(probe, x):
    res = probe.value_and_grad(lambda y: jnp.sum(jnp.square(y - 1.0)) / 128, x)
    return res.grads, res.activation_grads


out_specs = {
    name: P(None, "data") if name.startswith("__layer_stack") else P("data")
    for name in single.activation_grads
}
local = jax.jit(
    jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=(P(), out_specs),
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
print("ok")
