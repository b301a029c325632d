"""Run in a subprocess with 8 simulated CPU devices (see tests/test_sharding.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import bridge

assert jax.device_count() == 8, jax.devices()


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.LayerNorm()(x)
        return nn.Dense(4)(x)


def loss(y):
    return jnp.mean(jnp.square(y - 1.0))


x = jax.random.normal(jax.random.key(0), (32, 16))
model = MLP()
probe = bridge.probe(model, model.init(jax.random.key(1), x))
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
    assert grad.sharding.is_equivalent_to(batch_sharded, grad.ndim), (
        name,
        grad.sharding,
    )


# shard_map: each device probes its shard. The epsilons must vary across
# devices like the activations they perturb, or their gradients (the activation
# gradients) would be summed over devices.
def local_step(probe, x):
    res = probe.value_and_grad(lambda y: jnp.sum(jnp.square(y - 1.0)) / 128, x)
    return res.grads, res.activation_grads


local = jax.jit(
    jax.shard_map(
        local_step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P("data"))
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

# Sharding in types (`Explicit` mesh axes): epsilons are created sharded like
# the activations, so activation gradients come back batch-sharded rather than
# replicated; with vmap=True the epsilons' batch axis is sharded like the
# inputs' (vmap refuses differently sharded mapped axes).
explicit = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
for vmap in (False, True):
    variables = model.init(jax.random.key(1), x[0] if vmap else x)
    one = bridge.probe(model, variables, vmap=vmap)
    reference = step(one, x)
    with jax.set_mesh(explicit):
        result = step(
            jax.device_put(one, NamedSharding(explicit, P())),
            jax.device_put(x, NamedSharding(explicit, P("data"))),
        )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        (result.loss, result.grads, result.activation_grads),
        (reference.loss, reference.grads, reference.activation_grads),
    )
    for name, grad in result.activation_grads.items():
        assert grad.sharding.spec[0] == "data", (vmap, name, grad.sharding)
print("ok")
